"""Modules built on the meta device for their shapes alone, without importing torch._dynamo.

On a meta tensor, ``normal_``, ``clamp_`` and ``erfinv_`` run Python references whose first
call imports torch._dynamo: 0.8 s of CPU (torch 2.13, measured 2026-11-29), paid by every
process that built the ctr model on the meta device (the task's parameter count, a PS
worker's served tables). Their values are never read there, so they are skipped.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

# The factories a module's __init__ makes its parameters and buffers with (nn.Embedding and
# nn.Linear: torch.empty; norms: torch.ones and torch.zeros)
FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn,
                       torch.full, torch.arange, torch.eye})
# Those whose positional arguments are the shape (torch.arange(a, b) is no shape (a, b))
SHAPED = frozenset({torch.empty, torch.zeros, torch.ones, torch.rand, torch.randn})
# In-place initializers that only draw or bound values (nn.init's normal_, uniform_,
# trunc_normal_, kaiming_*, xavier_*): on a meta tensor there are no values to draw
DRAWS = frozenset({"normal_", "uniform_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_",
                   "exponential_", "log_normal_", "cauchy_", "geometric_", "bernoulli_",
                   "random_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_"})


class OnMeta(TorchFunctionMode):
    """Within it, every factory call on no device named makes its tensor on the meta device
    (only those of ``shapes``, when given), and drawing values into a meta tensor is skipped."""

    def __init__(self, shapes: Optional[set] = None):
        super().__init__()
        self.shapes = shapes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in DRAWS:
            # nn.init's functions pass their tensor by name, a tensor's methods first
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        if func in FACTORIES and kwargs.get("device") is None and (
                self.shapes is None or (func in SHAPED and shape_asked(args) in self.shapes)):
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def shape_asked(args: tuple) -> tuple:
    """The shape a factory call asks for: ``f((2, 3))`` or ``f(2, 3)``."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    return tuple(args) if all(isinstance(a, int) for a in args) else ()
