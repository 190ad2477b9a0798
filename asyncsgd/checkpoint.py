"""Checkpoints: written atomically, loaded without ever running pickled code.

A checkpoint is a dict of tensors and plain values saved by ``torch.save``.
It is written to a temporary file in the same directory, flushed and fsynced,
then renamed over the old one, so a crash during a save leaves the previous
checkpoint intact. The temporary file's name carries the writer's pid; the
next save removes those of writers that died mid-save. It is loaded with ``weights_only=True``, which refuses any
pickle that would construct arbitrary objects (e.g. call ``os.system``).
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
from pathlib import Path

import torch

from .errors import CheckpointError

FORMAT = "asyncsgd-checkpoint"
VERSION = 1


def _sweep_dead_writers(path: Path) -> None:
    """Remove temporary files that writers killed mid-save left beside ``path``."""
    for tmp in path.parent.glob(f"{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 1:].split(".", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:  # alive, someone else's
            pass


def save_checkpoint(path: Path, payload: dict) -> None:
    path = Path(path)
    record = {"format": FORMAT, "version": VERSION, **payload}
    _sweep_dead_writers(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.{os.getpid()}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
