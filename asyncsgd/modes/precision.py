"""Mixed precision of every mode that computes gradients: ``--amp off|bf16|fp16``.

The forward pass and loss run under ``torch.autocast``, everything else stays float32; fp16
adds a gradient scaler (under DDP it sees the all-reduced gradients, so every rank skips the
same steps), bf16 has float32's range and needs none.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Optional

import torch

from ..errors import ConfigError

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_amp(amp: str, device: str) -> None:
    """Reject what cannot work, before any process starts."""
    if amp not in ("off", *DTYPES):
        raise ConfigError(f"--amp {amp!r}: choose off, bf16 or fp16")
    if amp == "fp16" and device != "cuda":
        raise ConfigError("--amp fp16 needs --device cuda (CPU autocast has no fast float16 "
                          "kernels); use --amp bf16 on CPU, or --amp off")


class Precision:
    """Runs a step's forward under autocast and its backward and update, scaled for fp16."""

    def __init__(self, amp: str, device_type: str):
        self.amp, self.device_type = amp, device_type
        self.dtype = DTYPES.get(amp)
        self.scaler = None
        if amp == "fp16":
            from torch.amp import GradScaler  # only here: it is not free to import
            self.scaler = GradScaler(device_type)
        if amp == "bf16" and device_type == "cpu":
            log.info("bf16 autocast on CPU: faster only on CPUs with bf16 instructions "
                     "(AVX512-BF16, AMX); elsewhere it is slower than float32")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward_and_step(self, loss: torch.Tensor, optimizer,
                          between: Optional[Callable[[], object]] = None) -> None:
        """``between``: called once the gradients are computed, before the step."""
        self.backward(loss)
        if between is not None:
            between()
        self.step(optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss`` added to ``.grad`` (scaled, for fp16)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def unscale(self, optimizer) -> None:
        """The gradients as computed, fp16's scale taken off (to clip them); at most once a
        step."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
        """The update; fp16 skips a step whose gradients overflowed and adjusts its scale."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def overflowed(self, optimizer, grads: torch.Tensor) -> bool:
        """For gradients applied elsewhere (a parameter server's worker pushes them): take
        fp16's scale off ``grads`` (the gradients of ``optimizer``'s parameters), adjust
        the scale, and say whether they overflowed, so the caller drops them."""
        if self.scaler is None:
            return False
        self.scaler.unscale_(optimizer)
        overflowed = not bool(torch.isfinite(grads).all())
        self.scaler.update()
        return overflowed

    def state(self) -> dict:
        """What summary.json records about the precision (the fp16 scale it ended at)."""
        info = {"amp": self.amp}
        if self.scaler is not None:
            info["grad_scale"] = float(self.scaler.get_scale())
        return info
