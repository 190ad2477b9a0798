"""DDP's ``--balance batch``: each rank's share of one global batch, sized to its speed.

Every rank slices the same global batch out of the epoch's permutation of all training rows
and scales its loss by its share, so DDP's averaging all-reduce gives the global batch's mean.
"""

from __future__ import annotations

from typing import Iterator, List, Optional

import torch

from ..config.shared import min_batch
from ..core.balance import batch_sizes, offsets
from ..core.tasks import epoch_order
from ..errors import ConfigError


def check_balance(cfg, world: int, batch: int) -> None:
    """--balance batch settings that cannot work: one clear line before any rank trains."""
    if getattr(cfg, "balance", "none") != "batch":
        return
    if world < 2:
        raise ConfigError("--balance batch with 1 rank: there is no other rank to balance "
                          "against; use --procs 2 or more, or drop --balance")
    if cfg.local_steps > 1:
        raise ConfigError(f"--balance batch with --local-steps {cfg.local_steps}: post-local "
                          "SGD averages the ranks' parameters unweighted, so unequal batches "
                          "would be weighted wrong; choose one")
    if min_batch(cfg.min_batch, batch) > batch:
        raise ConfigError(f"--min-batch {cfg.min_batch} exceeds --batch-size {batch}: the "
                          f"global batch ({batch} x {world} ranks) cannot give every rank "
                          f"{cfg.min_batch}; give --min-batch {batch} or less")


class BatchBalance:
    """One rank's view of the balanced global batch (the same on every rank).

    Step ``s`` of an epoch takes rows ``[s*B, (s+1)*B)`` of the epoch's permutation of all
    ``rows`` training rows; rank ``i`` takes ``sizes[i]`` of them from ``offsets[i]``.
    Every row is trained once an epoch; only when the epoch's last step would have fewer
    rows than ranks is the permutation padded with its own first rows (a few seen twice).
    ``resize`` sets the sizes from the ranks' speeds (``core.balance.batch_sizes``); they
    start equal, also after a --resume (a resumed run measures the speeds afresh).
    """

    def __init__(self, rows: int, world: int, rank: int, batch_size: int, least: int,
                 every: int, seed: int):
        self.rows, self.world, self.rank = rows, world, rank
        self.global_batch, self.least, self.every, self.seed = batch_size * world, least, \
            every, seed
        self.speeds: Optional[List[float]] = None
        self.sizes = batch_sizes([1.0] * world, self.global_batch, least)
        self.resizings = 0
        self.changes: list = []  # [step, sizes] at each re-sizing that changed them
        self._mark = (0.0, 0)  # (compute seconds, samples) of this rank at the last re-sizing

    @property
    def epoch_rows(self) -> int:
        """Rows an epoch steps through: all, padded so that its last step has a row a rank."""
        short = self.rows % self.global_batch
        return self.rows + (self.world - short if 0 < short < self.world else 0)

    def order(self, epoch: int) -> torch.Tensor:
        order = epoch_order(torch.arange(self.rows), self.seed, 0, epoch)
        return torch.cat([order, order[:self.epoch_rows - self.rows]])

    def counts(self, epoch: int, row: int) -> torch.Tensor:
        """How many times each training row was trained after ``epoch`` whole epochs and
        ``row`` rows of the next: every row once an epoch, a padded epoch's first rows twice."""
        counts = torch.zeros(self.rows, dtype=torch.int64)
        for e in range(epoch):
            order = self.order(e)
            counts.index_add_(0, order, torch.ones_like(order))
        done = self.order(epoch)[:row]
        return counts.index_add_(0, done, torch.ones_like(done))

    def split(self, size: int) -> List[int]:
        """Every rank's rows of a global step of ``size`` rows (the epoch's last may be short)."""
        if size == self.global_batch:
            return self.sizes
        speeds = self.speeds or [1.0] * self.world
        return batch_sizes(speeds, size, max(1, min(self.least, size // self.world)))

    def steps(self, epoch: int, first_row: int) -> Iterator[tuple]:
        """This rank's (rows, the epoch's rows done after the step, loss scale) of each step
        of ``epoch`` from row ``first_row``. The scale, ``b_i * world / size``, makes the
        mean DDP takes of the ranks' gradients the mean over the global step's rows."""
        order = self.order(epoch)
        for start in range(first_row, len(order), self.global_batch):
            rows = self.slices(order, start)
            size = sum(len(r) for r in rows)
            yield rows[self.rank], start + size, len(rows[self.rank]) * self.world / size

    def slices(self, order: torch.Tensor, start: int) -> List[torch.Tensor]:
        """Every rank's rows of the global step that begins at row ``start`` of ``order``."""
        sizes = self.split(min(self.global_batch, len(order) - start))
        return [order[start + at:start + at + size] for at, size in zip(offsets(sizes), sizes)]

    def due(self, steps: int) -> bool:
        return steps % self.every == 0

    def my_speed(self, seconds: float, samples: int) -> torch.Tensor:
        """This rank's slot of the speeds to sum over the ranks: samples a second of
        computing since the last re-sizing (``seconds`` and ``samples`` are cumulative)."""
        vector = torch.zeros(self.world, dtype=torch.float64)
        dt, dn = seconds - self._mark[0], samples - self._mark[1]
        vector[self.rank] = dn / dt if dt > 0 and dn > 0 else 0.0
        self._mark = (seconds, samples)
        return vector

    def resize(self, speeds: List[float], step: int) -> None:
        """Every rank, with the same summed speeds: the sizes from now on. A rank that
        measured nothing (no compute time) leaves the sizes as they were."""
        if min(speeds) <= 0:
            return
        sizes = batch_sizes(speeds, self.global_batch, self.least)
        self.speeds = list(speeds)
        self.resizings += 1
        if sizes != self.sizes:
            self.changes.append([step, sizes])
        self.sizes = sizes

    def to_dict(self) -> dict:
        """summary.json's ``balance``."""
        return {"every": self.every, "min_batch": self.least, "batches": self.sizes,
                "speeds": [round(s, 1) for s in self.speeds] if self.speeds else None,
                "resizings": self.resizings, "changes": self.changes}
