"""A worker's local tables (workers/tables.py): plain objects, no processes.

Oracle: the whole model's own forward and backward on the same batch. The local weights
hold the pulled rows of the batch's unique ids; the loss must be the same bits and the
pushed gradient rows the whole table's gradient at those rows, zero elsewhere.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from asyncsgd.core.models import DLRM, binary_logloss, embedding_tables
from asyncsgd.core.sparse_ids import hash_id
from asyncsgd.errors import ConfigError
from asyncsgd.wire.layout import Layout
from asyncsgd.workers.tables import BatchTables, LocalRows, check_ids, route, unique_per_table

ROWS = 60


def ctr_batch(n=48, seed=0, tables=26, rows=ROWS):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, 13, generator=gen)
    # Zipf-ish: small ids repeat within the batch, as ctr's do
    categorical = (torch.rand(n, tables, generator=gen) ** 3 * rows).long()
    targets = torch.randint(0, 2, (n,), generator=gen)
    return (dense, categorical), targets


class Bags(nn.Module):
    """An EmbeddingBag model with offsets (and per-sample weights for sum), a dropout and a
    batch norm: what a probe must leave as it found it."""

    def __init__(self, mode="sum", sparse=True, rows=ROWS, dim=6):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, dim, mode=mode, sparse=sparse)
        self.plain = nn.Embedding(rows, dim, sparse=not sparse)
        self.norm = nn.BatchNorm1d(dim)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(dim, 1)
        self.mode = mode

    def forward(self, ids, offsets, weights, other):
        extra = {"per_sample_weights": weights} if self.mode == "sum" else {}
        x = self.bag(ids, offsets, **extra) + self.plain(other)
        return self.head(self.drop(self.norm(x))).squeeze(1)


def bags_batch(n=16, seed=1, rows=ROWS):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 5, (n,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 2 * rows).long()
    weights = torch.rand(len(ids), generator=gen)
    other = torch.randint(0, rows, (n,), generator=gen)
    return (ids, offsets, weights, other), torch.randint(0, 2, (n,), generator=gen)


def dense_grad(p):
    # coalesced first: an uncoalesced gradient's to_dense() sums duplicates in another
    # order (2.9e-11 apart here), coalesce() in the order the worker's does
    return p.grad.coalesce().to_dense() if p.grad.is_sparse else p.grad


def local_step(model, full, inputs, targets, seed=7):
    """The worker's step on a copy of ``full``: local rows, the same loss; returns the loss,
    the pushed (ids, values) per table and the dense parameters' gradients."""
    layout = Layout.of(model, embedding_tables(model))
    tables = BatchTables(model, layout)
    ids = tables.ids_of(inputs)
    weights = dict(full.named_parameters())
    rows = [weights[spec.name].detach()[i].clone() for spec, i in zip(layout.tables, ids)]
    tables.begin(ids, rows, torch.device("cpu"))
    torch.manual_seed(seed)
    loss = binary_logloss(model(*inputs), targets)
    loss.backward()
    tables.settle()
    names = {spec.name for spec in layout.tables}
    dense = {n: p.grad for n, p in model.named_parameters() if n not in names}
    return loss, tables.gradients(), dense, layout, tables


def full_step(full, inputs, targets, seed=7):
    torch.manual_seed(seed)
    loss = binary_logloss(full(*inputs), targets)
    loss.backward()
    return loss


def assert_same_step(full, model, inputs, targets):
    ours = copy.deepcopy(full)
    loss, pushed, dense, layout, _ = local_step(model, ours, inputs, targets)
    want = full_step(full, inputs, targets)
    # the same values through the same operations: the same bits
    assert loss.item() == want.item()
    named = dict(full.named_parameters())
    for spec, (ids, values) in zip(layout.tables, pushed):
        grad = dense_grad(named[spec.name])
        assert torch.equal(values, grad[ids]), spec.name
        rest = torch.ones(spec.rows, dtype=torch.bool)
        rest[ids] = False
        assert not bool(grad[rest].any()), f"{spec.name}: a row the push leaves out moved"
        assert len(torch.unique(ids)) == len(ids)
    for name, grad in dense.items():
        assert torch.equal(grad, dense_grad(named[name])), name
    return pushed


def test_dlrm_local_rows_give_the_whole_models_loss_and_row_gradients():
    full = DLRM(ROWS)
    inputs, targets = ctr_batch()
    pushed = assert_same_step(full, copy.deepcopy(full), inputs, targets)
    # a sparse module pushes exactly the rows the batch looked up
    assert torch.equal(pushed[3][0], torch.unique(inputs[1][:, 3]))


