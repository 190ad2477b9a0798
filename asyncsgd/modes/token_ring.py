"""Run tokens: more training processes than cores without scheduler thrash.

Eight CPU-bound Python processes on two cores make the kernel switch among
four per core every few milliseconds; each switch starts a process with cold
caches and TLB, and aggregate throughput falls (here ~20% below two
processes). A ``TokenRing`` keeps ``cores`` run tokens circulating among the
processes in a fixed ring: a process trains only while it holds a token and
passes it to the next process after a quantum (250 ms), so at most one process
runs per core and switches are rare. Every process still updates the shared
parameters lock-free; only *when* it computes changes. The ring is fair by
construction: each token visits every process in turn.

A process that finishes its epochs leaves the ring: the ring then skips it,
and until every process is done it forwards any token that still reaches it.
Every wait is bounded and watches the stop flag, so a stop never hangs.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

WAIT_SLICE = 0.05


class TokenRing:
    """One process's side of the ring; built in the worker from shared objects."""

    def __init__(self, rank: int, semaphores: Sequence[Any], done: np.ndarray, stop: np.ndarray,
                 quantum: float):
        self.rank, self.sems, self.done, self.stop = rank, semaphores, done, stop
        self.quantum = quantum
        self.procs = len(semaphores)
        self._since = 0.0

    @staticmethod
    def first_holders(procs: int, tokens: int) -> list:
        """Ranks that start with a token, spread evenly around the ring."""
        return sorted({i * procs // tokens for i in range(min(tokens, procs))})

    def _pass(self) -> None:
        """Hand the token to the next process still training (ourselves if we are the last)."""
        for step in range(1, self.procs + 1):
            nxt = (self.rank + step) % self.procs
            if not self.done[nxt]:
                self.sems[nxt].release()
                return

    def acquire(self) -> bool:
        """Wait for a token; False if the run is stopping."""
        while not self.stop[0]:
            if self.sems[self.rank].acquire(timeout=WAIT_SLICE):
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
            if self.sems[self.rank].acquire(timeout=WAIT_SLICE):
                self._pass()
