"""Hogwild's rows: each process's fixed partition (static), or batches claimed on demand from
one shared counter over each epoch's shuffle of all rows (``--data-dispatch dynamic``).

Both ways a shared count of how many times each row was trained gives the run's coverage.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from ..core.tasks import epoch_order
from .hogwild_state import POSITION, pack, unpack

EPOCHS = 2  # the column of Hogwild's per-worker counters with its epochs done (hogwild.EPOCHS)


class RowLedger:
    """In one shared int64 tensor: the dynamic dispatch's position (``epoch << 32 | row`` of
    the epoch's order), each process's claimed batch not yet trained (``epoch << 32 | start``
    and its end, 0: none) and each row's training count.

    Dynamic claims, counts and the claims' release all take ``lock`` (a multiprocessing
    Lock, one futex a step), so a snapshot under it is consistent: every claimed row is
    either counted or in a process's unfinished claim. Static partitions are disjoint: their
    counts need no lock."""

    def __init__(self, rows: int, procs: int, seed: int, dynamic: bool, lock=None,
                 start_epoch: int = 0):
        self.rows, self.procs, self.seed, self.dynamic = rows, procs, seed, dynamic
        self.lock = lock if lock is not None else nullcontext()
        self.table = torch.zeros(1 + 2 * procs + rows, dtype=torch.int64).share_memory_()
        self.table[0] = pack(start_epoch, 0)
        self._order: tuple = (None, None)

    @property
    def counts(self) -> torch.Tensor:
        return self.table[1 + 2 * self.procs:]

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s shuffle of all rows: a function of (seed, epoch) alone."""
        if self._order[0] != epoch:
            self._order = (epoch, epoch_order(torch.arange(self.rows), self.seed, 0, epoch))
        return self._order[1]

    def epochs_done(self) -> int:
        """Dynamic: epochs whose rows are all claimed."""
        return unpack(int(self.table[0]))[0]

    def claim(self, rank: int, batch: int, epochs: int) -> Optional[tuple]:
        """The next batch of the epoch's order, as (epoch, start, end), recorded as ``rank``'s
        unfinished claim; None once ``epochs`` epochs are all claimed."""
        with self.lock:
            epoch, start = unpack(int(self.table[0]))
            if epoch >= epochs:
                return None
            end = min(start + batch, self.rows)
            self.table[0] = pack(epoch + 1, 0) if end == self.rows else pack(epoch, end)
            self._hold(rank, epoch, start, end)
        return epoch, start, end

    def hold(self, rank: int, claim: tuple) -> None:
        """Record a claim handed again (a resumed run's unfinished one) as ``rank``'s."""
        with self.lock:
            self._hold(rank, *claim)

    def _hold(self, rank: int, epoch: int, start: int, end: int) -> None:
        self.table[1 + 2 * rank] = pack(epoch, start)
        self.table[2 + 2 * rank] = end

    def trained(self, rank: int, rows: torch.Tensor) -> None:
        """``rank`` has applied its update from ``rows``: count them, release its claim."""
        if not self.dynamic:
            self.counts[rows] += 1
            return
        with self.lock:
            self.counts[rows] += 1
            self.table[2 + 2 * rank] = 0

    def unfinished(self) -> list:
        """The claims not yet trained, as [epoch, start, end]."""
        claims = self.table[1:1 + 2 * self.procs].view(self.procs, 2).tolist()
        return [[*unpack(c), end] for c, end in claims if end > 0]

    def state(self) -> dict:
        """For a checkpoint: the dispatch (its position and unfinished claims) and the counts."""
        with self.lock:
            epoch, row = unpack(int(self.table[0]))
            return {"kind": "dynamic" if self.dynamic else "static", "epoch": epoch, "row": row,
                    "unfinished": self.unfinished() if self.dynamic else [],
                    "counts": self.counts.clone()}

    def restore(self, saved: Optional[dict]) -> list:
        """A checkpoint's counts (when of as many rows) and, for the same kind of dispatch,
        its position; returns the unfinished claims to hand out again first."""
        if not isinstance(saved, dict):
            return []
        counts = saved.get("counts")
        if isinstance(counts, torch.Tensor) and counts.numel() == self.rows:
            self.counts.copy_(counts.to(torch.int64))
        if saved.get("kind") != ("dynamic" if self.dynamic else "static") or not self.dynamic:
            return []
        self.table[0] = pack(int(saved["epoch"]), int(saved["row"]))
        return [tuple(int(v) for v in c) for c in saved.get("unfinished", [])
                if int(c[2]) <= self.rows]


class StaticRows:
    """One process's batches of its own partition, reshuffled each epoch, from its saved
    position; it keeps its position and epochs in its row ``count`` of the shared counters."""

    def __init__(self, part: torch.Tensor, seed: int, rank: int, epochs: int, batch: int,
                 count):
        self.part, self.seed, self.rank, self.epochs, self.batch = part, seed, rank, epochs, batch
        self.count = count
        self.epoch, self.start = unpack(int(count[POSITION]))
        self.order = None

    def next(self) -> Optional[torch.Tensor]:
        while self.epoch < self.epochs:
            if self.order is None:
                self.order = epoch_order(self.part, self.seed, self.rank, self.epoch)
            if self.start < len(self.order):
                return self.order[self.start:self.start + self.batch]
            self._next_epoch()
        return None

    def done(self, rows: torch.Tensor) -> None:
        self.start = min(self.start + self.batch, len(self.order))
        self.count[POSITION] = pack(self.epoch, self.start)
        if self.start >= len(self.order):
            self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch, self.start, self.order = self.epoch + 1, 0, None
        self.count[POSITION] = pack(self.epoch, 0)
        self.count[EPOCHS] = self.epoch


class DynamicRows:
    """One process's batches claimed from the ledger: first the unfinished claims it was
    handed again (``pending``), then the next of the shared counter's."""

    def __init__(self, ledger: RowLedger, rank: int, epochs: int, batch: int, pending: list,
                 count):
        self.ledger, self.rank, self.epochs, self.batch = ledger, rank, epochs, batch
        self.pending, self.count = list(pending), count

    def next(self) -> Optional[torch.Tensor]:
        if self.pending:
            claim = self.pending.pop(0)
            self.ledger.hold(self.rank, claim)
        else:
            claim = self.ledger.claim(self.rank, self.batch, self.epochs)
        self.count[EPOCHS] = self.ledger.epochs_done()
        if claim is None:
            return None
        epoch, start, end = claim
        return self.ledger.order(epoch)[start:end]

    def done(self, rows: torch.Tensor) -> None:
        self.count[EPOCHS] = self.ledger.epochs_done()
