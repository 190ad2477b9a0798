"""Parameter digests: the SHA-256 of a run's parameters after each round, a JSON line each.

``--record-digests`` writes them into the run directory, so that two runs can be compared
round by round, bit for bit (tests/test_golden.py keeps recordings of the deterministic modes).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional

import torch

DIGESTS = "digests.jsonl"


def digests_name(shard: Optional[int] = None) -> str:
    """digests.jsonl, or a parameter-server shard's digests-shard-<i>.jsonl."""
    return DIGESTS if shard is None else f"digests-shard-{shard}.jsonl"


def params_digest(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes, one after another (float32 parameters in the model's
    order: the same as of the flat vector a parameter server holds)."""
    sha = hashlib.sha256()
    for t in tensors:
        sha.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return sha.hexdigest()


class DigestLog:
    """Appends ``{key: round, "sha256": digest}`` to ``path`` whenever the round moves on.
    Lines are written whole as they come (line buffering), so a process killed mid-run
    leaves every round it recorded; a resumed run appends to the same file."""

    def __init__(self, path: Path, key: str):
        self.key = key
        self.last: Optional[int] = None
        self._file = open(path, "a", buffering=1)

    def note(self, round_: int, tensors: Iterable[torch.Tensor]) -> None:
        if round_ == self.last:
            return
        self.last = round_
        self._file.write(json.dumps({self.key: round_, "sha256": params_digest(tensors)}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_digests(path: Path) -> list:
    """The lines of a digests file, in order: [{key: round, "sha256": digest}]."""
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
