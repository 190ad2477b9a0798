"""A semaphore between processes made of a pipe: each byte in it is one unit.

``multiprocessing``'s semaphores are named POSIX semaphores that stay in /dev/shm when their
holders are SIGKILLed with the resource tracker (``kill -9 -PGID``, a Slurm step's end); the
kernel closes a pipe with its last holder.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Optional

_UNIT = b"\x01"


class PipeSemaphore:
    """Units are bytes in a pipe: a blocking one-byte read takes exactly one, and the
    kernel wakes one waiting reader per byte. It travels to a child in the arguments of
    ``Process`` (spawn and forkserver pass the descriptors along). An acquire costs two
    system calls, far more than a futex: fine for run tokens passed every 250 ms, not for
    a lock taken every step (experiments/README.md, "Locks and semaphores")."""

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
