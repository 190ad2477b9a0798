"""A small SGD for training processes.

Why not ``torch.optim.SGD``: constructing the first torch optimizer imports
``torch._dynamo``, 1.6 s of CPU per process here. Eight Hogwild processes on
two cores would spend 13 s of start-up on it. This one does the same
arithmetic (PyTorch's SGD with momentum and L2 weight decay, dampening 0)
and handles sparse gradients so that an update touches only the rows a batch used.
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
