"""Coverage's summary: exact figures from hand-made counts."""

import pytest
import torch

from asyncsgd.core import coverage


def test_of_samples_gives_min_max_mean_and_their_ratio():
    c = coverage.of_samples(torch.tensor([2, 2, 3, 1]))
    assert c == {"granularity": "sample", "min": 1.0, "max": 3.0, "mean": 2.0, "spread": 3.0}


def test_a_sample_never_seen_has_no_finite_spread():
    assert coverage.of_samples(torch.tensor([0, 4]))["spread"] is None


def test_of_partitions_counts_each_row_as_its_partitions_share():
    # a 4x straggler: its partition of 100 rows seen once, the other's 300 rows 4 times
    c = coverage.of_partitions([100, 1200], [100, 300])
    assert c["granularity"] == "partition" and c["spread"] == 4.0 and c["mean"] == 2.5


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        coverage.of_partitions([1], [1, 2])
    with pytest.raises(ValueError):
        coverage.of_samples(torch.tensor([]))