@pytest.mark.parametrize("mode,sparse", [("sum", True), ("sum", False), ("mean", True),
                                         ("mean", False), ("max", False)])
def test_embedding_bags_through_the_probe_give_the_whole_models_gradients(mode, sparse):
    # (torch has no sparse gradient for max bags)
    torch.manual_seed(3)
    full = Bags(mode, sparse)
    inputs, targets = bags_batch()
    assert_same_step(full, copy.deepcopy(full), inputs, targets)


def test_the_probe_leaves_batch_norm_statistics_and_the_random_stream_alone():
    torch.manual_seed(3)
    model = Bags()
    layout = Layout.of(model, embedding_tables(model))
    tables = BatchTables(model, layout)
    inputs, _ = bags_batch()
    before = copy.deepcopy(model.norm.state_dict())
    torch.manual_seed(11)
    ids = tables.ids_of(inputs)
    drawn = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(drawn, torch.rand(3))
    assert all(torch.equal(before[k], v) for k, v in model.norm.state_dict().items())
    assert model.training
    assert torch.equal(ids[0], torch.unique(inputs[0]))
    assert torch.equal(ids[1], torch.unique(inputs[3]))


def test_embedding_inputs_and_the_probe_agree_on_dlrm():
    model = DLRM(ROWS)
    tables = BatchTables(model, Layout.of(model, embedding_tables(model)))
    inputs, _ = ctr_batch()
    own = tables.ids_of(inputs)
    probed = [torch.unique(ids) for ids in tables._probe(inputs)]
    assert all(torch.equal(a, b) for a, b in zip(own, probed))


def test_the_worker_keeps_no_table_and_a_lookup_outside_a_step_or_the_batch_fails():
    model = DLRM(ROWS)
    tables = BatchTables(model, Layout.of(model, embedding_tables(model)))
    assert all(m.weight.shape == (0, 16) for m in tables.modules)
    inputs, _ = ctr_batch()
    with pytest.raises(RuntimeError, match="outside a step"):
        model(*inputs)
    ids = tables.ids_of(inputs)
    fewer = [i[1:] for i in ids]  # as a lying embedding_inputs would leave a row out
    tables.begin(fewer, [torch.zeros(len(i), 16) for i in fewer], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="embedding_inputs must return every id"):
        model(*inputs)


@pytest.mark.parametrize("module,words", [
    (nn.Embedding(10, 4, max_norm=1.0), "max_norm"),
    (nn.Embedding(10, 4, padding_idx=0), "padding_idx"),
    (nn.EmbeddingBag(10, 4, padding_idx=0), "padding_idx"),
])
def test_tables_whose_lookups_need_the_whole_table_are_refused(module, words):
    model = nn.Sequential(module)
    with pytest.raises(ConfigError, match=words):
        BatchTables(model, Layout.of(model, ["0.weight"]))


def test_a_table_that_is_not_an_embedding_is_refused():
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ConfigError, match="not the weight of an nn.Embedding"):
        BatchTables(model, Layout.of(model, ["0.weight"]))


def test_routing_follows_the_shards_rule_and_keeps_the_order():
    ids = torch.tensor([0, 3, 4, 7, 8, 11, -5, 1 << 40], dtype=torch.int64)
    for hashed in (False, True):
        parts = route(ids, 3, hashed)
        assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(len(ids)))
        for shard, at in enumerate(parts):
            keys = hash_id(ids[at]) if hashed else ids[at]
            assert bool((torch.remainder(keys, 3) == shard).all())
            assert bool((at[1:] > at[:-1]).all())


def test_ids_outside_a_fixed_table_are_named():
    model = DLRM(ROWS, tables=2)  # 13 features a table: 13 x ROWS rows each
    rows = 13 * ROWS
    layout = Layout.of(model, embedding_tables(model))
    check_ids([torch.tensor([0, rows - 1]), torch.tensor([5])], layout, hashed=False)
    check_ids([torch.tensor([rows]), torch.tensor([5])], layout, hashed=True)
    with pytest.raises(ConfigError, match=f"id {rows} of table 'tables.0.weight'"):
        check_ids([torch.tensor([0, rows]), torch.tensor([5])], layout, hashed=False)


