"""Update rules of a parameter-server shard (SGD, momentum, Adagrad, Adam, DiLoCo's outer
Nesterov), as plain objects: no sockets, no processes, no ``torch.optim``.

Kept apart from the networking so the arithmetic can be tested against ``torch.optim`` alone,
and without ``torch.optim``'s slow ``torch._dynamo`` import (see ``asyncsgd/modes/optim.py``).
"""

from __future__ import annotations

import abc
import math
import operator
from typing import Any, Dict, List, Tuple

import torch

RULES = ("sgd", "momentum", "adagrad", "adam", "nesterov", "delayed-nesterov")

_DTYPE = torch.float32


def _finite_float(what: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(out):
        raise ValueError(f"{what} must be finite, got {value!r}")
    return out


def _as_int(value: Any, message: str) -> int:
    """``value`` as an int (any integer type, never a bool), else ValueError(message)."""
    if isinstance(value, bool):
        raise ValueError(message)
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(message) from None


class UpdateRule(abc.ABC):
    """Base class: validation, the step counter, state allocation and (de)serialisation.

    Subclasses set ``name``, ``DEFAULTS`` (their hyperparameters and default
    values), ``STATE`` (names of their full-size float32 state tensors) and
    implement ``_check_hyper`` and ``_apply``.

    A push is a list of disjoint segments ``(offset, grad)`` of the shard's flat slice,
    usually tiling it. Each rule repeats the matching ``torch.optim`` single-tensor
    arithmetic op for op, so results agree to the last bit (with lr 1 and integer
    gradients plain SGD is exact, which the oracle tests rely on). State is allocated
    once, full size; a segment updates its slice of params and state through views, and
    uncovered elements are left untouched. One push is one step: Adam's ``t`` counts
    pushes, so under partial pushes an element's moments decay only when covered. Every
    push is validated whole before any element changes (``ValueError``, nothing
    written); ``grad`` may be a read-only network buffer and is never written.
    ``state_dict`` holds only tensors and plain values (loads with ``weights_only``).
    """

    name: str = "base"
    DEFAULTS: Dict[str, Any] = {}
    STATE: Tuple[str, ...] = ()

    def __init__(self, size: int, lr: float, **hyper):
        # 0: the dense slice of a shard that serves tables alone (more shards than dense
        # values); it takes no dense segment, so it never steps
        size = _as_int(size, f"size must be an int >= 0, got {size!r}")
        if size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        lr = _finite_float("lr", lr)
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        unknown = sorted(set(hyper) - set(self.DEFAULTS))
        if unknown:
            valid = ", ".join(sorted(self.DEFAULTS)) or "none"
            raise ValueError(f"unknown hyperparameter(s) for rule {self.name!r}: "
                             f"{', '.join(unknown)} (valid: {valid})")
        self.size = size
        self.lr = lr
        # Number of pushes applied (one per step() call, not per segment).
        self.steps = 0
        self._check_hyper({**self.DEFAULTS, **hyper})
        # Allocated once; segments update views of these in place.
        self.state: Dict[str, torch.Tensor] = {
            key: torch.zeros(size, dtype=_DTYPE) for key in self.STATE}

    # -- subclass hooks -------------------------------------------------
    def _check_hyper(self, hyper: Dict[str, Any]) -> None:
        """Validate the merged hyperparameters and store them as attributes."""

    def _hyper(self) -> Dict[str, Any]:
        """Hyperparameters as ints/floats, for state_dict."""
        return {}

    @abc.abstractmethod
    def _apply(self, p: torch.Tensor, g: torch.Tensor, o: int, lr: float) -> None:
        """Update the view ``p = params[o:o+n]`` with gradient ``g`` (never written)."""

    # -- public API -----------------------------------------------------
    def _validate(self, params: torch.Tensor, segments) -> List[Tuple[int, torch.Tensor]]:
        if not isinstance(params, torch.Tensor):
            raise ValueError(f"params must be a torch.Tensor, got {type(params).__name__}")
        if params.dtype != _DTYPE or params.dim() != 1 or params.numel() != self.size:
            raise ValueError(f"params must be a 1-D float32 tensor of {self.size} elements, "
                             f"got {params.dtype} of shape {tuple(params.shape)}")
        try:
            items = list(segments)
        except TypeError:
            raise ValueError("segments must be a list of (offset, grad) pairs") from None
        out: List[Tuple[int, torch.Tensor]] = []
        for i, seg in enumerate(items):
            try:
                offset, grad = seg
            except (TypeError, ValueError):
                raise ValueError(f"segment {i} is not an (offset, grad) pair") from None
            offset = _as_int(offset, f"segment {i}: offset must be an int, got {offset!r}")
            if not isinstance(grad, torch.Tensor):
                raise ValueError(f"segment {i}: grad must be a torch.Tensor, "
                                 f"got {type(grad).__name__}")
            if grad.dim() != 1:
                raise ValueError(f"segment {i}: grad must be 1-D, got shape {tuple(grad.shape)}")
            if grad.dtype != _DTYPE:
                raise ValueError(f"segment {i}: grad must be float32, got {grad.dtype}")
            if grad.device != params.device:
                raise ValueError(f"segment {i}: grad is on {grad.device}, "
                                 f"params on {params.device}")
            n = grad.numel()
            # An empty segment is rejected: no real push sends one, so it means a bug upstream.
            if n == 0 or not 0 <= offset < self.size or offset + n > self.size:
                raise ValueError(f"segment {i}: [{offset}, {offset + n}) is not a non-empty "
                                 f"range within [0, {self.size})")
            out.append((offset, grad))
        # Overlapping segments would apply part of the gradient (and update state) twice.
        spans = sorted((o, o + g.numel()) for o, g in out)
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            if b0 < a1:
                raise ValueError(f"segments overlap: [{a0}, {a1}) and [{b0}, {b1})")
        return out

    def step(self, params: torch.Tensor, segments: list, lr_scale: float = 1.0) -> None:
        """Apply one push: segments is a list of (offset, grad) pairs; counts as ONE optimizer step
        (e.g. Adam's step counter increments once per push, not per segment). lr_scale multiplies lr
        (used for staleness-scaled learning rates)."""
        lr_scale = _finite_float("lr_scale", lr_scale)
        if lr_scale <= 0:
            raise ValueError(f"lr_scale must be > 0, got {lr_scale!r}")
        # Validate everything first: a bad push must not leave a half-applied update.
        segs = self._validate(params, segments)
        # no_grad: params may be a leaf that requires grad (e.g. an nn.Parameter).
        with torch.no_grad():
            self.apply(params, segs, lr_scale)

    def apply(self, params: torch.Tensor, segments: list, lr_scale: float = 1.0) -> None:
        """``step`` without its checks, for a caller that has made them already.

        The shard validates every push completely before it applies one (dtypes,
        ranges, overlaps, finiteness) and calls this on its hot path, where the
        second validation cost as much as the update of a small model. ``params``
        must not require grad. A segment covering the whole tensor is applied to
        ``params`` itself (slicing costs a few microseconds per push).
        """
        lr = self.begin(lr_scale)
        for offset, grad in segments:
            self.apply_one(params, offset, grad, lr)

    def begin(self, lr_scale: float = 1.0) -> float:
        """Count one optimizer step (one push) and return its learning rate.

        ``apply`` is ``begin`` and then ``apply_one`` per segment; a shard that
        sends each part of its reply as soon as that part is updated calls them
        itself.
        """
        self.steps += 1
        return self.lr * lr_scale

    def apply_one(self, params: torch.Tensor, offset: int, grad: torch.Tensor, lr: float) -> None:
        """Apply one checked segment of the current step (see ``begin``)."""
        n = grad.shape[0]
        self._apply(params if n == self.size else params[offset: offset + n], grad, offset, lr)

    def apply_one_into(self, out: torch.Tensor, params: torch.Tensor, offset: int,
                       grad: torch.Tensor, lr: float) -> None:
        """``apply_one`` to ``params``' values, written to ``out`` (another buffer of the same
        size) instead of ``params``, which stays as it was."""
        n = grad.shape[0]
        whole = n == self.size
        self._apply_into(out if whole else out[offset: offset + n],
                         params if whole else params[offset: offset + n], grad, offset, lr)

    def _apply_into(self, out: torch.Tensor, p: torch.Tensor, g: torch.Tensor, o: int,
                    lr: float) -> None:
        """``_apply`` reading ``p`` and writing ``out``: a copy, then ``_apply`` on it; a rule
        that can write its result elsewhere in the same pass overrides this."""
        out.copy_(p)
        self._apply(out, g, o, lr)

    def state_dict(self) -> dict:
        """A snapshot (cloned tensors) of everything needed to continue: only tensors, ints,
        floats and strings."""
        return {
            "name": self.name,
            "size": self.size,
            "lr": self.lr,
            "steps": self.steps,
            "hyper": self._hyper(),
            "state": {key: t.clone() for key, t in self.state.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the step count and state tensors saved by ``state_dict``.

        Name and size must match this rule. Hyperparameters (lr included) are
        not taken from ``state``: the rule keeps the ones it was constructed
        with, so a resumed run follows its current configuration.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict, got {type(state).__name__}")
        missing = [k for k in ("name", "size", "steps", "state") if k not in state]
        if missing:
            raise ValueError(f"update-rule state lacks key(s): {', '.join(missing)}")
        if state["name"] != self.name:
            raise ValueError(f"update-rule state is for rule {state['name']!r}, "
                             f"this rule is {self.name!r}")
        if state["size"] != self.size:
            raise ValueError(f"update-rule state is for size {state['size']!r}, "
                             f"this rule has size {self.size}")
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"update-rule state has invalid steps {steps!r}")
        tensors = state["state"]
        if not isinstance(tensors, dict) or set(tensors) != set(self.STATE):
            got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
            raise ValueError(f"update-rule state tensors {got} do not match "
                             f"{sorted(self.STATE)} of rule {self.name!r}")
        for key in self.STATE:
            t = tensors[key]
            if (not isinstance(t, torch.Tensor) or t.dtype != _DTYPE or t.dim() != 1
                    or t.numel() != self.size):
                desc = (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                        else type(t).__name__)
                raise ValueError(f"update-rule state {key!r} must be a 1-D float32 tensor of "
                                 f"{self.size} elements, got {desc}")
        # All checked: now mutate (copy into the preallocated buffers).
        for key in self.STATE:
            self.state[key].copy_(tensors[key])
        self.steps = steps

    def __repr__(self) -> str:
        hyper = "".join(f", {k}={v!r}" for k, v in self._hyper().items())
        return f"{type(self).__name__}(size={self.size}, lr={self.lr!r}{hyper})"


def _non_negative(name: str, hyper: Dict[str, Any]) -> float:
    """Hyperparameter ``name`` (eps, weight_decay): a finite float >= 0."""
    value = _finite_float(name, hyper[name])
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def _weight_decay(hyper: Dict[str, Any]) -> float:
    return _non_negative("weight_decay", hyper)


def _betas(hyper: Dict[str, Any]) -> tuple:
    """Adam's (beta1, beta2): finite floats in [0, 1)."""
    betas = hyper["betas"]
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of floats, got {betas!r}") from None
    b1, b2 = _finite_float("betas[0]", b1), _finite_float("betas[1]", b2)
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"betas must be in [0, 1), got {betas!r}")
    return b1, b2


class SGD(UpdateRule):
    """``p -= lr * lr_scale * (g + wd * p)`` (torch.optim.SGD without momentum)."""

    name = "sgd"
    DEFAULTS = {"weight_decay": 0.0}

    def _check_hyper(self, hyper):
        self.weight_decay = _weight_decay(hyper)

    def _hyper(self):
        return {"weight_decay": self.weight_decay}

    def _apply(self, p, g, o, lr):
        if self.weight_decay:
            g = g.add(p, alpha=self.weight_decay)  # new segment-sized tensor: grad stays untouched
        # Exactly this and nothing more when weight_decay == 0: the exact-oracle tests depend on it.
        p.sub_(g, alpha=lr)

    def _apply_into(self, out, p, g, o, lr):
        if self.weight_decay:
            g = g.add(p, alpha=self.weight_decay)
        torch.sub(p, g, alpha=lr, out=out)  # the same kernel as sub_: the same bits


class Momentum(UpdateRule):
    """torch.optim.SGD with momentum (dampening 0, optional Nesterov).

    ``buf = m * buf + (g + wd * p)``; ``p -= lr * lr_scale * buf`` (Nesterov:
    ``p -= lr * lr_scale * (g' + m * buf)``). The buffer starts at zero, and
    ``m * 0 + g`` is exactly ``g``, so the first step equals torch's
    ``buf = g.clone()`` without tracking which elements were ever pushed.
    """

    name = "momentum"
    DEFAULTS = {"momentum": 0.9, "weight_decay": 0.0, "nesterov": False}
    STATE = ("momentum_buffer",)

    def _check_hyper(self, hyper):
        m = _finite_float("momentum", hyper["momentum"])
        if not 0 <= m < 1:
            raise ValueError(f"momentum must be in [0, 1), got {m!r}")
        nesterov = hyper["nesterov"]
        if nesterov not in (True, False, 0, 1):
            raise ValueError(f"nesterov must be a bool, got {nesterov!r}")
        if nesterov and m == 0:
            raise ValueError("nesterov momentum requires momentum > 0")
        self.momentum, self.nesterov = m, bool(nesterov)
        self.weight_decay = _weight_decay(hyper)

    def _hyper(self):
        # nesterov as an int: state_dict holds only tensors, ints, floats and strings.
        return {"momentum": self.momentum, "weight_decay": self.weight_decay,
                "nesterov": int(self.nesterov)}

    def _apply(self, p, g, o, lr):
        if self.weight_decay:
            g = g.add(p, alpha=self.weight_decay)
        buf = self.state["momentum_buffer"][o: o + g.numel()]
        buf.mul_(self.momentum).add_(g)
        if self.nesterov:
            p.sub_(g.add(buf, alpha=self.momentum), alpha=lr)
        else:
            p.sub_(buf, alpha=lr)


class Adagrad(UpdateRule):
    """torch.optim.Adagrad (lr_decay 0, initial_accumulator_value 0).

    ``sum += g * g``; ``p -= lr * lr_scale * g / (sqrt(sum) + eps)``.
    """

    name = "adagrad"
    DEFAULTS = {"eps": 1e-10, "weight_decay": 0.0}
    STATE = ("sum",)

    def _check_hyper(self, hyper):
        self.eps = _non_negative("eps", hyper)
        self.weight_decay = _weight_decay(hyper)

    def _hyper(self):
        return {"eps": self.eps, "weight_decay": self.weight_decay}

    def _apply(self, p, g, o, lr):
        if self.weight_decay:
            g = g.add(p, alpha=self.weight_decay)
        acc = self.state["sum"][o: o + g.numel()]
        acc.addcmul_(g, g, value=1)
        std = acc.sqrt().add_(self.eps)  # segment-sized temporary
        p.addcdiv_(g, std, value=-lr)


class Adam(UpdateRule):
    """torch.optim.Adam (not amsgrad; weight_decay is L2 added to the gradient, default 0).

    Bias correction uses ``t = self.steps``, incremented once per push.
    """

    name = "adam"
    DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    STATE = ("exp_avg", "exp_avg_sq")

    def _check_hyper(self, hyper):
        self.beta1, self.beta2 = _betas(hyper)
        self.eps = _non_negative("eps", hyper)
        self.weight_decay = _weight_decay(hyper)

    def _hyper(self):
        return {"beta1": self.beta1, "beta2": self.beta2, "eps": self.eps,
                "weight_decay": self.weight_decay}

    def _apply(self, p, g, o, lr):
        if self.weight_decay:
            g = g.add(p, alpha=self.weight_decay)
        n = g.numel()
        m = self.state["exp_avg"][o: o + n]
        v = self.state["exp_avg_sq"][o: o + n]
        m.lerp_(g, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        # Same scalar expressions as torch's single-tensor Adam, so results match bit for bit.
        t = self.steps
        bias_correction1 = 1 - self.beta1 ** t
        bias_correction2 = 1 - self.beta2 ** t
        step_size = lr / bias_correction1
        denom = (v.sqrt() / bias_correction2 ** 0.5).add_(self.eps)  # segment-sized temporary
        p.addcdiv_(m, denom, value=-step_size)


class Nesterov(Momentum):
    """DiLoCo's outer optimizer (Douillard et al. 2023: lr 0.7, momentum 0.9):
    torch.optim.SGD with Nesterov momentum, applied to the pseudo-gradients (pulled minus
    local parameters) that workers push with --local-steps. ``momentum`` with nesterov."""

    name = "nesterov"
    DEFAULTS = {"momentum": 0.9, "weight_decay": 0.0, "nesterov": True}

    def _check_hyper(self, hyper):
        if not hyper["nesterov"]:
            raise ValueError("rule 'nesterov' is Nesterov momentum; use 'momentum' without it")
        super()._check_hyper(hyper)


class DelayedNesterov(UpdateRule):
    """The outer optimizer of asynchronous Local SGD (Liu et al. 2024, "delayed Nesterov"),
    for pushes that arrive one at a time rather than in rounds.

    Every push moves the parameters at once by ``lr * g / period``; every ``period``-th push
    also folds the mean of the last ``period`` pushes into the momentum buffer and moves by
    ``lr * momentum * buf`` (their c = 0). Momentum so follows the pushes of many workers, as
    sync DiLoCo's round mean does, not each stale push alone. ``period`` 1 is Nesterov
    momentum on every push with the gradient term ``g`` (not ``g + momentum * buf``'s g)."""

    name = "delayed-nesterov"
    DEFAULTS = {"momentum": 0.9, "period": 2, "weight_decay": 0.0}
    STATE = ("momentum_buffer", "pending")

    def _check_hyper(self, hyper):
        m = _finite_float("momentum", hyper["momentum"])
        if not 0 <= m < 1:
            raise ValueError(f"momentum must be in [0, 1), got {m!r}")
        period = _as_int(hyper["period"], f"period must be an int, got {hyper['period']!r}")
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        self.momentum, self.period = m, period
        self.weight_decay = _weight_decay(hyper)

    def _hyper(self):
        return {"momentum": self.momentum, "period": self.period,
                "weight_decay": self.weight_decay}

    def _apply(self, p, g, o, lr):
        if self.weight_decay:
            g = g.add(p, alpha=self.weight_decay)
        n = g.numel()
        buf = self.state["momentum_buffer"][o: o + n]
        pending = self.state["pending"][o: o + n]
        pending.add_(g)
        if self.steps % self.period == 0:  # this push ends a period (steps counts it already)
            buf.mul_(self.momentum).add_(pending, alpha=1.0 / self.period)
            p.add_(buf, alpha=-lr * self.momentum)
            pending.zero_()
        p.add_(g, alpha=-lr / self.period)


_CLASSES = {cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam, Nesterov, DelayedNesterov)}
assert tuple(_CLASSES) == RULES


def make_rule(name: str, size: int, lr: float, **hyper) -> UpdateRule:
    """The rule called ``name`` (one of RULES); ValueError naming the valid names otherwise."""
    cls = _CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown update rule {name!r}; valid rules: {', '.join(RULES)}")
    return cls(size, lr, **hyper)


def staleness_scale(staleness: int) -> float:
    """1 / max(1, staleness): the staleness-aware learning rate of Zhang et al. 2016.

    Staleness 0 (no update happened since the worker pulled) and 1 both give 1.0.
    A negative staleness can only come from a bookkeeping bug, so it raises ValueError.
    """
    if isinstance(staleness, bool):
        raise ValueError(f"staleness must be an int, got {staleness!r}")
    try:
        staleness = operator.index(staleness)
    except TypeError:
        raise ValueError(f"staleness must be an int, got {staleness!r}") from None
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0 / max(1, staleness)


def dc_asgd(grad: torch.Tensor, params: torch.Tensor, backup: torch.Tensor,
            lam: float) -> torch.Tensor:
    """Delay-compensated gradient (Zheng et al. 2017, DC-ASGD):
    g + lam * g * g * (params - backup), where backup is the parameter values the worker
    pulled. Returns a new tensor; never writes grad."""
    if not (isinstance(grad, torch.Tensor) and isinstance(params, torch.Tensor)
            and isinstance(backup, torch.Tensor)):
        raise ValueError("grad, params and backup must be tensors")
    if grad.shape != params.shape or grad.shape != backup.shape:
        raise ValueError(f"shape mismatch: grad {tuple(grad.shape)}, params "
                         f"{tuple(params.shape)}, backup {tuple(backup.shape)}")
    lam = _finite_float("lam", lam)
    # One new tensor (params - backup), then in place on it only: inputs are never written.
    out = torch.sub(params, backup)
    out.mul_(grad).mul_(grad).mul_(lam)
    return out.add_(grad)
