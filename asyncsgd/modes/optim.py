"""A small SGD (and Adam, AdamW, Delayed) for training processes, with state for full checkpoints.

Not ``torch.optim``: its first optimizer imports ``torch._dynamo``, seconds of CPU per process
(experiments/README.md, "Start-up and exit"). The arithmetic is PyTorch's, and sparse
gradients update only the rows a batch used.
"""

from __future__ import annotations

from typing import Iterable

import torch


class SGD:
    """``p -= lr * (g + wd * p)``, or with momentum ``b = m * b + g; p -= lr * b``.

    Sparse gradients (from ``EmbeddingBag(sparse=True)``) update only their
    rows, with weight decay applied to those rows; with momentum the buffer is
    dense, so each update then touches the whole parameter.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"invalid SGD settings lr={lr} momentum={momentum} "
                             f"weight_decay={weight_decay}")
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: dict = {}

    @property
    def param_groups(self) -> list:
        """The one parameter group, in torch.optim's shape: ``torch.amp.GradScaler`` unscales
        the gradients it finds here."""
        return [{"params": self.params}]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce()
                if self.weight_decay:
                    rows = g.indices()[0]
                    g = torch.sparse_coo_tensor(
                        g.indices(), g.values() + self.weight_decay * p[rows], g.shape,
                        is_coalesced=True, check_invariants=False)
            elif self.weight_decay:
                g = g.add(p, alpha=self.weight_decay)
            if self.momentum:
                buf = self.buffers.get(i)
                if buf is None:
                    buf = self.buffers[i] = g.to_dense().clone() if g.is_sparse else g.clone()
                else:
                    buf.mul_(self.momentum).add_(g)
                g = buf
            p.add_(g, alpha=-self.lr)

    KIND = "sgd"

    def keep_buffers_in(self, tensors: list) -> None:
        """Momentum buffers in these zeroed tensors (e.g. shared memory, so another process
        can checkpoint them), one per trainable parameter. A zero buffer's first update
        ``b = m * b + g`` gives ``b = g``, as a fresh buffer would."""
        if len(tensors) != len(self.params) or any(
                t.shape != p.shape for t, p in zip(tensors, self.params)):
            raise ValueError("the momentum buffers do not match the trainable parameters")
        self.buffers = dict(enumerate(tensors))

    def state_dict(self) -> dict:
        """The momentum buffers (copies), by parameter index."""
        return {"kind": self.KIND, "buffers": {i: b.detach().clone()
                                               for i, b in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``; ValueError naming what does not fit this optimizer."""
        _check_kind(state, self.KIND)
        buffers = state.get("buffers")
        if not isinstance(buffers, dict):
            raise ValueError("its optimizer state has no buffers")
        for i, saved in buffers.items():
            self._copy_in(i, saved)

    def _copy_in(self, i, saved: torch.Tensor) -> None:
        """Buffer ``i`` from ``saved``: into the buffer there is (shared memory stays
        shared), else a new one."""
        saved = _fitting(self.params, i, saved)
        if i in self.buffers:
            self.buffers[i].copy_(saved)
        else:
            self.buffers[i] = saved


def _fitting(params: list, i, saved) -> torch.Tensor:
    """``saved`` as a new buffer of parameter ``i``; ValueError when it does not fit."""
    if not isinstance(i, int) or not 0 <= i < len(params):
        raise ValueError(f"its optimizer state has a buffer for parameter {i!r}; this "
                         f"model has {len(params)} trainable parameters")
    if not isinstance(saved, torch.Tensor) or saved.shape != params[i].shape:
        raise ValueError(f"its optimizer buffer {i} has shape "
                         f"{tuple(getattr(saved, 'shape', ()))}, parameter {i} of this "
                         f"model {tuple(params[i].shape)}")
    return saved.to(device=params[i].device, dtype=params[i].dtype).clone()


def _check_kind(state, kind: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"its optimizer state is {found}'s, this run's optimizer is {kind}")