def test_ids_outside_a_single_fixed_table_are_named():
    model = DLRM(ROWS, tables=1)  # the 26 features in one table of 26 x ROWS rows
    rows = 26 * ROWS
    layout = Layout.of(model, embedding_tables(model))
    check_ids([torch.tensor([0, rows - 1])], layout, hashed=False)
    check_ids([torch.tensor([], dtype=torch.int64)], layout, hashed=False)
    for bad in (rows, -1):
        with pytest.raises(ConfigError, match=f"id {bad} of table 'tables.0.weight'"):
            check_ids([torch.tensor([3, bad, 4])], layout, hashed=False)


def test_accumulated_micro_batches_share_one_local_weight():
    full = DLRM(ROWS)
    model = copy.deepcopy(full)
    inputs, targets = ctr_batch(n=40)
    layout = Layout.of(model, embedding_tables(model))
    tables = BatchTables(model, layout)
    ids = tables.ids_of(inputs)
    named = dict(full.named_parameters())
    tables.begin(ids, [named[s.name].detach()[i] for s, i in zip(layout.tables, ids)],
                 torch.device("cpu"))
    for part in (slice(0, 25), slice(25, 40)):
        sub = tuple(x[part] for x in inputs)
        (binary_logloss(model(*sub), targets[part]) * (part.stop - part.start) / 40).backward()
    tables.settle()
    binary_logloss(full(*inputs), targets).backward()
    for spec, (i, values) in zip(layout.tables, tables.gradients()):
        assert torch.allclose(values, dense_grad(named[spec.name])[i], atol=1e-7)


def test_local_steps_on_a_windows_rows_are_the_whole_models_sgd_steps():
    """--local-steps: 3 batches trained on the rows of their window (the union of their
    ids), each step ``rows -= lr * grad``, push as pseudo-gradient exactly what 3 SGD steps
    of the whole model move those rows by, bit for bit, and no other row; a row the window
    pulled whose steps moved it not at all is not pushed."""
    lr, full = 0.5, DLRM(ROWS)
    model = copy.deepcopy(full)
    batches = [ctr_batch(n=16, seed=s) for s in (1, 2, 3)]
    layout = Layout.of(model, embedding_tables(model))
    tables = BatchTables(model, layout)
    window = tuple(torch.cat(parts) for parts in zip(*(inputs for inputs, _ in batches)))
    ids = tables.ids_of(window)
    named = dict(full.named_parameters())
    start = {n: p.detach().clone() for n, p in named.items()}
    local = LocalRows(ids, [start[s.name][i] for s, i in zip(layout.tables, ids)],
                      torch.device("cpu"))
    served = {spec.name for spec in layout.tables}
    dense = {n: p for n, p in model.named_parameters() if n not in served}
    for inputs, targets in batches:
        tables.begin(local.ids, local.rows, torch.device("cpu"))
        for p in dense.values():
            p.grad = None
        ours = binary_logloss(model(*inputs), targets)
        ours.backward()
        tables.settle()
        local.step(tables, lr)
        with torch.no_grad():
            for p in dense.values():
                p.sub_(p.grad, alpha=lr)
        for p in full.parameters():
            p.grad = None
        want = binary_logloss(full(*inputs), targets)
        want.backward()
        assert ours.item() == want.item()  # each step sees the whole model's rows
        with torch.no_grad():
            for p in full.parameters():
                p.sub_(dense_grad(p), alpha=lr)
    pushed = local.pseudo_gradients()
    for spec, window_ids, (got_ids, values) in zip(layout.tables, ids, pushed):
        moved = start[spec.name] - named[spec.name].detach()
        assert torch.equal(values, moved[got_ids]), spec.name
        rest = torch.ones(spec.rows, dtype=torch.bool)
        rest[got_ids] = False
        assert not bool(moved[rest].any()), f"{spec.name}: a row left out of the push moved"
        assert set(got_ids.tolist()) <= set(window_ids.tolist())
    # some rows of the window are pushed only once though several batches looked them up
    assert sum(len(i) for i, _ in pushed) < sum(len(tables.ids_of(inputs)[t])
                                                for inputs, _ in batches
                                                for t in range(len(layout.tables)))


