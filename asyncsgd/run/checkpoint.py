"""Checkpoints: written atomically, loaded without ever running pickled code
(``weights_only=True``), so a crash mid-save or a hostile file cannot hurt a run.

Version 2 (``VERSION``) adds ``state``, what a resumed run needs besides the weights
(``modes.resume``); version 1 (``OLDEST``) held the model only and still loads.
"""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path
from typing import Optional

import numpy
import torch

from ..core.files import atomic_write
from ..errors import CheckpointError

FORMAT = "asyncsgd-checkpoint"
VERSION = 2
OLDEST = 1  # model, samples, t, epochs_done: no training state


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
    if record.get("version") not in range(OLDEST, VERSION + 1):
        raise CheckpointError(f"{path} has checkpoint version {record.get('version')}, "
                              f"this asyncsgd reads versions {OLDEST} to {VERSION}; resume "
                              "it with the asyncsgd that wrote it")
    return record


def rng_state(device: Optional[torch.device] = None) -> dict:
    """This process's random generators: torch's (and the GPU's on a CUDA device), numpy's
    and Python's, in types a safe load reads back (tensors, ints, tuples)."""
    kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(numpy.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "gauss": float(gauss)},
             "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: Optional[torch.device] = None) -> None:
    """Restore what ``rng_state`` saved; a generator it did not save is left as it is."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np_state = state["numpy"]
        numpy.random.set_state(("MT19937", np_state["keys"].numpy().astype(numpy.uint32),
                                np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
