"""A collision-free map from int64 ids to row slots, held as two sorted tensors, so that a
lookup or an insertion of a batch of ids is vectorized and its memory is 16 bytes an id.
"""

from __future__ import annotations

import torch


class IdMap:
    """``keys`` (sorted, unique int64 ids) and ``slots`` (the slot of each key)."""

    def __init__(self, keys: torch.Tensor = None, slots: torch.Tensor = None):
        self.keys = torch.empty(0, dtype=torch.int64) if keys is None else keys
        self.slots = torch.empty(0, dtype=torch.int64) if slots is None else slots

    def __len__(self) -> int:
        return self.keys.numel()

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where the id has none."""
        pos = torch.searchsorted(self.keys, ids).clamp_(max=max(len(self) - 1, 0))
        if not len(self):
            return torch.full_like(ids, -1)
        hit = self.keys[pos] == ids
        return torch.where(hit, self.slots[pos], torch.full_like(ids, -1))

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (unique, none present yet) at ``slots``: a merge of two sorted runs."""
        order = torch.argsort(ids)
        ids, slots = ids[order], slots[order]
        n, m = len(self), ids.numel()
        # each element's place in the merged run: its own index plus the other run's before it
        place = torch.searchsorted(self.keys, ids)
        at_new = place + torch.arange(m)
        # new ids before old key i: those placed at or before i (linear, not n binary searches)
        at_old = torch.arange(n) + torch.bincount(place, minlength=n + 1)[:n].cumsum(0)
        keys = torch.empty(n + m, dtype=torch.int64)
        out = torch.empty(n + m, dtype=torch.int64)
        keys[at_old], keys[at_new] = self.keys, ids
        out[at_old], out[at_new] = self.slots, slots
        self.keys, self.slots = keys, out

    def remove(self, ids: torch.Tensor) -> None:
        """Drop ``ids`` (each present)."""
        keep = torch.ones(len(self), dtype=torch.bool)
        keep[torch.searchsorted(self.keys, ids)] = False
        self.keys, self.slots = self.keys[keep], self.slots[keep]

    def nbytes(self) -> int:
        return (self.keys.numel() + self.slots.numel()) * 8
