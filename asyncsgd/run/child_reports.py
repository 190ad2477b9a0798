"""What child processes tell their parent (a traceback, an error a user can fix), one pipe per
child.

Pipes, not a ``multiprocessing`` queue: a queue's locks are named POSIX semaphores that a
SIGKILL of the process group leaves behind in /dev/shm, while the kernel closes a pipe with
its last holder; one pipe per child needs no lock, so a child killed mid-report holds up
no other.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection
from typing import Any, Optional


def tail(text: str, limit: int) -> str:
    """``text``, or its last ``limit`` bytes (UTF-8) after a "...": the end of a traceback
    says what failed."""
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return "...\n" + data[-limit:].decode("utf-8", "ignore")


def send_report(writer: Connection, payload: Any) -> bool:
    """From a child: ``payload`` (small: a pipe holds 64 KiB, 4 KiB for a user past the
    kernel's pipe-user-pages-soft; the parent drains it as it polls) to its parent;
    False when the parent is gone or no longer reads."""
    try:
        writer.send((time.monotonic(), payload))
    except OSError:  # the parent closed its end or died: there is no one to tell
        return False
    return True


class ChildReports:
    """The parent's ends of one report pipe per child rank.

    Each report carries the time it was sent (``time.monotonic``, one clock for every
    process on Linux), so the parent can tell which child failed first."""

    def __init__(self, ranks: int):
        self._readers: list = [None] * ranks
        self._writers: list = [None] * ranks  # the parent's copy, until the child has it
        self._received: dict = {}  # rank -> (time sent, payload): the first report only

    def writer(self, rank: int) -> Connection:
        """A fresh pipe for ``rank`` (a new child, or one started again): the end to pass to
        that child. What its previous pipe held and was not read is dropped."""
        self._close(rank)
        self._readers[rank], self._writers[rank] = multiprocessing.Pipe(duplex=False)
        return self._writers[rank]

    def handed_over(self, rank: Optional[int] = None) -> None:
        """The child ``rank`` (every child: None) has started with its end: the parent
        closes its copy, so the pipe ends when the child does."""
        for r in range(len(self._writers)) if rank is None else (rank,):
            if self._writers[r] is not None:
                self._writers[r].close()
                self._writers[r] = None

    def drain(self) -> None:
        """Read every report waiting, without blocking."""
        for rank, reader in enumerate(self._readers):
            try:
                while reader is not None and reader.poll():
                    self._received.setdefault(rank, reader.recv())
            except (EOFError, OSError):  # the child is gone (cut short mid-report, at worst)
                reader.close()
                self._readers[rank] = None

    def first(self, ranks) -> Optional[int]:
        """Of ``ranks``, the one whose report was sent first; None when none reported."""
        sent = [(self._received[r][0], r) for r in ranks if r in self._received]
        return min(sent)[1] if sent else None

    def get(self, rank: int) -> Any:
        """``rank``'s report (its payload), or None."""
        report = self._received.get(rank)
        return None if report is None else report[1]

    def pop(self, rank: int) -> Any:
        report = self._received.pop(rank, None)
        return None if report is None else report[1]

    def _close(self, rank: int) -> None:
        for ends in (self._readers, self._writers):
            if ends[rank] is not None:
                ends[rank].close()
                ends[rank] = None

    def close(self) -> None:
        for rank in range(len(self._readers)):
            self._close(rank)
