"""Load balancing's arithmetic: batches and local steps sized to each worker's measured speed.

Pure functions shared by every mode that balances (DDP's ranks, the parameter server's shard 0,
the virtual clock), so they all size work by the same rule: LB-BSP's batches proportional to
throughput with the global batch kept, and DyLU's local steps proportional to speed.
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch

from .signature import PS_PARTITION_SEED
from .tasks import epoch_order, partition_indices


def _check_speeds(speeds: Sequence[float], what: str) -> None:
    if not speeds:
        raise ValueError(f"{what} of no workers")
    bad = [s for s in speeds if not (math.isfinite(s) and s > 0)]
    if bad:
        raise ValueError(f"{what}: speeds must be finite and above 0, got {bad[0]!r}")


def batch_sizes(speeds: Sequence[float], global_batch: int, min_batch: int = 1) -> List[int]:
    """Each worker's batch, in proportion to its speed (samples a second), summing to
    ``global_batch`` exactly and none below ``min_batch``.

    Workers whose share would fall below ``min_batch`` get ``min_batch`` and the rest is
    shared among the others in proportion to speed (water-filling); the rounding's leftovers
    go to the largest remainders (ties to the lower rank), so equal speeds give equal
    batches (within one) and the result is a function of the inputs alone: every rank that
    computes it gets the same answer.
    """
    _check_speeds(speeds, "batch sizes")
    n = len(speeds)
    if min_batch < 1:
        raise ValueError(f"min_batch {min_batch}: at least 1")
    if global_batch < n * min_batch:
        raise ValueError(f"a global batch of {global_batch} cannot give {n} workers "
                         f"{min_batch} samples each")
    floored: set = set()
    while True:
        free = [i for i in range(n) if i not in floored]
        spare = global_batch - len(floored) * min_batch
        total = float(sum(speeds[i] for i in free))
        shares = {i: spare * speeds[i] / total for i in free}
        low = {i for i, x in shares.items() if x < min_batch}
        if not low:
            break
        floored |= low
    sizes = [min_batch if i in floored else int(math.floor(shares[i])) for i in range(n)]
    left = global_batch - sum(sizes)
    by_remainder = sorted(free, key=lambda i: (-(shares[i] - math.floor(shares[i])), i))
    for i in by_remainder[:left]:
        sizes[i] += 1
    return sizes


def offsets(sizes: Sequence[int]) -> List[int]:
    """Where each worker's batch starts in the global batch: the sizes before it, summed."""
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def weights(sizes: Sequence[int]) -> List[float]:
    """What each worker's mean gradient counts for in the global one: its share of the
    samples, so the weighted sum of the workers' means is the mean over the global batch."""
    total = sum(sizes)
    if total <= 0 or any(s < 0 for s in sizes):
        raise ValueError(f"weights of batch sizes {list(sizes)}")
    return [s / total for s in sizes]


def local_steps(speeds: Sequence[float], fastest: int) -> List[int]:
    """DyLU: each worker's local steps in proportion to its speed (steps a second), the
    fastest running ``fastest``, none fewer than 1, so that all reach a sync together."""
    _check_speeds(speeds, "local steps")
    if fastest < 1:
        raise ValueError(f"the fastest worker's local steps, {fastest}: at least 1")
    top = max(speeds)
    return [max(1, min(fastest, int(round(fastest * s / top)))) for s in speeds]


def global_slice(step: int, rows: int, global_batch: int, offset: int, size: int) -> tuple:
    """``(epoch, start, end)``: the rows of one worker's batch at global ``step``, as
    positions in that epoch's permutation of all ``rows`` training rows. Step s of an epoch
    is the global batch [s*B, (s+1)*B); the worker takes [s*B + offset, s*B + offset + size).
    An epoch is ``rows // B`` whole global batches (at least 1): the last ``rows % B`` rows
    of each epoch's permutation, a different few every epoch, wait for a later epoch."""
    per_epoch = max(1, rows // global_batch)
    epoch, k = divmod(step, per_epoch)
    start = min(k * global_batch + offset, rows)
    return epoch, start, min(start + size, rows)


def global_order(rows: int, epoch: int) -> torch.Tensor:
    """The parameter server's one permutation of all ``rows`` training rows in ``epoch``,
    which every balanced worker slices (``global_slice``) and draws alike."""
    every = partition_indices(rows, 1, 0, PS_PARTITION_SEED)
    return epoch_order(every, PS_PARTITION_SEED, 0, epoch)


def global_counts(rows: int, global_batch: int, steps: int) -> torch.Tensor:
    """How many times each row was trained after ``steps`` whole global batches sliced from
    ``global_order``: once an epoch, but for the ``rows % global_batch`` each epoch leaves."""
    per_epoch = max(1, rows // global_batch)
    counts = torch.zeros(rows, dtype=torch.int64)
    epochs, left = divmod(steps, per_epoch)
    for epoch in range(epochs + 1):
        done = global_order(rows, epoch)[:(per_epoch if epoch < epochs else left) * global_batch]
        counts.index_add_(0, done, torch.ones_like(done))
    return counts
