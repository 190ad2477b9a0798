"""The virtual clock's scheduler: events in time order, ties in the order they were set."""

from __future__ import annotations

import heapq
import itertools


class Scheduler:
    """A queue of (time, what): ``at`` sets an event, ``pop`` takes the earliest. Two events
    at one time come out in the order they were set, so a run is a function of its seed."""

    def __init__(self) -> None:
        self._heap: list = []
        self._order = itertools.count()
        self.now = 0.0

    def at(self, t: float, *what) -> None:
        if t < self.now:
            raise ValueError(f"an event at {t} is in the past (now {self.now})")
        heapq.heappush(self._heap, (t, next(self._order), what))

    def pop(self) -> tuple:
        """(time, *what) of the earliest event; the clock moves to its time."""
        t, _, what = heapq.heappop(self._heap)
        self.now = t
        return (t, *what)

    def next_time(self) -> float:
        """The time of the earliest event (the queue is not empty)."""
        return self._heap[0][0]

    def __len__(self) -> int:
        return len(self._heap)
