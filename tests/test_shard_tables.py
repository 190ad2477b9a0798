"""A shard's row-sparse tables (servers/shard.py with servers/shard_tables.py), as plain objects:
no sockets, no processes. Every message goes through encode/decode first, as on the wire.

Oracles: the whole table trained densely (torch.optim.SGD, TorchRec's rowwise adagrad written
densely) with zero gradients on the rows a push does not name; the shard's rows must equal
their part of it bit for bit, and its other rows stay bit-identical.
"""

import io

import pytest
import torch

from asyncsgd.core.sparse_ids import hash_id, seeded_rows
from asyncsgd.errors import ConfigError
from asyncsgd.servers.rules import RULES, make_rule
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.servers.sparse_rules import make_sparse_rule
from asyncsgd.servers.sparse_table import RowsRefused, SparseTable
from asyncsgd.wire.layout import TableSpec
from asyncsgd.wire.protocol import (ACK, ERROR, PARAMS, PULL, PUSH, Message, ProtocolError,
                                    Rows, Segment, decode, encode, in_parts)
from asyncsgd.wire.sparse import ids_segment, rows_segment
from test_sparse_tables import RowwiseAdagradReference

SHARD, SHARDS, LR, DENSE = 1, 3, 0.5, 6
SPECS = [TableSpec("emb.0.weight", 20, 4), TableSpec("emb.1.weight", 9, 2)]


def full_table(t):
    """The whole of table ``t`` as a model would start it (seeded per id, like a worker)."""
    spec = SPECS[t]
    return seeded_rows(torch.arange(spec.rows, dtype=torch.int64), spec.dim, 7 + t, 0.5)


def state(mode="async", workers=1, rule="sgd", dense_rule="sgd", **kw):
    cfg = ShardConfig(index=SHARD, start=0, end=DENSE, rule=dense_rule, lr=LR,
                      consistency=mode, expected_workers=workers, heartbeat_timeout=5.0, **kw)
    tables = [SparseTable(spec.dim, make_sparse_rule(rule, spec.dim, LR), shard=SHARD,
                          shards=SHARDS, rows=spec.rows, init=full_table(t)[SHARD::SHARDS])
              for t, spec in enumerate(SPECS)]
    return ShardState(cfg, torch.arange(DENSE, dtype=torch.float32), tables=tables,
                      table_specs=SPECS, shards=SHARDS)


def wire(msg):
    """``msg`` as a shard receives it: encoded, then decoded from the frames' bytes."""
    return decode([bytes(f) for f in encode(msg)])


def push(seq, rows=(), dense=None, worker="w", clock=0, pull=False, ids=(), shard=SHARD,
         **meta):
    """A push of ``rows`` [(table, ids, grads)], an optional dense gradient and, when it
    pulls, ``ids`` [(table, ids)] asked back."""
    segments = [] if dense is None else [Segment(0, torch.as_tensor(dense, dtype=torch.float32))]
    segments += [rows_segment(t, torch.as_tensor(i, dtype=torch.int64), g) for t, i, g in rows]
    segments += [ids_segment(t, torch.as_tensor(i, dtype=torch.int64)) for t, i in ids]
    if pull:
        meta["pull"] = True
    return Message(type=PUSH, worker=worker, incarnation=1, seq=seq, clock=clock, shard=shard,
                   meta=meta, segments=segments)


def pull(seq, ids, worker="w", **meta):
    return Message(type=PULL, worker=worker, incarnation=1, seq=seq, meta=meta,
                   segments=[ids_segment(t, torch.as_tensor(i, dtype=torch.int64))
                             for t, i in ids])


def handle(shard, msg, now=0.0, peer=b"p"):
    return [reply for _, reply in shard.handle(peer, wire(msg), now)]


def everything(shard):
    """What a refused message must leave as it was: dense values, the tables' whole state
    (rows, rule state, counts), version and updates, through torch.save as a checkpoint."""
    buf = io.BytesIO()
    torch.save({"params": shard.params.clone(), "sparse": shard.tables.state_dict(),
                "version": shard.version, "updates": shard.counters["updates"]}, buf)
    return buf.getvalue()


def mine(t):
    """The ids of table ``t`` shard SHARD holds."""
    return torch.arange(SHARD, SPECS[t].rows, SHARDS, dtype=torch.int64)


