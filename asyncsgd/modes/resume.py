"""Full checkpoints: the training state a resumed run needs to continue as if never stopped.

The Recorder saves the model and the counters (``run.checkpoint``); the weights
alone do not make a resumed momentum or adam run the run it continues: the
momentum buffer, adam's moments and step count, where each process was in its
data and its random generators would start over. ``StatefulRecorder`` adds them
to every checkpoint under ``state`` (checkpoint version 2), from the mode's
``state_fn``::

    state = {
        "optimizer": {...} or None,    # single/ddp: the one update rule (equal on all ranks)
        "scaler": {...} or None,       # --amp fp16's gradient scaler
        "processes": [                 # one per process (rank / Hogwild worker)
            {"epoch": E, "row": R,     # next: row R of epoch E's order (0-based)
             "rng": {...} or None,     # checkpoint.rng_state(); None: not known
             "optimizer": {...}},      # Hogwild only: each worker's own rule
        ],
    }

A checkpoint without it (version 1, model only) still resumes, with a warning
naming what starts afresh.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..errors import CheckpointError
from ..run.recorder import Recorder

log = logging.getLogger(__name__)


class StatefulRecorder(Recorder):
    """A Recorder whose checkpoints hold ``state_fn()`` too, and which keeps the resumed
    checkpoint's state (``resumed``: None for a fresh run or a model-only checkpoint)."""

    def __init__(self, *args, **kwargs):
        self.state_fn: Callable[[], Optional[dict]] = lambda: None
        self.resumed: Optional[dict] = None
        super().__init__(*args, **kwargs)

    def _restored(self, ckpt: dict) -> None:
        """Keep the checkpoint's training state, checked before the run writes anything."""
        state = ckpt.get("state")
        if state is not None and not _well_formed(state):
            raise CheckpointError(f"{self.run.checkpoint} has a malformed training state "
                                  "(not written by asyncsgd, or damaged); resume from a "
                                  "checkpoint an asyncsgd run wrote")
        self.resumed = state

    def checkpoint(self, samples: int, epochs_done: int, **extra) -> None:
        state = self.state_fn()
        if state is not None:
            extra = {"state": state, **extra}
        super().checkpoint(samples, epochs_done, **extra)

    def bad_state(self, what: str) -> CheckpointError:
        """The one error line for a saved state that does not fit this run; the resume it
        began is ended in metrics.jsonl (nothing trained, the checkpoint untouched)."""
        self.metrics.write("stop", self.t(), self.samples_offset, reason="bad_checkpoint",
                           status="failed")
        self.progress.close()
        self.metrics.close()
        return CheckpointError(f"{self.run.checkpoint} does not fit this run: {what}; resume "
                               "with the settings it was saved with (see its config.json)")


def _well_formed(state) -> bool:
    return (isinstance(state, dict) and isinstance(state.get("processes"), list)
            and all(isinstance(p, dict) and isinstance(p.get("epoch"), int)
                    and isinstance(p.get("row"), int) and p["epoch"] >= 0 and p["row"] >= 0
                    for p in state["processes"]))


def warn_model_only(path, fresh: list, epoch: int) -> None:
    """A model-only (version 1) checkpoint: say what a resumed run starts afresh, so it is
    not mistaken for an uninterrupted one."""
    what = ["the data position (epoch %d restarts from its first batch)" % (epoch + 1),
            "the random generators (seeded as at a start)"] + fresh
    log.warning("%s holds the model only (an older asyncsgd wrote it): resuming from the "
                "weights; starting afresh: %s", path, "; ".join(what))
