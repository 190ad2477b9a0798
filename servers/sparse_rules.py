"""Update rules of row-sparse tables (sgd, adagrad, rowwise adagrad, lazy adam) as plain
objects: each updates only the rows a push names, and only their optimizer state.

Each repeats the arithmetic of its dense reference op for op on the gathered rows, so the
touched rows agree to the last bit with the reference fed zeros elsewhere (torch.optim.SGD,
torch.optim.Adagrad, TorchRec's rowwise adagrad, torch.optim.SparseAdam).
"""

from __future__ import annotations

import abc
import math
from typing import Any, Dict, Tuple

import torch

from .rules import _betas, _finite_float, _non_negative

SPARSE_RULES = ("sgd", "adagrad", "rowwise_adagrad", "lazy_adam")


class SparseRule(abc.ABC):
    """Base class: the learning rate, the step counter and state that grows with the table.

    ``STATE`` names each state tensor and its width: ``"dim"`` (one value per element,
    [rows, dim]) or 1 (one per row, [rows]). ``apply`` takes checked, unique ``slots`` of
    the table's ``rows`` and float32 grads [n, dim]; one call is one step.
    """

    name = "base"
    DEFAULTS: Dict[str, Any] = {}
    STATE: Tuple[Tuple[str, object], ...] = ()

    def __init__(self, dim: int, lr: float, **hyper):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        lr = _finite_float("lr", lr)
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        unknown = sorted(set(hyper) - set(self.DEFAULTS))
        if unknown:
            raise ValueError(f"unknown hyperparameter(s) for sparse rule {self.name!r}: "
                             f"{', '.join(unknown)} (valid: "
                             f"{', '.join(sorted(self.DEFAULTS)) or 'none'})")
        self.dim, self.lr, self.steps = dim, lr, 0
        self._check_hyper({**self.DEFAULTS, **hyper})
        self.state: Dict[str, torch.Tensor] = {}
        self.resize(0)

    def _check_hyper(self, hyper: Dict[str, Any]) -> None:
        """Validate the merged hyperparameters and keep them as attributes."""

    def _shape(self, width: object, rows: int) -> tuple:
        return (rows, self.dim) if width == "dim" else (rows,)

    def resize(self, rows: int) -> None:
        """Hold state for ``rows`` slots: kept values stay, new slots start at zero."""
        for key, width in self.STATE:
            new = torch.zeros(self._shape(width, rows), dtype=torch.float32)
            old = self.state.get(key)
            if old is not None:
                keep = min(rows, old.shape[0])
                new[:keep] = old[:keep]
            self.state[key] = new

    def compact(self, keep: torch.Tensor, rows: int) -> None:
        """Hold state for ``rows`` slots, the first ``len(keep)`` being old slots ``keep``."""
        for key, width in self.STATE:
            new = torch.zeros(self._shape(width, rows), dtype=torch.float32)
            new[:keep.numel()] = self.state[key][keep]
            self.state[key] = new

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the state of ``slots``: rows created afresh (new, or back after eviction)."""
        for t in self.state.values():
            t[slots] = 0

    def apply(self, rows: torch.Tensor, slots: torch.Tensor, grads: torch.Tensor,
              lr_scale: float = 1.0) -> None:
        """One step: update ``rows[slots]`` (and their state) with ``grads``, never written."""
        self.steps += 1
        p = rows[slots]
        self._apply(p, slots, grads, self.lr * lr_scale)
        rows[slots] = p

    @abc.abstractmethod
    def _apply(self, p: torch.Tensor, slots: torch.Tensor, g: torch.Tensor, lr: float) -> None:
        """Update ``p`` (the rows of ``slots``, a copy written back) with gradient ``g``."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    def state_dict(self) -> dict:
        """The step count and state tensors (cloned): tensors, ints and strings only."""
        return {"name": self.name, "steps": self.steps,
                "state": {k: t.clone() for k, t in self.state.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict``'s output; hyperparameters stay those constructed with."""
        if state.get("name") != self.name:
            raise ValueError(f"sparse rule state is for {state.get('name')!r}, "
                             f"this rule is {self.name!r}")
        tensors = state["state"]
        if set(tensors) != {key for key, _ in self.STATE}:
            raise ValueError(f"sparse rule state tensors {sorted(tensors)} do not match "
                             f"rule {self.name!r}")
        for key, width in self.STATE:
            t = tensors[key]
            row = self._shape(width, 0)[1:]
            if t.dtype != torch.float32 or tuple(t.shape[1:]) != row:
                raise ValueError(f"sparse rule state {key!r} has {t.dtype} "
                                 f"{tuple(t.shape)}, not float32 rows of {row}")
        self.state = {key: tensors[key].clone() for key, _ in self.STATE}
        self.steps = int(state["steps"])


class SparseSGD(SparseRule):
    """``p -= lr * g`` on the rows pushed (torch.optim.SGD)."""

    name = "sgd"

    def _apply(self, p, slots, g, lr):
        p.sub_(g, alpha=lr)


class SparseAdagrad(SparseRule):
    """torch.optim.Adagrad per element: ``sum += g * g``; ``p -= lr * g / (sqrt(sum) + eps)``."""

    name = "adagrad"
    DEFAULTS = {"eps": 1e-10}
    STATE = (("sum", "dim"),)

    def _check_hyper(self, hyper):
        self.eps = _non_negative("eps", hyper)

    def _apply(self, p, slots, g, lr):
        acc = self.state["sum"][slots]
        acc.addcmul_(g, g, value=1)
        self.state["sum"][slots] = acc
        p.addcdiv_(g, acc.sqrt().add_(self.eps), value=-lr)


class RowwiseAdagrad(SparseRule):
    """TorchRec/fbgemm's rowwise adagrad: one accumulator per row, ``sum += mean(g * g)``
    over the row; ``p -= lr * g / (sqrt(sum) + eps)``. Its state is 1/dim of adagrad's."""

    name = "rowwise_adagrad"
    DEFAULTS = {"eps": 1e-10}
    STATE = (("sum", 1),)

    def _check_hyper(self, hyper):
        self.eps = _non_negative("eps", hyper)

    def _apply(self, p, slots, g, lr):
        acc = self.state["sum"][slots]
        acc.add_(g.pow(2).mean(dim=1))
        self.state["sum"][slots] = acc
        p.addcdiv_(g, acc.sqrt().add_(self.eps).unsqueeze(1), value=-lr)


class LazyAdam(SparseRule):
    """torch.optim.SparseAdam: moments decay only in the rows pushed; bias correction counts
    every push (``steps``), as SparseAdam's step does."""

    name = "lazy_adam"
    DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8}
    STATE = (("exp_avg", "dim"), ("exp_avg_sq", "dim"))

    def _check_hyper(self, hyper):
        self.beta1, self.beta2 = _betas(hyper)
        self.eps = _non_negative("eps", hyper)

    def _apply(self, p, slots, g, lr):
        # SparseAdam's ops in its order: old + (1 - b) * (new - old), then the step
        old_m, old_v = self.state["exp_avg"][slots], self.state["exp_avg_sq"][slots]
        upd_m = g.sub(old_m).mul_(1 - self.beta1)
        upd_v = g.pow(2).sub_(old_v).mul_(1 - self.beta2)
        self.state["exp_avg"][slots] = old_m + upd_m
        self.state["exp_avg_sq"][slots] = old_v + upd_v
        numer = upd_m.add_(old_m)
        denom = upd_v.add_(old_v).sqrt_().add_(self.eps)
        bias1, bias2 = 1 - self.beta1 ** self.steps, 1 - self.beta2 ** self.steps
        step_size = lr * math.sqrt(bias2) / bias1
        p.add_(-step_size * numer.div_(denom))


_CLASSES = {cls.name: cls for cls in (SparseSGD, SparseAdagrad, RowwiseAdagrad, LazyAdam)}
assert tuple(_CLASSES) == SPARSE_RULES


def make_sparse_rule(name: str, dim: int, lr: float, **hyper) -> SparseRule:
    """The sparse rule called ``name`` (one of SPARSE_RULES); ValueError naming them otherwise."""
    cls = _CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown sparse rule {name!r}; valid rules: {', '.join(SPARSE_RULES)}")
    return cls(dim, lr, **hyper)
