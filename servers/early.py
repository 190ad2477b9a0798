"""A push in parts applied as its parts arrive, invisibly, and committed or undone whole.

Each part is applied into a spare buffer (a scratch copy of the parameters, read from the
visible ones) while the next part is still on the wire; the push's last part swaps that
buffer in. The rule's state (momentum, Adam's moments, Adagrad's sums) has no such second
copy, so each part's range of it is staged before it is written and restored by ``undo``.
The parameters the shard serves are never written before the commit, so a part that fails,
a worker that vanishes, a push replaced or expired leaves them, and ``undo`` leaves the
rule's state, bit for bit as before the push (experiments/README.md, "Parts applied as
they arrive", for why a scratch buffer and not a staged copy of the parameters).
"""

from __future__ import annotations

from typing import Optional

import torch

from .store import ParamStore


class EarlyPush:
    """One worker's push, its parts applied to a scratch buffer as they arrive.

    ``stream`` is the ``PushStreams`` entry it follows; ``lr`` the rule's learning rate of
    the step and ``scale`` its staleness scale, both decided at part 0 (as the whole push
    would have been at its last, since nothing else writes the parameters meanwhile: what
    would, undoes this first). Counting the step (Adam's ``t``) happens here too, and
    ``undo`` takes it back."""

    def __init__(self, store: ParamStore, stream, lr: float, scale: float):
        self.store = store
        self.rule = store.rule
        self.stream = stream
        self.lr, self.scale = lr, scale
        self.whole = None  # the whole push, once its last part has been taken
        self.steps = self.rule.steps
        self.step_lr = self.rule.begin(scale)
        self.scratch: Optional[torch.Tensor] = store.spare()
        self.spans: list = []  # (start, end) applied into the scratch
        self.staged: list = []  # (offset, [the rule's state tensors' values there])

    def take(self, offset: int, grad: torch.Tensor) -> bool:
        """Apply one checked dense part; False (nothing written) when it overlaps one
        taken before: the whole push is then refused for it, as a whole one would be."""
        end = offset + grad.shape[0]
        if any(offset < b and a < end for a, b in self.spans):
            return False
        if self.rule.state:
            self.staged.append((offset, [t[offset:end].clone()
                                         for t in self.rule.state.values()]))
        self.rule.apply_one_into(self.scratch, self.store.params, offset, grad, self.step_lr)
        self.spans.append((offset, end))
        return True

    def commit(self) -> None:
        """Make the scratch the parameters: the elements no part covered are copied first."""
        scratch, source = self.scratch, self.store.params
        at = 0
        for start, end in sorted(self.spans):
            if start > at:
                scratch[at:start].copy_(source[at:start])
            at = end
        if at < scratch.shape[0]:
            scratch[at:].copy_(source[at:])
        self.scratch = None
        self.store.swap(scratch)

    def undo(self) -> None:
        """Leave the parameters and the rule's state as before part 0 (the latest staged
        first: a part's range is restored to what it held before that part)."""
        for offset, values in reversed(self.staged):
            for t, saved in zip(self.rule.state.values(), values):
                t[offset:offset + saved.shape[0]].copy_(saved)
        self.staged = []
        self.rule.steps = self.steps
        if self.scratch is not None:
            self.store.give_back(self.scratch)
            self.scratch = None
