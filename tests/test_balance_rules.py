"""Load balancing's arithmetic: hand-computed batches, offsets, weights and DyLU's steps."""

import pytest
import torch

from asyncsgd.core import balance


def test_a_4x_straggler_of_2_gets_a_fifth_of_the_global_batch():
    assert balance.batch_sizes([4.0, 1.0], 100) == [80, 20]


def test_sizes_sum_exactly_and_leftovers_go_to_the_largest_remainders():
    sizes = balance.batch_sizes([1.0, 1.0, 1.0], 100)
    assert sizes == [34, 33, 33] and sum(sizes) == 100
    assert balance.batch_sizes([10.0, 1.0, 1.0], 64, min_batch=8) == [48, 8, 8]


def test_every_worker_keeps_the_minimum_batch():
    assert balance.batch_sizes([1000.0, 1.0], 40, min_batch=8) == [32, 8]
    with pytest.raises(ValueError, match="cannot give 3 workers 16"):
        balance.batch_sizes([1.0, 1.0, 1.0], 40, min_batch=16)
    with pytest.raises(ValueError, match="finite and above 0"):
        balance.batch_sizes([1.0, float("nan")], 40)


def test_the_weighted_mean_of_unequal_batches_is_the_big_batch_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))

    def grad(rows):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        return model.weight.grad.clone()

    sizes = balance.batch_sizes([3.0, 1.0, 0.5], 64, min_batch=4)
    starts = balance.offsets(sizes)
    parts = [grad(slice(a, a + b)) for a, b in zip(starts, sizes)]
    mixed = sum(w * g for w, g in zip(balance.weights(sizes), parts))
    assert sizes != [sizes[0]] * 3 and starts == [0, sizes[0], sizes[0] + sizes[1]]
    assert torch.allclose(mixed, grad(slice(0, 64)), atol=1e-6, rtol=0)


def test_dylu_local_steps_follow_speed_with_the_fastest_at_h():
    assert balance.local_steps([4.0, 1.0], 8) == [8, 2]
    assert balance.local_steps([1.0, 0.5, 0.1, 0.01], 8) == [8, 4, 1, 1]
    with pytest.raises(ValueError):
        balance.local_steps([1.0], 0)


def test_global_counts_are_whole_batches_of_the_global_order():
    # 10 rows, batches of 4: an epoch is 2 batches, its last 2 rows wait
    counts = balance.global_counts(10, 4, 3)  # two batches of epoch 0, one of epoch 1
    first, second = balance.global_order(10, 0), balance.global_order(10, 1)
    expected = torch.zeros(10, dtype=torch.int64)
    expected[first[:8]] += 1
    expected[second[:4]] += 1
    assert torch.equal(counts, expected) and int(counts.sum()) == 12
    assert not torch.equal(first, second)  # each epoch its own order
