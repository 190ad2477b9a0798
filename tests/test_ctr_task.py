"""The ctr task: its generated data are a function of the seed, ids are Zipf-distributed over
scattered ids, AUC is exact over the whole test split, the teacher's ceiling is known, and
single trains the DLRM-like model past AUC 0.7."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from asyncsgd import TaskError, load_task
from asyncsgd.core import ctr_data
from asyncsgd.core.scoring import AUC, Metric, auc
from asyncsgd.core.tasks import task_identity
from conftest import read_json


def _brute_auc(scores, labels) -> float:
    """Every (positive, negative) pair: 1 when the positive scores higher, 1/2 for a tie."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auc_of_a_hand_computed_case():
    # positives 0.8, 0.4, 0.4; negatives 0.4, 0.1: pairs (0.8 > 0.4), (0.8 > 0.1),
    # (0.4 = 0.4) twice, (0.4 > 0.1) twice: (1 + 1 + 0.5 + 0.5 + 1 + 1) / 6
    assert auc([0.8, 0.4, 0.4, 0.4, 0.1], [1, 1, 0, 1, 0]) == pytest.approx(5 / 6, abs=1e-15)
    assert auc([3.0, 2.0, 1.0], [1, 1, 0]) == 1.0
    assert auc([1.0, 2.0, 3.0], [1, 1, 0]) == 0.0
    assert auc([5.0, 5.0, 5.0, 5.0], [1, 0, 1, 0]) == 0.5
    assert math.isnan(auc([1.0, 2.0], [1, 1]))


