"""A small SGD for training processes.

Why not ``torch.optim.SGD``: constructing the first torch optimizer imports
``torch._dynamo``, 1.6 s of CPU per process here. Eight Hogwild processes on
two cores would spend 13 s of start-up on it. This one does the same
arithmetic (PyTorch's SGD with momentum and L2 weight decay, dampening 0)
and handles sparse gradients so that an update touches only the rows a batch used.
``Adam`` is the parameter server's adam rule in the same shape, and ``Delayed`` applies
any of them S steps late (``single --simulate-staleness``).
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
            if self.weight_decay:
                g = g.add(p, alpha=self.weight_decay)
            if i not in self.buffers:
                self.buffers[i] = (torch.zeros_like(p), torch.zeros_like(p))
            m, v = self.buffers[i]
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            denom = (v.sqrt() / bias_correction2 ** 0.5).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bias_correction1)


class Delayed:
    """Staleness in isolation (Dai et al., ICLR 2019): the gradient computed at step t is
    applied at step t + ``staleness`` by ``inner``, as if S other workers' updates had
    landed between a worker's pull and its push.

    The first S steps apply nothing (their gradients are in flight); when the run ends the
    last S gradients are never applied, as a parameter server's run ends with pushes in
    flight. The queue is not checkpointed: a resumed run starts with it empty.

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
