"""The exactly-once audit's reader: what a ``--audit-dir`` holds, checked against itself.

Each shard life's applications that a later life's restore cut are lost to the checkpoint;
the rest survive, and none may be doubled. Every push a shard acknowledged must survive or
be cut; goodput is the share of the workers' compute whose pushes survive on every shard.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..run.audit import SHARD_FILES, WORKER_FILES


@dataclass
class ShardAudit:
    index: int
    lives: int = 0  # process lives (files) of this shard
    applied: int = 0  # surviving applications
    doubled: int = 0  # (w, i, s) applied more than once among the survivors, beyond the first
    lost_to_checkpoint: int = 0  # applications a restore cut
    # ... of which applied again later: the acknowledgement died with the shard, so the
    # worker re-sent the push (the shard's lost_updates counts only the others)
    lost_resent: int = 0
    lost: int = 0  # acknowledged as applied, neither surviving nor cut
    acknowledged: int = 0  # pushes workers heard acknowledged as applied (or as duplicates)


@dataclass
class Audit:
    shards: dict = field(default_factory=dict)  # index -> ShardAudit
    compute_seconds: float = 0.0  # all the workers logged
    goodput: Optional[float] = None  # share of compute_seconds that survives; None: none logged
    violations: list = field(default_factory=list)  # (kind, shard, worker, incarnation, seq)

    def total(self, figure: str) -> int:
        return sum(getattr(s, figure) for s in self.shards.values())

    @property
    def applied(self) -> int:
        return self.total("applied")

    @property
    def doubled(self) -> int:
        return self.total("doubled")

    @property
    def lost_to_checkpoint(self) -> int:
        return self.total("lost_to_checkpoint")

    @property
    def lost_resent(self) -> int:
        return self.total("lost_resent")

    @property
    def lost(self) -> int:
        return self.total("lost")


def _lines(path: Path) -> list:
    """The file's JSON lines; a last line cut short by a kill is left out."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if line.endswith("\n"):
                    raise
    return out


def _files(directory: Path, pattern: str) -> list:
    """(first line, the rest) of each file of ``pattern``, in the order their lives began."""
    lives = [(lines[0], lines[1:]) for lines in map(_lines, sorted(directory.glob(pattern)))
             if lines]
    return sorted(lives, key=lambda life: life[0]["start"])


def _shard(index: int, lives: list) -> tuple:
    """(ShardAudit, {(w, i, s): survivors}, {(w, i, s) cut}) of one shard's lives."""
    audit = ShardAudit(index, lives=len(lives))
    survivors, cut, keys = [], [], set()
    for n, (first, entries) in enumerate(lives):
        if n:  # restored at version V (0: afresh): what earlier lives applied past V is gone
            restored = first.get("restored") or 0
            cut += [e for e in survivors if e["v"] > restored]
            survivors = [e for e in survivors if e["v"] <= restored]
        survivors += entries
        keys.update((e["w"], e["i"], e["s"]) for e in entries)
    counts = Counter((e["w"], e["i"], e["s"]) for e in survivors)
    audit.applied = len(survivors)
    audit.doubled = sum(c - 1 for c in counts.values())
    audit.lost_to_checkpoint = len(cut)
    # every application of a push but its last was cut and re-sent, unless doubled
    audit.lost_resent = len(survivors) + len(cut) - len(keys) - audit.doubled
    return audit, counts, {(e["w"], e["i"], e["s"]) for e in cut}


def read_audit(directory) -> Audit:
    """The audit of every ``shard-*`` and ``worker-*`` file in ``directory``."""
    directory = Path(directory)
    by_index: dict = {}
    for first, entries in _files(directory, SHARD_FILES):
        by_index.setdefault(first["shard"], []).append((first, entries))
    audit = Audit()
    survived, cut = {}, {}
    for index in sorted(by_index):
        audit.shards[index], survived[index], cut[index] = _shard(index, by_index[index])
        audit.violations += [("doubled", index, *key) for key, c in survived[index].items()
                             if c > 1]
    good = 0.0
    for first, entries in _files(directory, WORKER_FILES):
        w, i = first["w"], first["i"]
        for e in entries:
            if "compute" in e:  # a push, as sent
                audit.compute_seconds += e["compute"]
                if all((w, i, s) in survived.get(sh, ()) for s, sh in zip(e["s"], e["sh"])):
                    good += e["compute"]
            elif e["applied"] or e["duplicate"]:  # the shard said it applied it
                shard = audit.shards.setdefault(e["sh"], ShardAudit(e["sh"]))
                shard.acknowledged += 1
                key = (w, i, e["s"])
                if key not in survived.get(e["sh"], ()) and key not in cut.get(e["sh"], ()):
                    shard.lost += 1
                    audit.violations.append(("lost", e["sh"], *key))
    if audit.compute_seconds > 0:
        audit.goodput = good / audit.compute_seconds
    return audit