@pytest.mark.parametrize("seed", range(6))
def test_auc_equals_the_brute_force_over_every_pair(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    scores = rng.integers(0, 8, size=n).astype(np.float64)   # many ties
    labels = rng.integers(0, 2, size=n)
    labels[:2] = (0, 1)
    assert auc(scores, labels) == pytest.approx(_brute_auc(scores, labels), abs=1e-12)


def test_auc_is_taken_over_the_whole_split_not_averaged_per_batch():
    """A split whose every batch holds one class: a per-batch AUC has nothing to rank, the
    whole split's is exact."""
    task = load_task("ctr:rows=50", samples=400)
    model = task.build_model(seed=1)
    y = task.test.targets
    order = torch.argsort(y, stable=True)
    task.test.inputs = tuple(t[order] for t in task.test.inputs)
    task.test.targets = y[order]
    result = task.evaluate(model, batch_size=7)
    with torch.no_grad():
        scores = model(*task.test.inputs)
    assert result["auc"] == auc(scores.numpy(), task.test.targets.numpy())
    logloss = torch.nn.functional.binary_cross_entropy_with_logits(
        scores, task.test.targets.float())
    assert result["loss"] == pytest.approx(float(logloss), rel=1e-5)


def test_a_metric_takes_exactly_one_way_of_scoring():
    with pytest.raises(ValueError, match="exactly one of per_batch, from_loss or whole"):
        Metric("x", True, whole=auc, from_loss=abs)
    assert AUC.higher_is_better and not AUC.percent
    with pytest.raises(ValueError, match="auc lies between 0 and 1"):
        AUC.check_target(75)


def test_the_data_are_a_function_of_the_seed():
    a, b = ctr_data.generate(500, 1000, seed=3), ctr_data.generate(500, 1000, seed=3)
    for field in ("dense", "categorical", "labels", "teacher"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    c = ctr_data.generate(500, 1000, seed=4)
    assert not np.array_equal(a.categorical, c.categorical)
    test = ctr_data.generate(500, 1000, seed=3, stream=1)
    assert not np.array_equal(a.categorical, test.categorical)
    assert a.dense.shape == (500, 13) and a.dense.dtype == np.float32
    assert a.categorical.shape == (500, 26) and a.categorical.dtype == np.int64
    assert a.categorical.min() >= 0 and a.categorical.max() < 1000
    assert set(np.unique(a.labels)) == {0, 1}


def test_ids_follow_zipf_over_scattered_ids():
    rows, n = 5000, 200_000
    data = ctr_data.generate(n, rows, seed=0)
    counts = np.bincount(data.categorical[:, 0], minlength=rows)
    top = np.sort(counts)[::-1]
    # rank 1 over rank 2 is 2^1.1 = 2.14 under Zipf(1.1); rank 1's share is 1/H(5000, 1.1)
    assert top[0] / top[1] == pytest.approx(2 ** 1.1, rel=0.05)
    assert top[0] / top[9] == pytest.approx(10 ** 1.1, rel=0.1)
    harmonic = (np.arange(1, rows + 1, dtype=np.float64) ** -1.1).sum()
    assert top[0] / n == pytest.approx(1 / harmonic, rel=0.02)
    hot = np.argsort(counts)[::-1][:10]
    assert sorted(hot) != list(range(10)) and hot.max() > rows // 10   # not ids 0..9
    other = np.argsort(np.bincount(data.categorical[:, 1], minlength=rows))[::-1][:10]
    assert set(hot) != set(other)   # each feature its own permutation


def test_rank_to_id_is_a_bijection():
    teacher = ctr_data.Teacher(1000, seed=5)
    ranks = np.arange(1000)
    for f in range(3):
        ids = ctr_data.rank_to_id(ranks, 1000, teacher.multipliers[f], teacher.offsets[f])
        assert sorted(ids) == list(range(1000))


def test_the_teachers_ceiling_is_its_own_test_auc():
    task = load_task("ctr")
    ceiling = task.info["auc_ceiling"]
    assert 0.7 < ceiling < 1
    test = ctr_data.generate(len(task.test), task.info["rows"], 1234,
                             ctr_data.Teacher(task.info["rows"], 1234), stream=1)
    assert np.array_equal(test.labels, task.test.targets.numpy())
    assert ceiling == round(ctr_data.auc_ceiling(test), 4)
    assert ctr_data.auc_ceiling(test) == auc(test.teacher, test.labels)
    assert 0.15 < test.labels.mean() < 0.35   # clicks are a minority, as in Criteo


def test_rows_scale_the_tables_and_are_checked():
    task = load_task("ctr:rows=100", samples=200)
    model = task.build_model()
    assert len(model.tables) == 26
    assert all(t.weight.shape == (100, 16) and t.sparse for t in model.tables)
    assert task_identity("ctr", 0) == task_identity("ctr:rows=10000", 5)
    for bad in ("0", "1e7"):
        with pytest.raises(TaskError, match="ctr:rows=.*: give a whole number"):
            load_task(f"ctr:rows={bad}", samples=200)


def test_the_gradient_of_a_step_touches_only_the_batchs_rows():
    task = load_task("ctr:rows=1000", samples=300)
    model = task.build_model()
    inputs, targets = task.train.rows(torch.arange(8))
    task.loss_fn(model(*inputs), targets).backward()
    grad = model.tables[0].weight.grad
    assert grad.is_sparse
    assert set(grad.coalesce().indices()[0].tolist()) == set(inputs[1][:, 0].tolist())


def test_single_trains_ctr_past_auc_0_7(run_cli_here, tmp_path):
    res = run_cli_here("single", "--task", "ctr:rows=1000", "--samples", "30000",
                       "--epochs", "1", "--eval-every", "100", "--threads", "1",
                       "--progress", "off", "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["metric"]["name"] == "auc" and summary["final_metric"] > 0.7, summary


def test_an_auc_target_out_of_range_is_refused(run_cli_here, tmp_path):
    res = run_cli_here("single", "--task", "ctr:rows=10", "--samples", "100", "--target", "75",
                       "--progress", "off", "--out", tmp_path / "run")
    assert res.returncode != 0 and "auc lies between 0 and 1" in res.stderr
