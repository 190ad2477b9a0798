"""Full checkpoints: the training state a resumed run needs to continue as if never stopped.

``StatefulRecorder`` saves and reads it for every mode; ``SyncState`` is a single/ddp run's:
what each rank restores from a checkpoint and what rank 0 saves into the next.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..config import SingleConfig
from ..errors import CheckpointError
from ..run.checkpoint import rng_state, set_rng_state
from ..run.recorder import Recorder
from .optim import Adam

log = logging.getLogger(__name__)

RANK_RNGS = ("torch", "cuda")  # the generators each DDP rank has its own of
Agree = Callable[[torch.Tensor], torch.Tensor]


class StatefulRecorder(Recorder):
    """A Recorder whose checkpoints hold ``state_fn()`` too (checkpoint version 2), and which
    keeps the resumed checkpoint's state (``resumed``: None for a fresh run or a model-only
    checkpoint, which still resumes, with a warning naming what starts afresh). The state::

        {"optimizer": {...} or None,    # single/ddp: the one update rule (equal on all ranks)
         "scaler": {...} or None,       # --amp fp16's gradient scaler
         "processes": [                 # one per process (rank / Hogwild worker)
             {"epoch": E, "row": R,     # next: row R of epoch E's order (0-based)
              "rng": {...} or None,     # checkpoint.rng_state(); None: not known
              "optimizer": {...}}]}     # Hogwild only: each worker's own rule
    """

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


def resumed_start(recorder: StatefulRecorder, rows: int, world: int) -> list:
    """Rank 0: [epoch, row, 1] from a full checkpoint of as many ranks; [epochs done, 0, 0]
    from a model-only one (or one of another world size, with a warning)."""
    state = recorder.resumed
    if state is None:
        return [recorder.epochs_done, 0, 0]
    procs = state["processes"]
    if len(procs) != world:
        log.warning("%s was saved by %d process(es), this run has %d: their data partitions "
                    "differ, so epoch %d restarts from its first row and the random generators "
                    "are seeded afresh", recorder.run.checkpoint, len(procs), world,
                    recorder.epochs_done + 1)
        for proc in procs:
            proc["rng"] = None
        return [recorder.epochs_done, 0, 1]
    epoch, row = procs[0]["epoch"], procs[0]["row"]
    if row > rows:
        raise recorder.bad_state(f"it resumes at row {row} of an epoch of {rows} rows")
    return [epoch, row, 1]


def fresh_state(cfg: SingleConfig) -> list:
    """What a model-only checkpoint leaves out of this run's update rule."""
    fresh = []
    if cfg.optimizer == "adam":
        fresh.append("adam's moments and step count (its bias correction starts over)")
    elif cfg.momentum:
        fresh.append("the momentum buffer")
    if cfg.simulate_staleness:
        fresh.append(f"the --simulate-staleness queue: the {cfg.simulate_staleness} gradients "
                     "in flight at the checkpoint are never applied, and the first "
                     f"{cfg.simulate_staleness} steps after resuming apply nothing, as at a start")
    return fresh


