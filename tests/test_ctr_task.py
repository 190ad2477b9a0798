"""The ctr task: its generated data are a function of the seed, ids are Zipf-distributed over
scattered ids, AUC is exact over the whole test split, the teacher's ceiling is known, and
single trains the DLRM-like model past AUC 0.7."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from asyncsgd import TaskError, load_task
from asyncsgd.core import ctr_data, models
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


class _DLRMBefore(torch.nn.Module):
    """The DLRM of before ``tables=K`` (commit 7d8b50a), verbatim: the oracle the default
    layout must match byte for byte."""

    def __init__(self, rows, tables=26, dense=13, dim=16, bottom=(64,), top=(64,)):
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.Embedding(rows, dim, sparse=True)
                                          for _ in range(tables))
        for table in self.tables:
            torch.nn.init.normal_(table.weight, std=0.1)
        self.bottom = models.MLP((dense, *bottom, dim))
        vectors = tables + 1
        self.top = models.MLP((dim + vectors * (vectors - 1) // 2, *top, 1))
        pairs = torch.triu_indices(vectors, vectors, offset=1)
        self.register_buffer("pairs", pairs, persistent=False)

    def forward(self, dense, categorical):
        x = torch.nn.functional.relu(self.bottom(dense))
        vectors = torch.stack([x, *(t(categorical[:, i]) for i, t in enumerate(self.tables))],
                              dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def _step(model, task, rows=64):
    """The outputs of one batch and the gradients of its log loss, by parameter name."""
    model.zero_grad(set_to_none=True)
    inputs, targets = task.train.rows(torch.arange(rows))
    out = model(*inputs)
    task.loss_fn(out, targets).backward()
    return out.detach(), {k: p.grad.coalesce() if p.grad.is_sparse else p.grad
                          for k, p in model.named_parameters()}


def test_the_default_26_tables_are_byte_identical_to_the_model_before_tables():
    task = load_task("ctr:rows=300", samples=400)
    assert task_identity("ctr", 0)[0] == "ctr:rows=10000,tables=26"
    model = task.build_model(seed=7)
    torch.manual_seed(7)
    before = _DLRMBefore(300, 26, 13)
    mine, theirs = model.state_dict(), before.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    out, grads = _step(model, task)
    out_before, grads_before = _step(before, task)
    assert torch.equal(out, out_before)
    for name, grad in grads.items():
        if grad.is_sparse:
            assert torch.equal(grad.indices(), grads_before[name].indices()), name
            grad, theirs = grad.values(), grads_before[name].values()
        else:
            theirs = grads_before[name]
        assert torch.equal(grad, theirs), name


def _shared(model26, tables: int):
    """A ``tables``-table DLRM holding ``model26``'s weights: feature f's table in the block of
    rows ``ctr:tables`` gives it (table f % tables, rows from (f // tables) * rows on)."""
    rows = model26.tables[0].num_embeddings
    shared = models.DLRM(rows, 26, 13, tables=tables)
    with torch.no_grad():
        for f, table in enumerate(model26.tables):
            slot = f // tables
            shared.tables[f % tables].weight[slot * rows:(slot + 1) * rows] = table.weight
        for name in ("bottom", "top"):
            getattr(shared, name).load_state_dict(getattr(model26, name).state_dict())
    return shared


@pytest.mark.parametrize("tables", [1, 2, 5, 13, 25])
def test_features_sharing_a_table_own_their_rows(tables):
    """The 26-table model's weights laid out in K tables give the same outputs, bit for bit,
    and the same gradient on every row: no two features' ids meet in a shared table."""
    rows = 97
    task = load_task(f"ctr:rows={rows},tables={tables}", samples=400)
    model26 = load_task(f"ctr:rows={rows}", samples=400).build_model(seed=3)
    shared = _shared(model26, tables)
    assert len(shared.tables) == tables and all(t.sparse for t in shared.tables)
    assert sum(t.num_embeddings for t in shared.tables) == 26 * rows
    out26, grads26 = _step(model26, task)
    out, grads = _step(shared, task)
    assert torch.equal(out, out26)
    for f in range(26):
        slot, table = f // tables, f % tables
        dense26 = grads26[f"tables.{f}.weight"].to_dense()
        dense = grads[f"tables.{table}.weight"].to_dense()[slot * rows:(slot + 1) * rows]
        # coalesce sums a row's repeats in an order of its own: equal up to rounding
        assert torch.allclose(dense, dense26, rtol=0, atol=1e-7), f
    for name in grads26:
        if not name.startswith("tables."):
            assert torch.equal(grads[name], grads26[name]), name


@pytest.mark.parametrize("tables", [1, 4, 26])
def test_embedding_inputs_are_the_ids_each_table_looks_up(tables):
    task = load_task(f"ctr:rows=50,tables={tables}", samples=300)
    model = task.build_model()
    seen = {}

    def record(table, args, out):   # returns None: the output stays the module's
        seen[len(seen)] = args[0]

    hooks = [t.register_forward_hook(record) for t in model.tables]
    inputs, _ = task.train.rows(torch.arange(37))
    model(*inputs)
    for hook in hooks:
        hook.remove()
    ids = model.embedding_inputs(*inputs)
    assert len(ids) == len(seen) == tables
    for t, table in enumerate(model.tables):
        assert ids[t].dtype == torch.int64 and torch.equal(ids[t], seen[t]), t
        assert 0 <= ids[t].min() and ids[t].max() < table.num_embeddings
        mine = list(range(t, 26, tables))
        expected = torch.cat([inputs[1][:, f] + (f // tables) * 50 for f in mine])
        assert torch.equal(ids[t], expected)


def test_one_table_of_ten_million_rows():
    task = load_task("ctr:rows=384616,tables=1", samples=100)
    assert task.info["tables"] == 1 and "1 embedding table," in task.description
    assert task.info["parameters"] == 384616 * 26 * 16 + sum(
        p.numel() for n, p in load_task("ctr:rows=1", samples=100).build_model()
        .named_parameters() if not n.startswith("tables."))


@pytest.mark.parametrize("bad", ["0", "27", "2.5", "one"])
def test_a_bad_number_of_tables_is_refused(bad):
    with pytest.raises(TaskError, match=r"ctr:tables=.*: give a whole number of embedding "
                                        r"tables between 1 .* and 26"):
        load_task(f"ctr:tables={bad}", samples=100)


@pytest.mark.processes
def test_building_a_ten_million_row_table_costs_its_size_once(tmp_path):
    """Peak RSS while building ``ctr:rows=384616,tables=1`` (10,000,016 x 16 float32s, 610
    MiB) grows by its size, not twice it: measured 597 MiB of growth, 0.98x (the table is
    filled in place; the bound leaves room for the allocator)."""
    script = (
        "import resource, json, sys\n"
        "from asyncsgd import load_task\n"
        "task = load_task('ctr:rows=384616,tables=1', samples=100)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "model = task.build_model()\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "size = sum(t.weight.numel() * 4 for t in model.tables)\n"
        "print(json.dumps({'grew': (after - before) * 1024, 'size': size}))\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["size"] == 10_000_016 * 16 * 4
    assert got["grew"] < 1.5 * got["size"], got


def test_the_dense_part_alone_is_the_model_given_its_looked_up_vectors():
    """What the baselines train beside remote tables (experiments/sparse_ps.py): DLRMDense
    with the model's MLPs, fed the vectors of ``embedding_inputs``, is the model."""
    task = load_task("ctr:rows=40,tables=1", samples=200)
    model = task.build_model(seed=2)
    head = models.DLRMDense(26, 13)
    head.load_state_dict({k: v for k, v in model.state_dict().items()
                          if not k.startswith("tables.")})
    (dense, categorical), _ = task.train.rows(torch.arange(19))
    ids, = model.embedding_inputs(dense, categorical)
    vectors = model.tables[0](ids).view(26, 19, 16).transpose(0, 1)
    assert torch.equal(head(dense, vectors), model(dense, categorical))


@pytest.mark.parametrize("tables", [1, 2, 5, 26])
def test_embedding_inputs_are_each_features_ids_in_its_block_feature_after_feature(tables):
    """The ids of table t: feature after feature of its features, each moved to its block
    of ``rows`` rows (the per-feature loop this replaced, as the oracle)."""
    model = models.DLRM(1000, tables=tables)
    categorical = torch.randint(0, 1000, (7, 26), generator=torch.Generator().manual_seed(2))
    got = model.embedding_inputs(torch.zeros(7, 13), categorical)
    for t, mine in enumerate(model.features_of):
        want = torch.cat([categorical[:, f] + slot * 1000 for slot, f in enumerate(mine)])
        assert torch.equal(got[t], want)
