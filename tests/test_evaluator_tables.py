"""The server's evaluator reads tables served by row (servers/evaluator_tables.py), as plain
objects: in a hashed id space the test split may look up raw int64 ids beyond the model's
rows; their rows are held apart and the model's forward looks them up there, exactly, while
the model's own tables stay whole for the saved model."""

import pytest
import torch
import torch.nn as nn

from asyncsgd.core.sparse_ids import hash_id
from asyncsgd.core.tasks import Split
from asyncsgd.errors import ConfigError
from asyncsgd.servers.evaluator_tables import TableRows, touched_ids
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.sparse import rows_segment

ROWS, DIM, SHARDS = 10, 4, 2
RAW = torch.tensor([[3, 10 ** 15], [-7, 3], [2 ** 62, 5]])  # any int64, some beyond ROWS


class Lookup(nn.Module):
    """An Embedding and an EmbeddingBag (two tables) over the same ids, and a dense scale."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids):
        return self.scale * (self.emb(ids).sum(1) + self.bag(ids)).sum(1)


def setup():
    model = Lookup()
    layout = Layout.of(model, ["emb.weight", "bag.weight"])
    split = Split((RAW,), torch.zeros(len(RAW)))
    return model, layout, split


def row_of(t, ids):
    """The rows a shard would answer: a value made from the table and the raw id."""
    return (ids.double().remainder(1000).float()[:, None] + 1000 * t +
            torch.arange(DIM, dtype=torch.float32))


def answer(rows):
    """Each pull of ``rows`` answered as a shard does (the rows of its ids, in order)."""
    for shard in range(SHARDS):
        for asked in rows.pulls[shard]:
            got = [rows_segment(s.data.table, s.data.ids, row_of(s.data.table, s.data.ids))
                   for s in asked]
            assert rows.take(asked, got) == ""


def test_raw_ids_beyond_the_rows_are_found_and_the_forward_runs():
    model, layout, split = setup()
    ids = touched_ids(model, layout, split)  # the forward over raw ids does not fail
    assert [i.tolist() for i in ids] == [sorted(set(RAW.flatten().tolist()))] * 2


def test_a_hashed_id_space_remaps_raw_ids_into_the_rows_pulled_exactly():
    model, layout, split = setup()
    whole = [model.emb.weight.detach().clone(), model.bag.weight.detach().clone()]
    rows = TableRows(model, layout, touched_ids(model, layout, split), SHARDS, hash_id)
    assert rows.remapped
    asked = {(s.data.table, i) for shard in rows.pulls for msg in shard for s in msg
             for i in s.data.ids.tolist()}
    assert asked == {(t, i) for t in (0, 1) for i in RAW.flatten().tolist()}
    for shard, pulls in enumerate(rows.pulls):  # each shard is asked only its own ids
        for s in (s for msg in pulls for s in msg):
            assert bool((torch.remainder(hash_id(s.data.ids), SHARDS) == shard).all())
    answer(rows)
    with torch.no_grad():
        out = model(RAW)
    want = torch.stack([(row_of(0, r).sum(0) + row_of(1, r).sum(0)).sum() for r in RAW])
    assert torch.equal(out, want)
    # the model's own tables are back in place, untouched, for the saved model
    assert model.emb.weight is rows.weights[0] and model.bag.weight is rows.weights[1]
    assert torch.equal(model.emb.weight, whole[0]) and torch.equal(model.bag.weight, whole[1])
    with pytest.raises(RuntimeError, match="id 4, which the test split's rows do not hold"):
        model(torch.tensor([[3, 4]]))
    rows.close()
    assert torch.equal(model(torch.tensor([[3, 4]])), model(torch.tensor([[4, 3]])))


def test_ids_within_the_rows_fill_the_models_tables_as_before():
    model, layout, _ = setup()
    ids = [torch.tensor([1, 3, 9])] * 2
    rows = TableRows(model, layout, ids, SHARDS, hash_id)
    assert not rows.remapped
    answer(rows)
    assert torch.equal(model.emb.weight[[1, 3, 9]], row_of(0, ids[0]))
    assert torch.equal(model.bag.weight[[1, 3, 9]], row_of(1, ids[1]))


def test_a_fixed_id_space_refuses_raw_ids_naming_the_fix():
    model, layout, split = setup()
    with pytest.raises(ConfigError, match="use --id-space hashed for raw ids"):
        TableRows(model, layout, touched_ids(model, layout, split), SHARDS)
