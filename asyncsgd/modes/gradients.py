"""What a step does with its gradients in every mode: --accumulate and --clip-grad-norm.

A step's rows are split into K micro-batches whose weighted losses add up to the mean loss
over all the rows, so the summed gradients are the whole batch's mean gradient; clipping
rescales them as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch



def micro_batches(rows: torch.Tensor, k: int) -> list:
    """``rows`` cut into at most ``k`` near-equal, non-empty parts, each with its share of
    the rows: the weight of its mean loss in the step's mean."""
    parts = [part for part in torch.tensor_split(rows, k) if len(part)]
    return [(part, len(part) / len(rows)) for part in parts]


def accumulate(rows: torch.Tensor, k: int, loss_of: Callable[[torch.Tensor], torch.Tensor],
               backward: Callable[[torch.Tensor], None],
               no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
               ) -> torch.Tensor:
    """Backward of each micro-batch's weighted loss (``loss_of(part)``: its mean loss),
    all but the last under ``no_sync`` (DDP's: only the last all-reduces the sum); the
    step's mean loss, detached."""
    parts = micro_batches(rows, k)
    total = None
    for i, (part, weight) in enumerate(parts):
        with no_sync() if i < len(parts) - 1 else contextlib.nullcontext():
            loss = loss_of(part) * weight if weight != 1 else loss_of(part)
            backward(loss)
        total = loss.detach() if total is None else total + loss.detach()
    return total


class Clipper:
    """--clip-grad-norm: rescales the gradients to a total 2-norm of at most ``max_norm``
    and counts the steps it clipped (on the gradients' device: no wait per step)."""

    def __init__(self, max_norm: float):
        self.max_norm = max_norm
        self.steps = 0
        self._clipped: Optional[torch.Tensor] = None

    def __call__(self, params: Iterable[torch.Tensor]) -> torch.Tensor:
        """Clip in place; the total norm before clipping."""
        params = [p for p in params if p.grad is not None]
        if any(p.grad.is_sparse for p in params):
            norm = _clip_sparse([p.grad for p in params], self.max_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm)
        over = self.clipped_by(norm).to(torch.int64)
        self._clipped = over if self._clipped is None else self._clipped + over
        self.steps += 1
        return norm

    def clipped_by(self, norm: torch.Tensor) -> torch.Tensor:
        """Whether a step of total norm ``norm`` was clipped: not an overflowed fp16 one,
        whose step the scaler skips."""
        return (norm > self.max_norm) & torch.isfinite(norm)

    @property
    def clipped(self) -> int:
        return 0 if self._clipped is None else int(self._clipped)

    def to_dict(self) -> dict:
        """summary.json's ``clipping``."""
        return {"max_norm": self.max_norm, "steps": self.steps, "clipped_steps": self.clipped}


@torch.no_grad()
def _clip_sparse(grads: list, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_'s rule where some gradients are sparse (an embedding's), which
    torch's norm does not take: a sparse one's norm is its coalesced values'."""
    norms = [torch.linalg.vector_norm(g.coalesce().values() if g.is_sparse else g)
             for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def clipper(max_norm: Optional[float]) -> Optional[Clipper]:
    return Clipper(max_norm) if max_norm else None

