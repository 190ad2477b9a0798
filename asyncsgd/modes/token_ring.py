"""Run tokens: more training processes than cores without scheduler thrash.

Several CPU-bound processes per core make the kernel switch among them every few milliseconds,
each switch with cold caches, and throughput falls; the ring lets one process per core run at
a time, while all still update the shared parameters lock-free. Figures: experiments/README.md,
"Hogwild throughput".
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

WAIT_SLICE = 0.05


class TokenRing:
    """One process's side of the ring; built in the worker from shared objects.

    ``cores`` tokens circulate in a fixed ring: a process trains only while it holds one
    and passes it on after a quantum, so at most one process runs per core, and each token
    visits every process in turn. A process holds only its own semaphore and its
    successor's (a worker handed every process's would stop forkserver at ~120
    processes, which passes a child at most 252 descriptors). A process done with its
    epochs forwards every token it gets until all are done; every wait is bounded and
    watches the stop flag."""

    def __init__(self, rank: int, own: Any, successor: Any, done: np.ndarray, stop: np.ndarray,
                 quantum: float):
        """``own``, ``successor``: the semaphores (``release``, ``acquire(timeout)``) of this
        process and of the next in the ring; ``done``, ``stop``: shared flags."""
        self.rank, self.own, self.successor = rank, own, successor
        self.done, self.stop, self.quantum = done, stop, quantum
        self._since = 0.0

    @staticmethod
    def first_holders(procs: int, tokens: int) -> list:
        """Ranks that start with a token, spread evenly around the ring."""
        return sorted({i * procs // tokens for i in range(min(tokens, procs))})

    def _pass(self) -> None:
        """Hand the token to the next process (one that is done forwards it)."""
        self.successor.release()

    def acquire(self) -> bool:
        """Wait for a token; False if the run is stopping."""
        while not self.stop[0]:
            if self.own.acquire(timeout=WAIT_SLICE):
                self._since = time.monotonic()
                return True
        return False

    def tick(self) -> bool:
        """Call after every step: passes the token on once the quantum is used up."""
        if time.monotonic() - self._since < self.quantum:
            return True
        self._pass()
        return self.acquire()

    def leave(self, holding: bool) -> None:
        """Mark this process done and keep forwarding tokens until all are done."""
        self.done[self.rank] = 1
        if holding:
            self._pass()
        while not self.stop[0] and not self.done.all():
            if self.own.acquire(timeout=WAIT_SLICE):
                self._pass()
