"""Checkpoints: written atomically, loaded without ever running pickled code.

A checkpoint is a dict of tensors and plain values saved by ``torch.save``.
It is written atomically (``core.files.atomic_write``: a temporary file,
fsynced, renamed over the old one), so a crash during a save leaves the
previous checkpoint intact. It is loaded with ``weights_only=True``, which
refuses any pickle that would construct arbitrary objects (e.g. call
``os.system``).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from ..core.files import atomic_write
from ..errors import CheckpointError

FORMAT = "asyncsgd-checkpoint"
VERSION = 1


def save_checkpoint(path: Path, payload: dict) -> None:
    record = {"format": FORMAT, "version": VERSION, **payload}
    atomic_write(Path(path), lambda fh: torch.save(record, fh))


def load_checkpoint(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; was the run stopped before its "
                              "first checkpoint? (see --checkpoint-every)")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch words both cases alike; a GLOBAL it refuses means code would have run.
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if found:
            raise CheckpointError(f"{path} was refused: loading it would call {found.group(1)}, "
                                  "which a safe load never does; it is not a checkpoint "
                                  "asyncsgd wrote") from exc
        raise CheckpointError(f"{path} is not a readable checkpoint (corrupt or not written by "
                              "torch.save)") from exc
    except Exception as exc:
        raise CheckpointError(f"{path} is not a readable checkpoint: "
                              f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an asyncsgd checkpoint")
    if record.get("version") != VERSION:
        raise CheckpointError(f"{path} has checkpoint version {record.get('version')}, "
                              f"this asyncsgd reads version {VERSION}")
    return record
