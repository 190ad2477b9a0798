"""Which pushes of one worker incarnation a shard has applied: exactly once, in bounded memory
(PROTOCOL.md, "Exactly once"; ``SeqWindow``).
"""

from __future__ import annotations

import heapq

FRESH, DUPLICATE, OUT_OF_WINDOW = "fresh", "duplicate", "out-of-window"


class SeqWindow:
    """The sequence numbers of the last ``size`` pushes concluded (applied, or acknowledged
    as stale) and a *floor*, the largest number forgotten. A push numbered ``s`` is:

    * in the window: a duplicate;
    * above the floor and not in the window: never concluded, so fresh;
    * at or below the floor and not in the window: unknown, refused ``out-of-window``
      rather than guessed (a worker's retries are of its one outstanding push per shard,
      far inside the window).

    Forgetting the smallest number first keeps the invariant this rests on: every
    concluded number above the floor is in the window."""

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
