"""Shard 0's batch sizing under ``--balance batch``: each worker's share of the global batch.

A plain object (no sockets): it measures every worker's samples per compute second from its
pushes and cuts the global batch in proportion (``core.balance.batch_sizes``): first in equal
shares, then once every worker has been measured, then every ``every`` rounds and whenever
the live workers change. Between re-sizings the allocation is fixed, so the
workers' slices of each global step stay disjoint.
"""

from __future__ import annotations

import math
from typing import Optional

from asyncsgd.core.balance import batch_sizes, offsets


class Balancer:
    """The allocation of one run: ``batch_of(worker)`` is ``[size, offset, global batch]``."""

    def __init__(self, per_worker: int, workers: int, every: int = 20, min_batch: int = 0):
        if per_worker < 1 or workers < 1 or every < 1 or min_batch < 0:
            raise ValueError(f"balance of {workers} x {per_worker} samples, every {every}, "
                             f"min {min_batch}")
        self.total = per_worker * workers
        self.every = every
        self.min_batch = min_batch or max(1, per_worker // 4)
        self.rounds = 0  # rounds applied
        self.resizes = 0
        self.members: list = []  # live workers at the last sizing, by name (their order)
        self.sizes: dict = {}  # worker -> its batch
        self.at: dict = {}  # worker -> its offset in the global batch
        self.speeds: dict = {}  # worker -> samples a second at the last sizing
        self.window: dict = {}  # worker -> [samples, compute seconds] since the last sizing

    def observe(self, worker: str, samples, compute) -> None:
        """A push of ``samples`` that took ``compute`` seconds (either may be missing)."""
        if type(samples) is not int or samples < 1 or type(compute) not in (int, float) \
                or not math.isfinite(compute) or compute < 0:
            return
        acc = self.window.setdefault(worker, [0, 0.0])
        acc[0] += samples
        acc[1] += float(compute)

    def forget(self, worker: str) -> None:
        """A forgotten worker's measure goes (its batch stays until the next sizing, which
        no longer counts it), so that no stream of names grows the tables."""
        self.window.pop(worker, None)

    def batch_of(self, worker: str, live: list) -> list:
        """``[size, offset, total]`` of ``worker``'s next step. The first sizing (equal
        shares) happens when first asked; a worker the allocation does not know (one that
        joined within a round) trains a minimum batch from offset 0 until the next one."""
        if not self.members:
            self._size(sorted(live))
        if worker not in self.sizes:
            return [min(self.min_batch, self.total), 0, self.total]
        return [self.sizes[worker], self.at[worker], self.total]

    def round_closed(self, live: list) -> bool:
        """A round was applied with ``live`` workers alive: re-size when the live workers
        changed, when every one of them has first been measured (the equal first cut lasts
        only until then), or every ``every`` rounds. True when it re-sized."""
        self.rounds += 1
        names = sorted(live)
        first = self.resizes == 1 and all(n in self.window for n in names)
        if not names or (names == self.members and self.rounds % self.every and not first):
            return False
        self._size(names)
        return True

    def _size(self, names: list) -> None:
        measured = {}
        for name in names:
            samples, seconds = self.window.get(name, (0, 0.0))
            if samples and seconds > 0:
                measured[name] = samples / seconds
            elif name in self.speeds:
                measured[name] = self.speeds[name]
        # a worker not measured yet counts as the mean of those that are (all equal at first)
        mean = sum(measured.values()) / len(measured) if measured else 1.0
        speeds = [measured.get(name, mean) for name in names]
        least = min(self.min_batch, self.total // len(names))
        sizes = batch_sizes(speeds, self.total, max(1, least))
        self.members = names
        self.sizes = dict(zip(names, sizes))
        self.at = dict(zip(names, offsets(sizes)))
        self.speeds = dict(zip(names, speeds))
        self.window = {}
        self.resizes += 1

    def report(self) -> dict:
        """What the stats reply and summary.json show: the bounds and the current cut."""
        return {"global_batch": self.total, "every": self.every, "min_batch": self.min_batch,
                "rounds": self.rounds, "resizes": self.resizes, "batches": dict(self.sizes),
                "speeds": {w: round(s, 3) for w, s in self.speeds.items()}}

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "resizes": self.resizes, "members": list(self.members),
                "sizes": dict(self.sizes), "speeds": dict(self.speeds),
                "window": {w: list(v) for w, v in self.window.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Continue the allocation a checkpoint holds (none: size afresh when first asked)."""
        if not state:
            return
        self.rounds, self.resizes = int(state["rounds"]), int(state["resizes"])
        self.members = list(state["members"])
        sizes = [int(state["sizes"][w]) for w in self.members]
        self.sizes = dict(zip(self.members, sizes))
        self.at = dict(zip(self.members, offsets(sizes)))
        self.speeds = {w: float(s) for w, s in state["speeds"].items()}
        self.window = {w: [int(v[0]), float(v[1])] for w, v in state["window"].items()}