class Adam(SGD):
    """torch.optim.Adam (not amsgrad; weight decay is L2 added to the gradient), with the
    arithmetic of the parameter server's ``adam`` rule (``asyncsgd.servers.rules.Adam``), so a
    single-process run and a PS run apply the same update. Dense gradients only."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        t = self.steps
        bias_correction1 = 1 - self.beta1 ** t
        bias_correction2 = 1 - self.beta2 ** t
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise ValueError("--optimizer adam takes dense gradients; this model's are "
                                 "sparse (use sgd or momentum)")
            if self.weight_decay and self.DECOUPLED:
                p.mul_(1 - self.lr * self.weight_decay)
            elif self.weight_decay:
                g = g.add(p, alpha=self.weight_decay)
            if i not in self.buffers:
                self.buffers[i] = (torch.zeros_like(p), torch.zeros_like(p))
            m, v = self.buffers[i]
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (v.sqrt() / bias_correction2 ** 0.5).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bias_correction1)

    KIND = "adam"
    DECOUPLED = False

    def state_dict(self) -> dict:
        """The moments (copies) by parameter index, and the step count of bias correction."""
        return {"kind": self.KIND, "steps": self.steps,
                "buffers": {i: [m.detach().clone(), v.detach().clone()]
                            for i, (m, v) in self.buffers.items()}}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, self.KIND)
        buffers, steps = state.get("buffers"), state.get("steps")
        if not isinstance(buffers, dict) or not isinstance(steps, int):
            raise ValueError("its adam state lacks its moments or step count")
        for i, pair in buffers.items():
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"its adam moments of parameter {i!r} are not a pair")
            self.buffers[i] = tuple(_fitting(self.params, i, saved) for saved in pair)
        self.steps = steps


class AdamW(Adam):
    """torch.optim.AdamW: the weight decay shrinks the parameters (``p *= 1 - lr * wd``)
    before the Adam step instead of joining the gradient (DiLoCo's inner optimizer)."""

    KIND = "adamw"
    DECOUPLED = True


class Delayed:
    """Staleness in isolation (Dai et al., ICLR 2019): the gradient computed at step t is
    applied at step t + ``staleness`` by ``inner``, as if S other workers' updates had
    landed between a worker's pull and its push.

    The first S steps apply nothing (their gradients are in flight); when the run ends the
    last S gradients are never applied, as a parameter server's run ends with pushes in
    flight. A full checkpoint holds the queue (``state_dict``).

    The queue holds the gradient tensors backward made, not copies: ``zero_grad`` sets
    ``p.grad`` to None before each backward, so the next one makes new tensors. Sparse
    gradients stay sparse in the queue and, applied, update only their own batch's rows
    (with plain SGD: momentum's buffer is dense).
    """

    def __init__(self, inner: SGD, staleness: int):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.inner, self.staleness = inner, staleness
        self.in_flight: list = []   # oldest first: one list of gradients per step
        self.applied = 0

    @property
    def params(self) -> list:
        return self.inner.params

    @property
    def lr(self) -> float:
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        self.in_flight.append([p.grad for p in self.params])
        if len(self.in_flight) <= self.staleness:
            return
        for p, g in zip(self.params, self.in_flight.pop(0)):
            p.grad = g   # zero_grad() set p.grad = None before this step: no copy needed
        self.inner.step()
        self.applied += 1

    def state_dict(self) -> dict:
        """The inner rule's state, and the gradients in flight (oldest first)."""
        return {"kind": "delayed", "staleness": self.staleness, "inner": self.inner.state_dict(),
                "in_flight": [[None if g is None else g.detach().clone() for g in step]
                              for step in self.in_flight]}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "delayed")
        if state.get("staleness") != self.staleness:
            raise ValueError(f"it was saved with --simulate-staleness {state.get('staleness')}, "
                             f"this run has {self.staleness}")
        queue = state.get("in_flight")
        if not isinstance(queue, list) or any(
                not isinstance(step, list) or len(step) != len(self.params) for step in queue):
            raise ValueError("its queue of gradients in flight does not fit this model")
        for step in queue:
            for p, g in zip(self.params, step):
                if g is not None and g.shape != p.shape:
                    raise ValueError(f"a gradient in flight has shape {tuple(g.shape)}, "
                                     f"its parameter {tuple(p.shape)}")
        self.inner.load_state_dict(state.get("inner"))
        device = self.params[0].device if self.params else None
        # ``applied`` is not restored: summary.json counts it since this process started
        self.in_flight = [[None if g is None else g.to(device) for g in step] for step in queue]
