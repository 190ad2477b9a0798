"""Hogwild's training state in shared memory, so the parent can checkpoint what each worker's
own optimizer, data position and generators hold (``modes.resume``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .optim import SGD

log = logging.getLogger(__name__)

ROW_BITS = 32
# Columns of Hogwild's shared per-worker counters (``hogwild.COLUMNS``) kept here
POSITION, RNG_SAVED = 5, 6


def pack(epoch: int, row: int) -> int:
    return epoch << ROW_BITS | row


def unpack(position: int) -> tuple:
    return position >> ROW_BITS, position & ((1 << ROW_BITS) - 1)


class HogwildState:
    """Positions, generators and momentum buffers of ``procs`` workers, in shared memory.

    Positions and the generators' saved flags are two columns (``POSITION``,
    ``RNG_SAVED``) of the workers' shared int64 counters, which every worker gets anyway:
    each shared tensor more costs every spawned worker a round trip to the parent for its
    file descriptor (experiments/README.md, "Start-up and exit").

    A worker's momentum buffers start as zeros (a first ``b = m * b + g`` gives ``b = g``,
    as a fresh buffer would); its position is ``epoch << 32 | rows done``, one aligned
    store, so the parent never reads an epoch with another epoch's row; its generators are
    copied into a shared row when it stops, and a resumed worker clears that row once
    loaded, so no later checkpoint pairs an old generator with a new position. A periodic
    checkpoint is as racy as the parameters it saves; the final one is exact."""

    def __init__(self, procs: int, params: list, momentum: float, start_epoch: int,
                 counters: torch.Tensor, device: torch.device = torch.device("cpu")):
        self.procs = procs
        self.positions, self.rng_saved = counters[:, POSITION], counters[:, RNG_SAVED]
        self.positions[:] = pack(start_epoch, 0)
        self.rng_saved[:] = 0
        self.cut = torch.get_rng_state().numel()  # then the GPU's generator, on CUDA
        size = worker_rngs(device).numel()
        self.rngs = torch.zeros(procs, size, dtype=torch.uint8).share_memory_()
        trainable = [p for p in params if p.requires_grad]
        # momentum 0 keeps no buffer, as SGD does
        self.buffers = [[torch.zeros_like(p).share_memory_() for p in trainable]
                        for _ in range(procs)] if momentum else [[] for _ in range(procs)]
        self.momentum = momentum

    def for_worker(self, rank: int) -> tuple:
        """What worker ``rank`` is given besides the counters: the generators' rows and its
        momentum buffers."""
        return self.rngs, self.buffers[rank]

    def state(self) -> dict:
        """The training state for a checkpoint, in ``modes.resume``'s shape."""
        processes = []
        for rank in range(self.procs):
            epoch, row = unpack(int(self.positions[rank]))
            proc = {"epoch": epoch, "row": row,
                    "rng": self._rng_dict(self.rngs[rank]) if self.rng_saved[rank] else None}
            if self.momentum:
                proc["optimizer"] = {"kind": SGD.KIND, "buffers": {
                    i: b.clone() for i, b in enumerate(self.buffers[rank])}}
            processes.append(proc)
        return {"optimizer": None, "scaler": None, "processes": processes}

    def restore(self, state: dict, rows: list) -> Optional[str]:
        """Load a full checkpoint's state (``rows``: each worker's partition length); None
        when it fits, else what does not (the caller raises it as the checkpoint's error)."""
        procs = state["processes"]
        if len(procs) != self.procs:
            log.warning("the checkpoint was saved by %d Hogwild process(es), this run has %d: "
                        "their data partitions differ, so each starts its epoch from its first "
                        "row, with fresh momentum buffers and generators", len(procs), self.procs)
            return None
        for rank, proc in enumerate(procs):
            if proc["row"] > rows[rank]:
                return f"worker {rank} resumes at row {proc['row']} of a partition of {rows[rank]}"
            rng = proc.get("rng")
            if rng is not None and self._rng_row(rng) is None:
                return (f"worker {rank}'s generator state does not fit this torch and device "
                        "(saved on another torch version, or on CPU for a CUDA run)")
            saved_opt = proc.get("optimizer")
            if bool(saved_opt) != bool(self.momentum):
                log.warning("worker %d: the checkpoint has %s momentum buffer; this run's "
                            "--momentum is %g: it starts afresh", rank,
                            "a" if saved_opt else "no", self.momentum)
            elif saved_opt:
                opt = SGD(_shaped(self.buffers[rank]), lr=1.0, momentum=self.momentum)
                opt.keep_buffers_in(self.buffers[rank])
                try:
                    opt.load_state_dict(saved_opt)
                except ValueError as exc:
                    return f"worker {rank}: {exc}"
        for rank, proc in enumerate(procs):
            self.positions[rank] = pack(proc["epoch"], proc["row"])
            if proc.get("rng") is not None:
                self.rngs[rank] = self._rng_row(proc["rng"])
                self.rng_saved[rank] = 1
        return None

    def _rng_dict(self, row: torch.Tensor) -> dict:
        """A worker's shared row as ``checkpoint.rng_state``'s keys."""
        return {"torch": row[:self.cut].clone(),
                **({"cuda": row[self.cut:].clone()} if len(row) > self.cut else {})}

    def _rng_row(self, rng) -> Optional[torch.Tensor]:
        """A saved generator state as a worker's row; None when it does not fit."""
        keys = ("torch", "cuda") if self.rngs.shape[1] > self.cut else ("torch",)
        if not isinstance(rng, dict) or not all(isinstance(rng.get(k), torch.Tensor)
                                                 for k in keys):
            return None
        row = torch.cat([rng[k].to(torch.uint8).flatten() for k in keys])
        return row if row.numel() == self.rngs.shape[1] else None


def worker_rngs(device: torch.device) -> torch.Tensor:
    """This process's torch generator, and its GPU's on a CUDA device, as one row."""
    state = torch.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    return state


def set_worker_rngs(row: torch.Tensor, device: torch.device) -> None:
    """Restore what ``worker_rngs`` gave."""
    cut = torch.get_rng_state().numel()
    torch.set_rng_state(row[:cut].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(row[cut:].clone(), device)


def _shaped(buffers: list) -> list:
    """Stand-in parameters of the buffers' shapes, for SGD's shape checks."""
    return [torch.nn.Parameter(torch.empty_like(b)) for b in buffers]
