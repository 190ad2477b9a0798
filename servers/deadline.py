"""Adaptive round deadlines for sync (``--backup-workers auto``), as a plain object.

A round is known by its version. It opens when the one before is applied; each push is
timed from the opening of the round it was computed in, late ones too. Those times, over
the last rounds, give the deadline and how many pushes a round can expect before it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from statistics import median, median_low
from typing import Optional

# 16 rounds: a new pace is the median's within 8 of them, and 16 x N times keep it steady.
HISTORY_ROUNDS = 16
# Hampel's rule: 3 standard deviations of a normal spread (1.4826 MAD each), so a steady
# worker's push misses it about once in 700.
K = 3 * 1.4826


def quorum(live: int) -> int:
    """The pushes a round waits for whatever the deadline: half the live workers (rounded
    up), at least 1."""
    return max(1, math.ceil(live / 2))


class RoundDeadline:
    """When a sync round may close. ``arrived(round, now)`` times a push computed in
    ``round`` (on time or late), ``closed(round, now)`` applies ``round`` and opens the
    next at ``now``; ``due(round, pushed, live, now)`` says whether the open ``round``
    closes now. Times are seconds on any one clock."""

    def __init__(self, history: int = HISTORY_ROUNDS, k: float = K):
        self.history, self.k = history, k
        # version -> (opened at, [seconds from the opening to each push's arrival]): the
        # closed rounds of the history, then the open one
        self.rounds: OrderedDict = OrderedDict()
        self._known: dict = {}  # round -> (deadline, expected), until a past round changes

    def arrived(self, round_: int, now: float) -> None:
        entry = self.rounds.get(round_)
        if entry is not None:
            entry[1].append(now - entry[0])
            if round_ != next(reversed(self.rounds)):  # a late push: the past changed
                self._known.clear()

    def closed(self, round_: int, now: float) -> None:
        self.rounds[round_ + 1] = (now, [])
        while len(self.rounds) > self.history + 1:
            self.rounds.popitem(last=False)
        self._known.clear()

    def _estimate(self, round_: int) -> tuple:
        if round_ not in self._known:
            past = [times for version, (_, times) in self.rounds.items() if version < round_]
            pooled = [t for times in past for t in times]
            if round_ not in self.rounds or not pooled:
                self._known[round_] = (None, None)
            else:
                mid = median(pooled)
                cut = mid + self.k * median(abs(t - mid) for t in pooled)
                self._known[round_] = (cut, median_low(sum(t <= cut for t in times)
                                                       for times in past))
        return self._known[round_]

    def deadline(self, round_: int) -> Optional[float]:
        """Seconds after its opening at which ``round_`` closes: median + k * MAD of the
        past rounds' arrival times; None while there is no past round, or no opening."""
        return self._estimate(round_)[0]

    def expected(self, round_: int) -> Optional[int]:
        """Pushes a round can expect before its deadline: the past rounds' count by then
        (their lower median); None without a deadline."""
        return self._estimate(round_)[1]

    def at(self, round_: int) -> Optional[float]:
        """When the open ``round_`` closes at the latest (on the clock of ``now``), or None."""
        cut = self.deadline(round_)
        return None if cut is None else self.rounds[round_][0] + cut

    def due(self, round_: int, pushed: int, live: int, now: float) -> bool:
        """Whether ``round_`` closes now that ``pushed`` of ``live`` workers pushed to it:
        every one of them, or at least the quorum and either as many as past rounds had
        by their deadline, or the deadline has passed. Without a past, it waits for all."""
        if pushed >= max(1, live):
            return True
        cut, expected = self._estimate(round_)
        if cut is None or pushed < quorum(live):
            return False
        return pushed >= expected or now >= self.rounds[round_][0] + cut  # as ``at``
