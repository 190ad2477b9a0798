"""Which pushes of one worker incarnation a shard has applied: exactly once, bounded.

The rule (PROTOCOL.md, "Exactly once"): a shard keeps the sequence numbers of
the last ``size`` pushes it concluded (applied, or acknowledged as stale) and a
*floor*, the largest number it has forgotten. Then, for a push numbered ``s``:

* ``s`` in the window: a duplicate (answered ``applied: false, duplicate``);
* ``s`` above the floor and not in the window: never concluded, so fresh;
* ``s`` at or below the floor and not in the window: the shard cannot tell, so it
  refuses it with ``out-of-window`` instead of guessing (a worker's retries are
  of its one outstanding push per shard, far inside the window).

Forgetting the smallest number first keeps the invariant this rests on: every
concluded number above the floor is in the window. A fresh push numbered far
below the highest one is applied (the old rule, "more than ``size`` below the
highest is a duplicate", dropped such pushes while acknowledging them).
"""

from __future__ import annotations

import heapq

FRESH, DUPLICATE, OUT_OF_WINDOW = "fresh", "duplicate", "out-of-window"


class SeqWindow:
    def __init__(self, size: int, floor: int = -1, seqs=()):
        self.size = size
        self.floor = floor
        self.seqs = set(seqs)
        self._heap = list(self.seqs)
        heapq.heapify(self._heap)

    def classify(self, seq: int) -> str:
        if seq in self.seqs:
            return DUPLICATE
        return FRESH if seq > self.floor else OUT_OF_WINDOW

    def add(self, seq: int) -> None:
        """Record ``seq`` as concluded (call only for a FRESH one)."""
        self.seqs.add(seq)
        heapq.heappush(self._heap, seq)
        self._forget_beyond(self.size)

    def _forget_beyond(self, size: int) -> None:
        while len(self._heap) > size:
            oldest = heapq.heappop(self._heap)  # above the floor, like every number kept
            self.floor = oldest
            self.seqs.discard(oldest)

    def state(self) -> list:
        """``[floor, [seq, ...]]``: ints only, for a checkpoint."""
        return [self.floor, sorted(self.seqs)]

    @classmethod
    def from_state(cls, size: int, state) -> "SeqWindow":
        floor, seqs = state
        window = cls(size, int(floor), (int(s) for s in seqs if int(s) > int(floor)))
        window._forget_beyond(size)  # saved with a larger window
        return window
