"""Which pushes of one worker incarnation a shard has applied: exactly once, in bounded memory
(PROTOCOL.md, "Exactly once"; ``SeqWindow``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Optional

FRESH, DUPLICATE, STALE_AGAIN, OUT_OF_WINDOW = "fresh", "duplicate", "stale", "out-of-window"


class SeqWindow:
    """The sequence numbers of the last ``size`` pushes concluded (applied, or acknowledged
    as stale) and a *floor*, the largest number forgotten. A push numbered ``s`` is:

    * in the window: a duplicate, or, if it was acknowledged stale, stale again (it was
      never applied: "duplicate" would tell its worker it was);
    * above the floor and not in the window: never concluded, so fresh;
    * at or below the floor and not in the window: unknown, refused ``out-of-window``
      rather than guessed (a worker's retries are of its one outstanding push per shard,
      far inside the window).

    Forgetting the smallest number first keeps the invariant this rests on: every
    concluded number above the floor is in the window."""

    def __init__(self, size: int, floor: int = -1, seqs=(), stale=()):
        self.size = size
        self.floor = floor
        self.seqs = set(seqs)
        self.stale = set(stale) & self.seqs  # the concluded pushes acknowledged stale
        self._heap = list(self.seqs)
        heapq.heapify(self._heap)

    def classify(self, seq: int) -> str:
        if seq in self.seqs:
            return STALE_AGAIN if seq in self.stale else DUPLICATE
        return FRESH if seq > self.floor else OUT_OF_WINDOW

    def add(self, seq: int, stale: bool = False) -> None:
        """Record ``seq`` as concluded (call only for a FRESH one): applied, or ``stale``."""
        self.seqs.add(seq)
        if stale:
            self.stale.add(seq)
        heapq.heappush(self._heap, seq)
        self._forget_beyond(self.size)

    def _forget_beyond(self, size: int) -> None:
        while len(self._heap) > size:
            oldest = heapq.heappop(self._heap)  # above the floor, like every number kept
            self.floor = oldest
            self.seqs.discard(oldest)
            self.stale.discard(oldest)

    def state(self) -> list:
        """``[floor, [seq, ...], [stale seq, ...]]``: ints only, for a checkpoint."""
        return [self.floor, sorted(self.seqs), sorted(self.stale)]

    @classmethod
    def from_state(cls, size: int, state) -> "SeqWindow":
        """From ``state()``; a checkpoint older than the stale list has two items."""
        floor, seqs, *stale = state
        window = cls(size, int(floor), (int(s) for s in seqs if int(s) > int(floor)),
                     (int(s) for s in (stale[0] if stale else ())))
        window._forget_beyond(size)  # saved with a larger window
        return window


class Forgotten:
    """What a shard keeps of the worker records it forgot, so that a forgotten worker's old
    pushes are still refused (PROTOCOL.md, "Exactly once"): per worker id, its newest
    incarnation and its highest concluded sequence number, for the last ``size`` ids
    forgotten; of older ones, merged into one *watermark*, the newest incarnation and the
    highest number concluded under it.

    ``bound(worker)`` is the (incarnation, floor) an unknown worker's messages are held
    to: an older incarnation is refused, the same one starts a window with that floor,
    a newer one starts fresh. Every forgotten (worker, incarnation) stays at or below it:
    an id's own entry holds its newest incarnation, and the watermark only rises."""

    def __init__(self, size: int, entries=(), watermark=None):
        self.size = size
        self.entries = OrderedDict((w, (int(i), int(f))) for w, i, f in entries)
        self.watermark = None if watermark is None else (int(watermark[0]), int(watermark[1]))
        self._keep_within(size)

    def remember(self, worker: str, incarnation: int, window: SeqWindow) -> None:
        """Worker ``worker``'s record is forgotten: keep its incarnation and the highest
        number its window concluded (or forgot)."""
        self.entries.pop(worker, None)
        self.entries[worker] = (incarnation, max(window.seqs, default=window.floor))
        self._keep_within(self.size)

    def bound(self, worker: str) -> Optional[tuple]:
        """(incarnation, floor) for ``worker``, which has no record; None: never forgotten."""
        return self.entries.get(worker, self.watermark)

    def readmit(self, worker: str) -> None:
        """``worker`` has a record again, which now holds what its entry did."""
        self.entries.pop(worker, None)

    def _keep_within(self, size: int) -> None:
        while len(self.entries) > size:  # the longest forgotten go into the watermark
            _, (incarnation, floor) = self.entries.popitem(last=False)
            if self.watermark is None or incarnation > self.watermark[0]:
                self.watermark = (incarnation, floor)
            elif incarnation == self.watermark[0]:
                self.watermark = (incarnation, max(floor, self.watermark[1]))

    def state(self) -> dict:
        """Ints and names only, for a checkpoint; oldest entry first."""
        return {"entries": [[w, i, f] for w, (i, f) in self.entries.items()],
                "watermark": None if self.watermark is None else list(self.watermark)}

    @classmethod
    def from_state(cls, size: int, state: Optional[dict]) -> "Forgotten":
        """``state``: None for a checkpoint from before forgotten workers were kept."""
        state = state or {}
        return cls(size, state.get("entries", ()), state.get("watermark"))
