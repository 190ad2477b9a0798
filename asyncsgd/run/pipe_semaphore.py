"""A semaphore between processes made of a pipe: each byte in it is one unit.

``multiprocessing``'s Semaphore and Lock are named POSIX semaphores
(``/dev/shm/sem.mp-*``): when the processes that hold one are SIGKILLed
together with multiprocessing's resource tracker (a SIGKILL of the whole
process group: ``kill -9 -PGID``, the end of a Slurm job step), nothing
removes the name; a Hogwild run killed so left one per worker behind. A pipe
is two file descriptors the kernel closes with their last holder. It travels
to a child in the arguments of ``Process`` (spawn and forkserver pass the
descriptors along).

A one-byte read takes exactly one byte, whichever of several readers gets it,
so with one unit it is a lock. The read end is non-blocking (a flag every
process holding it shares): a reader woken for a unit that another took first
waits on instead of blocking past its timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from typing import Optional

_UNIT = b"\x01"


class PipeSemaphore:
    def __init__(self, value: int = 0):
        self._reader, self._writer = multiprocessing.Pipe(duplex=False)
        os.set_blocking(self._reader.fileno(), False)
        for _ in range(value):
            self.release()

    def release(self) -> None:
        os.write(self._writer.fileno(), _UNIT)

    def acquire(self, timeout: Optional[float] = None) -> bool:
        """Take a unit, waiting up to ``timeout`` s (None: as long as it takes); False when
        none came in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if os.read(self._reader.fileno(), 1):
                    return True
                raise EOFError("the semaphore's pipe has no writer left")  # we hold one
            except BlockingIOError:  # none there, or another reader took it first
                pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._reader.poll(left)

    def __enter__(self) -> "PipeSemaphore":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
