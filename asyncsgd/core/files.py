"""Files written whole or not at all: checkpoints, run files, cached data sets.

``atomic_write`` writes a temporary file beside the target, fsyncs it and renames it over the
target, so a crash or a kill mid-write leaves the previous file intact.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable


def _sweep_dead_writers(path: Path) -> None:
    """Remove temporary files that writers killed mid-write left beside ``path``."""
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


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(fh)`` on a temporary file and make it ``path`` once complete and synced.

    The fsync before the rename means a power cut cannot leave the new name pointing at
    unwritten blocks; the temporary file's name carries the writer's pid, so the next
    write removes those of writers that died mid-write."""
    path = Path(path)
    _sweep_dead_writers(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.{os.getpid()}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
