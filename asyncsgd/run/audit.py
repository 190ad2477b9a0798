"""The exactly-once audit's writer (``--audit-dir``): one JSON-lines file per process life, a
line per push a shard applies, or a worker sends and hears acknowledged.

Lines go out as they are written (line-buffered), so a SIGKILL loses at most the one being
written; ``asyncsgd.analysis.audit`` reads the directory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

from ..wire.protocol import Key

SHARD_FILE, SHARD_FILES = "shard-{index}-{pid}.jsonl", "shard-*.jsonl"
WORKER_FILE, WORKER_FILES = "worker-{worker}-{incarnation}.jsonl", "worker-*.jsonl"


class AuditLog:
    """One process life's audit file, appended a line at a time."""

    def __init__(self, path: Path, first: dict):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._line({"start": time.time(), **first})

    def _line(self, entry: dict) -> None:
        self._file.write(json.dumps(entry, separators=(",", ":")) + "\n")

    def applied(self, worker: str, incarnation: int, seq: int, version: int) -> None:
        """A shard applied push ``seq`` of ``worker``/``incarnation``; ``version``: the
        shard's version after the update (a sync round's pushes share one)."""
        self._line({"w": worker, "i": incarnation, "s": seq, "v": version})

    def sent(self, seqs: list, shards: list, compute: float) -> None:
        """A worker is about to send one push: ``seqs[k]`` to shard ``shards[k]``, its
        gradient ``compute`` seconds of work."""
        self._line({"s": seqs, "sh": shards, "compute": round(compute, 6)})

    def acked(self, seq: int, shard: int, ack: dict) -> None:
        """A worker got shard ``shard``'s acknowledgement of push ``seq`` (its ACK's fields)."""
        self._line({"s": seq, "sh": shard, "applied": ack.get(Key.APPLIED) is True,
                    "duplicate": ack.get(Key.DUPLICATE) is True,
                    "stale": ack.get(Key.STALE) is True})

    def close(self) -> None:
        self._file.close()


def shard_audit(directory: Optional[str], index: int, restored: Optional[int],
                lost: int) -> Optional[AuditLog]:
    """Shard ``index``'s audit for this process life (None without a directory):
    ``restored`` is the checkpoint version it continues from (None: it started afresh),
    ``lost`` the updates lost that its checkpoint counted."""
    if not directory:
        return None
    path = Path(directory) / SHARD_FILE.format(index=index, pid=os.getpid())
    return AuditLog(path, {"shard": index, "restored": restored, "lost": lost})


def worker_audit(directory: Optional[str], worker: str,
                 incarnation: int) -> Optional[AuditLog]:
    """Worker ``worker``'s audit for incarnation ``incarnation`` (None without a directory)."""
    if not directory:
        return None
    name = WORKER_FILE.format(worker=worker.replace(os.sep, "_"), incarnation=incarnation)
    return AuditLog(Path(directory) / name, {"w": worker, "i": incarnation})