def test_a_windows_row_that_did_not_move_is_not_pushed():
    model = nn.Embedding(10, 2, sparse=True)
    layout = Layout.of(model, embedding_tables(model))
    tables = BatchTables(model, layout)
    local = LocalRows([torch.tensor([1, 4, 7])], [torch.ones(3, 2)], torch.device("cpu"))
    tables.begin(local.ids, local.rows, torch.device("cpu"))
    model(torch.tensor([4, 4])).sum().backward()
    tables.settle()
    local.step(tables, 0.25)
    (ids, values), = local.pseudo_gradients()
    assert ids.tolist() == [4] and values.tolist() == [[0.5, 0.5]]


def test_functional_lookups_are_not_tables_the_worker_can_serve():
    # a table used through F.embedding directly never reaches a module's hook
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(10, 4))

        def forward(self, ids):
            return F.embedding(ids, self.table).sum()

    model = Raw()
    with pytest.raises(ConfigError, match="not the weight of an nn.Embedding"):
        BatchTables(model, Layout.of(model, ["table"]))


# -- the worker's settings ------------------------------------------------------------

@pytest.mark.parametrize("given,words", [
    (dict(local_steps="4", inner_optimizer="adamw"), "plain SGD.*given adamw, 0.0"),
    (dict(local_steps="4", inner_weight_decay=0.1), "plain SGD.*given sgd, 0.1"),
    (dict(push_every=2), "--push-every sums gradients"),
    (dict(transport="shared"), "--transport shared"),
])
def test_a_worker_refuses_in_one_line_what_tables_served_by_row_cannot_do(given, words):
    from asyncsgd.config import WorkerConfig, make_config
    from asyncsgd.workers.worker import run_worker

    cfg = make_config(WorkerConfig, None, dict(task="ctr:rows=100", samples=200,
                                               server_timeout=1, **given))
    with pytest.raises(ConfigError, match=words) as info:
        run_worker(cfg)
    assert "\n" not in str(info.value) and "--embeddings dense" in str(info.value)


def test_jobs_hand_the_table_settings_to_their_roles():
    import dataclasses

    from asyncsgd.config import JobConfig, RayJobConfig, ServerConfig, make_config
    from asyncsgd.jobs.roles import server_settings, worker_settings

    # the server's table knobs (those it has: --id-space, --evict, --table-optimizer once
    # they exist) reach a job's server; --embeddings reaches the server and every worker
    server = {f.name for f in dataclasses.fields(ServerConfig)}
    knobs = server & {"embeddings", "id_space", "evict", "table_optimizer"}
    for kind in (JobConfig, RayJobConfig):
        assert knobs <= {f.name for f in dataclasses.fields(kind)}, kind.__name__
        job = make_config(kind, None, dict(embeddings="dense"))
        assert server_settings(job, 2).embeddings == "dense"
        assert worker_settings(job, "tcp://127.0.0.1:1", 0, 2).embeddings == "dense"


def test_a_table_a_batch_does_not_touch_pushes_nothing():
    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Embedding(10, 3), nn.Embedding(10, 3, sparse=True)

        def forward(self, ids):
            return self.a(ids).sum() + self.b(ids[:0]).sum()

    model = Sometimes()
    layout = Layout.of(model, embedding_tables(model))
    tables = BatchTables(model, layout)
    ids = tables.ids_of((torch.tensor([3, 1, 3]),))
    assert ids[0].tolist() == [1, 3] and ids[1].tolist() == []
    tables.begin(ids, [torch.ones(2, 3), torch.ones(0, 3)], torch.device("cpu"))
    model(torch.tensor([3, 1, 3])).backward()
    tables.settle()
    (ids_a, grad_a), (ids_b, grad_b) = tables.gradients()
    assert ids_a.tolist() == [1, 3] and grad_a.tolist() == [[1.0] * 3, [2.0] * 3]
    assert ids_b.numel() == 0 and grad_b.shape == (0, 3)


def test_unique_per_table_equals_torch_unique_of_each_table():
    """One sort of every table's ids gives each table's own sorted unique ids: the same id in
    two tables stays in both, empty tables stay empty, any int64 (hashed ids) sorts right."""
    g = torch.Generator().manual_seed(3)
    for trial in range(50):
        tables = int(torch.randint(1, 6, (1,), generator=g))
        ids = [torch.randint(-2**62, 2**62, (int(torch.randint(0, 40, (1,), generator=g)),),
                             generator=g) % (7 if trial % 2 else 2**62) for _ in range(tables)]
        got = unique_per_table(ids)
        assert len(got) == tables
        for mine, want in zip(got, (torch.unique(t, sorted=True) for t in ids)):
            assert torch.equal(mine, want)