def oracle(rule, p):
    if rule == "sgd":
        return torch.optim.SGD([p], lr=LR, foreach=False)
    return RowwiseAdagradReference(p, LR)


# ---- exact oracles -------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
def test_row_sparse_pushes_equal_the_dense_oracle_on_the_touched_rows(rule):
    shard = state(rule=rule)
    gen = torch.Generator().manual_seed(3)
    refs = [torch.nn.Parameter(full_table(t)) for t in range(len(SPECS))]
    opts = [oracle(rule, p) for p in refs]
    dense = torch.arange(DENSE, dtype=torch.float32)
    never = {0: int(mine(0)[-1]), 1: int(mine(1)[-1])}  # no push names these
    for seq in range(1, 16):
        rows = []
        for t in range(len(SPECS)):
            ids = mine(t)[:-1][torch.randperm(len(mine(t)) - 1, generator=gen)[:3]]
            grads = torch.randn(len(ids), SPECS[t].dim, generator=gen)
            rows.append((t, ids, grads))
            refs[t].grad = torch.zeros_like(refs[t])
            refs[t].grad[ids] = grads
            opts[t].step()
        g = torch.randn(DENSE, generator=gen) if seq % 3 else None  # some pushes rows alone
        if g is not None:
            dense -= LR * g
        (ack,) = handle(shard, push(seq, rows, g, clock=shard.version))
        assert ack.type == ACK and ack.meta["applied"], ack.meta
    for t in range(len(SPECS)):
        assert torch.equal(shard.tables.tables[t].weight, refs[t].detach()[SHARD::SHARDS])
        start = full_table(t)[never[t]]
        assert torch.equal(shard.tables.tables[t].weight[never[t] // SHARDS], start)
    assert torch.allclose(shard.params, dense, atol=1e-6)
    assert shard.version == 15 and shard.rule.steps == 10  # rows alone: no dense step


def test_table_lr_moves_the_rows_at_its_own_rate_and_the_dense_slice_at_lr():
    """--table-lr 0.05 beside --lr 0.5: a row moves by 0.05 g, the dense slice by 0.5 g."""
    shard = state(table_lr=0.05)
    ids, g_rows, g_dense = mine(0)[:2], torch.ones(2, SPECS[0].dim), torch.ones(DENSE)
    before = shard.tables.tables[0].weight[ids // SHARDS].clone()
    (ack,) = handle(shard, push(1, [(0, ids, g_rows)], g_dense))
    assert ack.meta["applied"], ack.meta
    assert torch.equal(shard.tables.tables[0].weight[ids // SHARDS],
                       before - torch.tensor(0.05, dtype=torch.float32) * g_rows)
    assert torch.equal(shard.params, torch.arange(DENSE, dtype=torch.float32) - LR * g_dense)


def test_a_sparse_pull_returns_exactly_the_rows_asked_and_the_dense_slice():
    shard = state()
    asked = [(1, [7, 1, 4]), (0, [19, 10]), (0, [1])]
    (reply,) = handle(shard, pull(1, asked))
    reply = wire(reply)
    dense = [s for s in reply.segments if type(s.data) is not Rows]
    rows = [s for s in reply.segments if type(s.data) is Rows]
    assert torch.equal(torch.cat([s.data for s in dense]), torch.arange(DENSE).float())
    assert reply.segments[:len(dense)] == dense  # the dense slice first
    assert [(s.data.table, s.data.ids.tolist()) for s in rows] == asked
    for seg, (t, ids) in zip(rows, asked):
        assert torch.equal(seg.data.values, full_table(t)[ids])
    (half,) = handle(shard, pull(2, asked[:1], pull_dtype="bfloat16"))
    (seg,) = [s for s in wire(half).segments if type(s.data) is Rows]
    assert seg.data.dtype == "bfloat16"
    assert torch.equal(seg.data.values, full_table(1)[[7, 1, 4]].bfloat16())
    assert shard.tables.pulled == 9 and shard.counters["updates"] == 0


def test_a_push_that_pulls_gets_back_the_rows_it_asks_after_its_update():
    shard = state()
    grads = torch.ones(2, 4)
    (reply,) = handle(shard, push(1, [(0, [1, 4], grads)], torch.ones(DENSE), pull=True,
                                  ids=[(0, [4, 7]), (1, [1])]))
    assert reply.type == PARAMS and reply.meta["ack"]["applied"]
    rows = [s.data for s in wire(reply).segments if type(s.data) is Rows]
    assert [r.ids.tolist() for r in rows] == [[4, 7], [1]]
    assert torch.equal(rows[0].values[0], full_table(0)[4] - LR)  # pushed, then read
    assert torch.equal(rows[0].values[1], full_table(0)[7])
    assert shard.tables.pushed == 2 and shard.tables.pulled == 3


# ---- lies: refused whole, nothing changed ---------------------------------------------------

G4 = torch.ones(2, 4)
LIES = {
    "id out of range": ([(0, [1, 22], G4)], "out-of-range"),
    "another shard's id": ([(0, [1, 3], G4)], "out-of-range"),
    "duplicate ids in a segment": ([(0, [4, 4], G4)], "bad-field"),
    "duplicate ids across segments": ([(0, [4, 7], G4), (0, [1, 4], G4)], "bad-field"),
    "NaN": ([(0, [4, 7], torch.tensor([[1.0, 2, 3, 4], [1, float("nan"), 3, 4]]))],
            "non-finite"),
    "infinity": ([(0, [4, 7], torch.full((2, 4), float("inf")))], "non-finite"),
    "wrong dim": ([(1, [4, 7], G4)], "bad-field"),
    "unknown table": ([(2, [1, 4], G4)], "bad-descriptor"),
    "a negative id": ([(0, [-2, 1], G4)], "out-of-range"),
}


@pytest.mark.parametrize("lie", LIES, ids=list(LIES))
@pytest.mark.parametrize("parts", [False, True], ids=["whole", "in-parts"])
def test_a_lying_rows_segment_is_refused_and_nothing_changes(lie, parts):
    shard = state(rule="rowwise_adagrad")
    handle(shard, push(1, [(0, [1], torch.ones(1, 4))], torch.ones(DENSE)))  # some state
    before = everything(shard)
    rows, code = LIES[lie]
    msg = push(2, rows, torch.ones(DENSE), clock=shard.version)
    replies = [r for m in (in_parts(msg) if parts else [msg]) for r in handle(shard, m)]
    assert [(r.type, r.meta["code"]) for r in replies] == [(ERROR, code)], replies
    assert everything(shard) == before
    # the same push told the truth applies (a refused seq is not concluded)
    (ack,) = handle(shard, push(2, [(0, [4, 7], G4)], torch.ones(DENSE), clock=shard.version))
    assert ack.meta["applied"]


def test_a_length_mismatch_never_reaches_the_shard():
    frames = [bytes(f) for f in encode(push(1, [(0, [1, 4], G4)]))]
    frames[-1] = frames[-1][:-4]
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == "length-mismatch"


@pytest.mark.parametrize("asked, code", [
    ([(0, [1, 1])], "bad-field"), ([(0, [2])], "out-of-range"), ([(3, [1])], "bad-descriptor"),
    ([(0, [1]), (0, [4, 1])], "bad-field")])
def test_lying_ids_are_refused_in_a_pull_and_in_a_push_that_pulls(asked, code):
    shard = state()
    before = everything(shard)
    (reply,) = handle(shard, pull(1, asked))
    assert (reply.type, reply.meta["code"]) == (ERROR, code)
    (reply,) = handle(shard, push(1, [(0, [4], torch.ones(1, 4))], pull=True, ids=asked))
    assert (reply.type, reply.meta["code"]) == (ERROR, code)
    assert everything(shard) == before and shard.tables.pulled == 0


def test_a_push_may_ask_back_the_rows_it_pushes_but_not_twice():
    shard = state()
    (reply,) = handle(shard, push(1, [(0, [4], torch.ones(1, 4))], pull=True, ids=[(0, [4])]))
    assert reply.type == PARAMS
    (reply,) = handle(shard, push(2, [(0, [4], torch.ones(1, 4))], pull=True,
                                  ids=[(0, [4]), (0, [4])]))
    assert reply.meta["code"] == "bad-field"


def test_max_grad_norm_counts_the_rows():
    shard = state(max_grad_norm=5.0)
    before = everything(shard)
    (reply,) = handle(shard, push(1, [(0, [1, 4], torch.full((2, 4), 2.0))], torch.ones(DENSE)))
    assert reply.meta["code"] == "too-large"  # sqrt(6 + 8 x 4) = 6.2; the dense alone 2.4
    assert everything(shard) == before
    (ack,) = handle(shard, push(1, [(0, [1, 4], torch.ones(2, 4))], torch.ones(DENSE)))
    assert ack.meta["applied"]  # sqrt(6 + 8) = 3.7


# ---- consistency, exactly once, checkpoints ------------------------------------------------

def test_sync_applies_rows_at_once_and_the_dense_part_at_the_round():
    shard = state("sync", workers=2)
    assert handle(shard, pull(1, [], worker="a")) == []  # both join
    handle(shard, pull(1, [], worker="b"))
    assert handle(shard, push(1, [(0, [4], torch.ones(1, 4))], torch.ones(DENSE),
                              worker="a")) == []  # waits for its round
    assert torch.equal(shard.tables.tables[0].weight[1], full_table(0)[4] - LR)
    assert torch.equal(shard.params, torch.arange(DENSE).float()) and shard.version == 0
    # a re-sent push waiting in the round applies nothing again
    assert handle(shard, push(1, [(0, [4], torch.ones(1, 4))], torch.ones(DENSE),
                              worker="a")) == []
    acks = handle(shard, push(1, [(0, [7], torch.ones(1, 4))], 3 * torch.ones(DENSE),
                              worker="b"))
    assert [(r.type, r.meta["applied"]) for r in acks] == [(ACK, True), (ACK, True)]
    assert torch.equal(shard.params, torch.arange(DENSE).float() - LR * 2)  # the mean
    assert torch.equal(shard.tables.tables[0].weight[1], full_table(0)[4] - LR)
    assert torch.equal(shard.tables.tables[0].weight[2], full_table(0)[7] - LR)
    # a push computed on round 0, now at 1, is stale: nothing applied, rows included
    before = everything(shard)
    (stale,) = handle(shard, push(2, [(0, [4], torch.ones(1, 4))], torch.ones(DENSE),
                                  worker="a", clock=0))
    assert stale.meta["stale"] and everything(shard) == before


def test_a_duplicate_push_with_rows_applies_nothing():
    shard = state(rule="rowwise_adagrad")
    handle(shard, push(1, [(0, [1, 4], G4)], torch.ones(DENSE)))
    before = everything(shard)
    (again,) = handle(shard, push(1, [(0, [1, 4], G4)], torch.ones(DENSE)))
    assert again.meta == {"applied": False, "duplicate": True}
    assert everything(shard) == before


def checkpoint(shard):
    buf = io.BytesIO()
    torch.save(shard.state_dict(), buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad", "lazy_adam"])
def test_state_dict_round_trip_continues_exactly(rule):
    a = state(rule=rule, dense_rule="adam")
    for seq in range(1, 4):
        handle(a, push(seq, [(0, [1, 4 + 3 * seq], G4 * seq)], torch.ones(DENSE) * seq,
                       clock=a.version))
    b = state(rule=rule, dense_rule="adam")
    b.load_state_dict(checkpoint(a))
    assert everything(b) == everything(a)
    for shard in (a, b):
        handle(shard, push(4, [(0, [1, 4], G4), (1, [7], torch.ones(1, 2))], torch.ones(DENSE),
                           clock=shard.version))
        handle(shard, push(3, [(0, [1], torch.ones(1, 4))]))  # a duplicate after the restart
    assert everything(b) == everything(a)
    assert b.stats(0.0)["tables"]["emb.0.weight"]["rows"] == len(mine(0))


def test_a_checkpoint_without_tables_does_not_load_into_a_shard_with_them():
    plain = ShardState(ShardConfig(index=SHARD, start=0, end=DENSE), torch.zeros(DENSE))
    with pytest.raises(ConfigError, match="embeddings"):
        state().load_state_dict(checkpoint(plain))
    with pytest.raises(ConfigError, match="embeddings"):
        plain.load_state_dict(checkpoint(state()))


def test_sync_rows_of_a_round_cut_by_a_restart_are_not_applied_twice():
    a = state("sync", workers=2)
    handle(a, pull(1, [], worker="a"))
    handle(a, pull(1, [], worker="b"))
    handle(a, push(1, [(0, [4], torch.ones(1, 4))], torch.ones(DENSE), worker="a"))
    b = state("sync", workers=2)
    b.load_state_dict(checkpoint(a), now=0.0)  # saved mid-round: a's rows are in it
    for shard in (a, b):
        handle(shard, push(1, [(0, [4], torch.ones(1, 4))], torch.ones(DENSE), worker="a"))
        handle(shard, push(1, [(0, [7], torch.ones(1, 4))], 3 * torch.ones(DENSE), worker="b"))
    assert everything(b) == everything(a) and b.version == 1
    assert torch.equal(b.tables.tables[0].weight[1], full_table(0)[4] - LR)


# ---- hashed id spaces ----------------------------------------------------------------------

def hashed(evict=("none", 0)):
    cfg = ShardConfig(index=0, start=0, end=DENSE, lr=LR)
    table = SparseTable(4, make_sparse_rule("sgd", 4, LR), shard=0, shards=2,
                        id_space="hashed", evict=evict, seed=3, init_scale=0.5)
    return ShardState(cfg, torch.zeros(DENSE), tables=[table],
                      table_specs=[TableSpec("emb", 0, 4)], shards=2, hash_ids=hash_id)


def hashed_ids(count, shard=0, start=10 ** 12):
    ids = torch.arange(start, start + 8 * count, dtype=torch.int64)
    return ids[torch.remainder(hash_id(ids), 2) == shard][:count]


def test_an_observer_pull_creates_no_row_and_a_worker_pull_does():
    shard = hashed()
    ids = hashed_ids(3)
    observer = Message(type=PULL, worker="", seq=1, meta={"observer": True},
                       segments=[ids_segment(0, ids)])
    (reply,) = handle(shard, observer)
    (rows,) = [s.data for s in reply.segments if type(s.data) is Rows]
    assert torch.equal(rows.values, seeded_rows(ids, 4, 3, 0.5))
    assert len(shard.tables.tables[0]) == 0
    (reply,) = handle(shard, pull(1, [(0, ids)]))
    assert len(shard.tables.tables[0]) == 3
    (stray,) = handle(shard, pull(2, [(0, hashed_ids(1, shard=1))]))
    assert stray.meta["code"] == "out-of-range"


def test_ttl_expires_rows_from_the_tick_and_stats_count_them():
    shard = hashed(evict=("ttl", 5.0))
    handle(shard, push(1, [(0, hashed_ids(4), torch.ones(4, 4))], shard=0), now=0.0)
    handle(shard, push(2, [(0, hashed_ids(2, start=5), torch.ones(2, 4))], shard=0), now=4.0)
    shard.tick(7.0)
    stats = shard.stats(7.0)["tables"]["emb"]
    assert (stats["rows"], stats["created"], stats["evictions"]) == (2, 6, 4)
    assert shard.stats(7.0)["rows_pushed"] == 6


def test_lfu_refuses_more_rows_at_once_than_it_holds_before_anything():
    shard = hashed(evict=("lfu", 3))
    before = everything(shard)
    (reply,) = handle(shard, push(1, [(0, hashed_ids(4), torch.ones(4, 4))], torch.ones(DENSE),
                                  shard=0))
    assert reply.meta["code"] == "too-large" and everything(shard) == before


def test_lfu_refuses_more_ids_asked_back_at_once_than_it_holds_before_anything():
    """A push that pulls has its asked ids checked once (``_check_ids``), lfu's bound
    included: more than the table holds is refused before its rows are applied."""
    shard = hashed(evict=("lfu", 3))
    before = everything(shard)
    (reply,) = handle(shard, push(1, [(0, hashed_ids(2), torch.ones(2, 4))], torch.ones(DENSE),
                                  pull=True, ids=[(0, hashed_ids(4, start=7))], shard=0))
    assert reply.meta["code"] == "too-large" and reply.meta["error"].startswith("4 rows of table 0")
    assert everything(shard) == before


# ---- a shard whose dense slice is empty (more shards than dense values) ---------------------

def tables_only(mode="async", workers=1, dense_rule="sgd"):
    """Shard SHARD with the tables of ``state`` and no dense value: a model that is mostly
    tables, on more shards than it has dense values (``Layout.shard_ranges``)."""
    cfg = ShardConfig(index=SHARD, start=DENSE, end=DENSE, rule=dense_rule, lr=LR,
                      consistency=mode, expected_workers=workers, heartbeat_timeout=5.0)
    tables = [SparseTable(spec.dim, make_sparse_rule("sgd", spec.dim, LR), shard=SHARD,
                          shards=SHARDS, rows=spec.rows, init=full_table(t)[SHARD::SHARDS])
              for t, spec in enumerate(SPECS)]
    return ShardState(cfg, torch.zeros(0), tables=tables, table_specs=SPECS, shards=SHARDS)


@pytest.mark.parametrize("dense_rule", RULES)
def test_every_dense_rule_takes_an_empty_slice_and_never_steps(dense_rule):
    rule = make_rule(dense_rule, 0, 0.1)
    params = torch.zeros(0)
    rule.step(params, [])
    again = make_rule(dense_rule, 0, 0.1)
    again.load_state_dict(rule.state_dict())
    with pytest.raises(ValueError, match="size must be an int >= 0"):
        make_rule(dense_rule, -1, 0.1)


@pytest.mark.parametrize("dense_rule", ["sgd", "adam"])
def test_a_shard_with_tables_alone_pulls_pushes_and_refuses_a_dense_segment(dense_rule):
    shard = tables_only(dense_rule=dense_rule)
    (reply,) = handle(shard, pull(1, [(0, [1, 4]), (1, [7])]))
    assert reply.type == PARAMS and all(type(s.data) is Rows for s in reply.segments)
    assert torch.equal(reply.segments[0].data.values, full_table(0)[[1, 4]])
    (ack,) = handle(shard, push(2, [(0, [4], G4[:1]), (1, [7], torch.ones(1, 2))]))
    assert ack.type == ACK and ack.meta["applied"] and shard.version == 1
    assert torch.equal(shard.tables.tables[0].weight[1], full_table(0)[4] - LR * G4[0])
    assert torch.equal(shard.tables.tables[1].weight[2], full_table(1)[7] - LR)
    before = everything(shard)
    (refused,) = handle(shard, push(3, [(0, [1], G4[:1])], torch.ones(1)))
    assert refused.type == ERROR and refused.meta["code"] == "out-of-range"
    assert "outside shard 1 of size 0" in refused.meta["error"]
    assert everything(shard) == before
    again = tables_only(dense_rule=dense_rule)
    again.load_state_dict(checkpoint(shard))
    assert everything(again) == everything(shard)


def test_a_shard_with_tables_alone_closes_its_sync_rounds():
    shard = tables_only("sync", workers=2)
    handle(shard, pull(1, [], worker="a"))
    handle(shard, pull(1, [], worker="b"))
    assert handle(shard, push(1, [(0, [4], G4[:1])], worker="a")) == []  # waits for b
    assert torch.equal(shard.tables.tables[0].weight[1], full_table(0)[4] - LR * G4[0])
    acks = handle(shard, push(1, [(0, [7], G4[:1])], worker="b"))
    assert [(r.type, r.meta["applied"]) for r in acks] == [(ACK, True), (ACK, True)]
    assert shard.version == 1 and shard.params.numel() == 0


def test_the_tables_trust_rows_the_shard_checked_and_direct_callers_are_still_checked(
        monkeypatch):
    """ShardTables.check makes every check; SparseTable.apply and gather, called from
    ShardTables, do not make them again (experiments/sparse_apply.py: 0.30 of 1.11 ms a
    push of 4,096 rows x 16); called directly, they refuse what they always refused."""
    shard = state()
    checks = []
    for table in shard.tables.tables:
        monkeypatch.setattr(table, "_check", lambda *a, **k: checks.append(a))
    handle(shard, push(1, [(0, [1, 4], G4)], torch.ones(DENSE), pull=True, ids=[(1, [7])]))
    handle(shard, pull(2, [(0, [1])]))
    assert checks == [] and shard.version == 1
    table = state().tables.tables[0]
    for ids, grads, match in [([1, 1], G4, "appears twice"), ([2, 4], G4, "belongs to shard"),
                              ([1, 4], G4 * float("nan"), "NaN")]:
        with pytest.raises(RowsRefused, match=match):
            table.apply(torch.tensor(ids), grads)
    with pytest.raises(RowsRefused, match="appears twice"):
        table.gather(torch.tensor([4, 4]))
