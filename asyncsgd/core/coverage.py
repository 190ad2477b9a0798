"""Coverage: how evenly a run trained on its samples, the spread of how many times each was seen.

One summary for every mode: ``of_samples`` where the exact count of each sample is known
(dynamic dispatch, Hogwild's shared counter), ``of_partitions`` where only each fixed
partition's total is (static partitions: a worker's samples over its partition's size).
"""

from __future__ import annotations

from typing import Sequence

import torch


def _summary(times: Sequence[float], granularity: str) -> dict:
    low, high = min(times), max(times)
    return {"granularity": granularity, "min": round(low, 4), "max": round(high, 4),
            "mean": round(sum(times) / len(times), 4),
            # max over min: 1.0 when every sample was seen alike; None when one never was
            "spread": round(high / low, 4) if low > 0 else None}


def of_samples(counts: torch.Tensor) -> dict:
    """Coverage from the count of times each sample was trained (one entry per sample)."""
    if counts.numel() == 0:
        raise ValueError("coverage of no samples")
    return _summary(counts.double().tolist(), "sample")


def of_partitions(samples: Sequence[int], sizes: Sequence[int]) -> dict:
    """Coverage of fixed partitions: partition ``i`` (``sizes[i]`` rows) was trained on
    ``samples[i]`` times a row in all; each of its rows counts ``samples[i] / sizes[i]``
    (exact after whole epochs, within one of a partial one)."""
    if len(samples) != len(sizes) or not sizes:
        raise ValueError(f"{len(samples)} sample counts for {len(sizes)} partitions")
    return _summary([s / max(1, z) for s, z in zip(samples, sizes)], "partition")