class SyncState:
    """One single/ddp rank's part of a full checkpoint: its update rule and gradient scaler
    (equal on every rank: they apply the same averaged gradients), its place in its data
    (equal on every rank: they step together) and its random generators. ``agree`` sums a
    tensor over the ranks (an all-reduce; nothing for one process)."""

    def __init__(self, opt, scaler, device: torch.device, *, rank: int, world: int,
                 agree: Agree, start: tuple):
        self.opt, self.scaler, self.device = opt, scaler, device
        self.rank, self.world, self.agree = rank, world, agree
        self.position = start  # (epoch, rows of its order done): where the next step starts
        self.rngs: Optional[list] = None  # rank 0: every rank's generators at the last gather
        self.resumed_rng: Optional[dict] = None  # this rank's, to set before its first step

    def gather_rngs(self) -> None:
        """All ranks: every rank's random generators, onto rank 0 (an all-reduce of each
        rank's torch state in its own slot; numpy's and Python's of rank 0 only)."""
        mine = rng_state(self.device)
        if self.world == 1:
            self.rngs = [mine]
            return
        flat = torch.cat([mine["torch"]] + ([mine["cuda"]] if "cuda" in mine else []))
        n = flat.numel()
        vector = torch.zeros(self.world * n, dtype=torch.float64)
        vector[self.rank * n:(self.rank + 1) * n] = flat.double()
        summed = self.agree(vector.to(self.device)).cpu().to(torch.uint8)
        cut = mine["torch"].numel()
        rngs = []
        for r in range(self.world):
            row = summed[r * n:(r + 1) * n]
            rngs.append(mine if r == self.rank else
                        {"torch": row[:cut].clone(), **({"cuda": row[cut:].clone()}
                                                        if "cuda" in mine else {})})
        self.rngs = rngs

    def to_dict(self) -> dict:
        """Rank 0: the training state for a full checkpoint (``StatefulRecorder``'s shape)."""
        rngs = self.rngs or [rng_state(self.device)] + [None] * (self.world - 1)
        epoch, row = self.position
        return {"optimizer": self.opt.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "processes": [{"epoch": epoch, "row": row, "rng": rng} for rng in rngs]}

    def restore(self, state: Optional[dict], recorder: Optional[StatefulRecorder]) -> None:
        """All ranks: the update rule, gradient scaler and random generators of a full
        checkpoint. Rank 0 (given the recorder that read ``state``) loads them, then sends
        them to the others through ``agree`` (a sum in which the others put zeros): exact,
        and no other collective."""
        if recorder is not None:
            try:
                self._load(state)
            except (ValueError, TypeError, KeyError, RuntimeError, AttributeError) as exc:
                raise recorder.bad_state(str(exc).splitlines()[0]) from None
        if self.world > 1:
            self._share(state)

    def set_resumed_rng(self) -> None:
        """Before the first step (after the evaluation at the start, as it was saved)."""
        if self.resumed_rng is not None:
            set_rng_state(self.resumed_rng, self.device)

    def _load(self, state: dict) -> None:
        saved, current = state.get("optimizer"), self.opt.state_dict()
        if saved is not None:
            if (saved.get("kind"), saved.get("staleness")) != (current["kind"],
                                                               current.get("staleness")):
                log.warning("the checkpoint's update rule (%s) is not this run's (%s): it "
                            "starts afresh", _rule(saved), _rule(current))
            else:
                self.opt.load_state_dict(saved)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        rng = state["processes"][0].get("rng")
        if rng is not None:
            size = torch.get_rng_state().numel()
            for proc in state["processes"]:
                if proc.get("rng") is not None and proc["rng"]["torch"].numel() != size:
                    raise ValueError(f"a saved torch generator state has "
                                     f"{proc['rng']['torch'].numel()} bytes, this torch's {size}")
            self.resumed_rng = rng

    def _share(self, state: Optional[dict]) -> None:
        """DDP: rank 0's (just loaded) update rule, scaler and each rank's generator to the
        ranks they belong to."""
        opt, rank, device, agree = self.opt, self.rank, self.device, self.agree
        params, scaler = opt.params, self.scaler
        head = torch.zeros(3 + len(params), dtype=torch.float64)
        if rank == 0:
            head[0] = getattr(opt, "steps", 0)
            if scaler is not None:
                head[1], head[2] = scaler.get_scale(), scaler.state_dict()["_growth_tracker"]
            for i in opt.buffers:
                head[3 + i] = 1
        head = agree(head.to(device)).cpu().tolist()
        if isinstance(opt, Adam):
            opt.steps = int(head[0])
        if scaler is not None and head[1]:
            scaler.load_state_dict({**scaler.state_dict(), "scale": head[1],
                                    "_growth_tracker": int(head[2])})
        for i, p in enumerate(params):
            if not head[3 + i]:
                continue
            mine = opt.buffers[i] if rank == 0 else None
            parts = (mine if isinstance(mine, tuple) else (mine,)) if rank == 0 else tuple(
                torch.zeros_like(p) for _ in range(2 if isinstance(opt, Adam) else 1))
            parts = tuple(agree(t) for t in parts)
            opt.buffers[i] = parts if isinstance(opt, Adam) else parts[0]
        # each rank's generators (torch's, and its GPU's on CUDA), in a row of its own
        mine = rng_state(device)
        n, cut = sum(t.numel() for k, t in mine.items() if k in RANK_RNGS), mine["torch"].numel()
        rows = torch.zeros(self.world, n + 1, dtype=torch.float64)
        if rank == 0:
            for r, proc in enumerate(state["processes"]):
                saved = proc.get("rng")
                if saved is not None and all(k in saved for k in mine if k in RANK_RNGS):
                    row = torch.cat([saved[k] for k in RANK_RNGS if k in mine])
                    rows[r, :n], rows[r, n] = row.double(), 1
        rows = agree(rows.to(device)).cpu()
        if rank != 0 and rows[rank, n]:
            row = rows[rank, :n].to(torch.uint8)
            self.resumed_rng = {"torch": row[:cut], **({"cuda": row[cut:]} if "cuda" in mine
                                                       else {})}


def _rule(state: dict) -> str:
    staleness = state.get("staleness")
    kind = state.get("inner", {}).get("kind") if state.get("kind") == "delayed" else None
    return f"{kind} delayed {staleness} steps" if kind else str(state.get("kind"))
