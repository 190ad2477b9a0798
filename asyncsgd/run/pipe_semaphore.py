"""A semaphore between processes made of a pipe: each byte in it is one unit.

``multiprocessing``'s Semaphore and Lock are named POSIX semaphores
(``/dev/shm/sem.mp-*``): when the processes that hold one are SIGKILLed
together with multiprocessing's resource tracker (a SIGKILL of the whole
process group: ``kill -9 -PGID``, the end of a Slurm job step), nothing
removes the name; a Hogwild run killed so left one per worker behind (its
run tokens). A pipe is two file descriptors the kernel closes with their last
holder. It travels to a child in the arguments of ``Process`` (spawn and
forkserver pass the descriptors along).

A blocking one-byte read takes exactly one byte, and the kernel wakes one
waiting reader per byte. ``acquire`` with a timeout polls first: it is for a
semaphore that only one process takes from (a run-token ring's), where no
other reader can take the byte that ended the wait. An uncontended acquire +
release costs ~0.8-1.3 us here (two system calls) against 0.07 us for
multiprocessing's Lock (a futex): fine for run tokens, passed every 250 ms;
a lock taken every step pays it each time (Hogwild's ``--lock --procs 4`` ran
at 0.97x the samples/s with it in an interleaved A/B), so ``--lock`` keeps
multiprocessing's.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Optional

_UNIT = b"\x01"


class PipeSemaphore:
    def __init__(self, value: int = 0):
        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        for _ in range(value):
            self.release()

    def release(self) -> None:
        os.write(self._writer.fileno(), _UNIT)

    def acquire(self, timeout: Optional[float] = None) -> bool:
        """Take a unit, waiting up to ``timeout`` s (None: as long as it takes; a timeout
        only where this process alone takes from the semaphore); False when none came."""
        if timeout is not None and not self._reader.poll(timeout):
            return False
        if not os.read(self._reader.fileno(), 1):  # this object holds a writer: never
            raise EOFError("the semaphore's pipe has no writer left")
        return True
