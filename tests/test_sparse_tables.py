"""Row-sparse tables of the parameter server (servers/sparse_table.py, sparse_rules.py,
id_map.py, core/sparse_ids.py): plain objects, no processes.

Oracles: published SplitMix64 outputs; torch.optim (SGD, Adagrad, SparseAdam) and TorchRec's
rowwise adagrad written densely, fed zeros on the rows a push does not name.
"""

import io

import pytest
import torch

from asyncsgd.config.values import parse_evict
from asyncsgd.core.sparse_ids import hash_id, seeded_rows, shard_of
from asyncsgd.errors import ConfigError
from asyncsgd.servers.id_map import IdMap
from asyncsgd.servers.sparse_rules import SPARSE_RULES, make_sparse_rule
from asyncsgd.servers.sparse_table import RowsRefused, SparseTable
from asyncsgd.wire.protocol import Code

DIM, ROWS, SHARDS, SHARD, LR = 8, 40, 3, 1, 0.1
LOCAL = (ROWS - SHARD + SHARDS - 1) // SHARDS  # ids 1, 4, ..., 37


def fixed_table(rule="sgd", **kw):
    return SparseTable(DIM, make_sparse_rule(rule, DIM, LR), shard=SHARD, shards=SHARDS,
                       rows=ROWS, seed=5, init_scale=0.5, **kw)


def hashed_table(evict=("none", 0), rule="adagrad", seed=5, shards=1, shard=0):
    return SparseTable(DIM, make_sparse_rule(rule, DIM, LR), shard=shard, shards=shards,
                       id_space="hashed", evict=evict, seed=seed, init_scale=0.5)


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def snapshot(table):
    buf = io.BytesIO()
    torch.save(table.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def same(a, b):
    """Bit-for-bit equality of two state dicts (nested dicts, tensors, plain values)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(torch.uint8) if a.dtype != torch.bool else a,
            b.view(torch.uint8) if b.dtype != torch.bool else b)
    return a == b


# -- ids ------------------------------------------------------------------------

def test_hash_id_is_splitmix64():
    # Vigna's SplitMix64: seed 0 gives 0xE220A8397B1DCDAF; seed 1234567 gives
    # 6457827717110365317 then 3203168211198807973 (the state moves by the golden gamma)
    def u64(x):
        return x & (2 ** 64 - 1)
    assert u64(hash_id(0)) == 0xE220A8397B1DCDAF
    assert u64(hash_id(1234567)) == 6457827717110365317
    assert u64(hash_id(1234567 + 0x9E3779B97F4A7C15 - 2 ** 64)) == 3203168211198807973
    values = ids(0, 1, -1, 42, 1234567, 2 ** 63 - 1, -2 ** 63, 10 ** 12)
    assert hash_id(values).tolist() == [hash_id(v) for v in values.tolist()]
    assert hash_id(values).dtype == torch.int64


def test_shard_of_plain_and_hashed():
    raw = torch.arange(-50, 50, dtype=torch.int64) * 7919
    assert torch.equal(shard_of(raw, 4, False), raw % 4)
    hashed = shard_of(raw, 4, True)
    assert hashed.min() >= 0 and hashed.max() < 4
    assert hashed.tolist() == [shard_of(v, 4, True) for v in raw.tolist()]


def test_seeded_rows_depend_on_id_and_seed_only():
    a = seeded_rows(ids(3, 9, 2 ** 40), DIM, 7, 0.5)
    b = seeded_rows(ids(2 ** 40, 3), DIM, 7, 0.5)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0])
    assert not torch.equal(a[0], seeded_rows(ids(3), DIM, 8, 0.5)[0])
    assert a.dtype == torch.float32 and a.abs().max() <= 0.5 and len(a.unique()) == a.numel()


# -- rules against dense oracles ---------------------------------------------------

class RowwiseAdagradReference:
    """TorchRec's rowwise adagrad on the whole table: one accumulator per row."""

    def __init__(self, p, lr, eps=1e-10):
        self.p, self.lr, self.eps = p, lr, eps
        self.sum = torch.zeros(p.shape[0])

    def step(self):
        g = self.p.grad
        self.sum.add_(g.pow(2).mean(dim=1))
        self.p.data.addcdiv_(g, self.sum.sqrt().add_(self.eps).unsqueeze(1), value=-self.lr)


def reference(rule, p):
    if rule == "sgd":
        return torch.optim.SGD([p], lr=LR, foreach=False)
    if rule == "adagrad":
        return torch.optim.Adagrad([p], lr=LR, foreach=False)
    if rule == "lazy_adam":
        return torch.optim.SparseAdam([p], lr=LR)
    return RowwiseAdagradReference(p, LR)


def pushes(seed, count=12):
    """(ids, grads) pushes of this shard's ids, unique and shuffled, some rows never named."""
    gen = torch.Generator().manual_seed(seed)
    mine = SHARD + SHARDS * torch.arange(LOCAL - 3, dtype=torch.int64)  # the last 3: never
    out = []
    for _ in range(count):
        pick = mine[torch.randperm(mine.numel(), generator=gen)[:5]]
        out.append((pick, torch.randn(pick.numel(), DIM, generator=gen)))
    return out


@pytest.mark.parametrize("rule", SPARSE_RULES)
def test_pushes_equal_the_dense_oracle_and_leave_other_rows_untouched(rule):
    table = fixed_table(rule)
    start = table.weight.clone()
    p = torch.nn.Parameter(start.clone())
    opt = reference(rule, p)
    for step, (pick, grads) in enumerate(pushes(1)):
        table.apply(pick, grads, now=float(step))
        local = pick // SHARDS
        if rule == "lazy_adam":
            p.grad = torch.sparse_coo_tensor(local[None], grads, p.shape,
                                             check_invariants=True)
        else:
            p.grad = torch.zeros_like(p).index_put_((local,), grads)
        opt.step()
        assert torch.equal(table.weight, p.data), f"step {step}"
    assert torch.equal(table.weight[-3:], start[-3:])  # never named: bit-identical
    for state in table.rule.state.values():
        assert not state[-3:].any()


def test_lr_scale_scales_the_step():
    table = fixed_table("sgd")
    table.rule.lr = 1.0
    before = table.gather(ids(4, 7))
    table.apply(ids(4, 7), torch.ones(2, DIM), lr_scale=0.5)  # a stale push, say
    assert torch.equal(table.gather(ids(4, 7)), before - 0.5)


def test_rowwise_adagrad_by_hand():
    table = fixed_table("rowwise_adagrad")
    table.rule.lr = 1.0
    before = table.gather(ids(4))
    table.apply(ids(4), torch.full((1, DIM), 2.0))
    # mean(g * g) = 4, sqrt 2: each element moves by exactly 1 * 2 / 2
    assert torch.equal(table.gather(ids(4)), before - 1.0)
    assert table.rule.state["sum"].tolist()[4 // SHARDS] == 4.0
    assert table.rule.state["sum"].numel() == LOCAL  # one accumulator per row


# -- pulls ---------------------------------------------------------------------

def test_gather_returns_exactly_the_rows_asked_in_order():
    table = fixed_table()
    asked = ids(37, 1, 22, 4)
    got = table.gather(asked)
    assert torch.equal(got, seeded_rows(asked, DIM, 5, 0.5))
    assert torch.equal(got, table.weight[asked // SHARDS])
    got[0] = 0  # a copy: the table is not written through it
    assert torch.equal(table.gather(ids(37)), seeded_rows(ids(37), DIM, 5, 0.5))
    assert table.gather(ids()).shape == (0, DIM)


def test_gather_from_given_initial_rows():
    init = torch.arange(LOCAL * DIM, dtype=torch.float32).view(LOCAL, DIM)
    table = fixed_table(init=init)
    assert torch.equal(table.gather(ids(7, 1)), init[[2, 0]])


# -- refusals --------------------------------------------------------------------

GOOD = torch.ones(2, DIM)
LIES = {
    "out of range": (ids(1, 40), GOOD, Code.OUT_OF_RANGE),
    "negative": (ids(-2, 1), GOOD, Code.OUT_OF_RANGE),
    "another shard's": (ids(1, 3), GOOD, Code.OUT_OF_RANGE),
    "duplicate": (ids(4, 4), GOOD, Code.BAD_FIELD),
    "length mismatch": (ids(1, 4, 7), GOOD, Code.LENGTH_MISMATCH),
    "row width": (ids(1, 4), torch.ones(2, DIM + 1), Code.BAD_FIELD),
    "nan": (ids(1, 4), GOOD.clone().index_put_((torch.tensor(1), torch.tensor(3)),
                                                torch.tensor(float("nan"))), Code.NON_FINITE),
    "inf": (ids(1, 4), GOOD * float("inf"), Code.NON_FINITE),
    "float64": (ids(1, 4), GOOD.double(), Code.BAD_DTYPE),
    "int32 ids": (ids(1, 4).int(), GOOD, Code.BAD_DTYPE),
    "empty": (ids(), torch.ones(0, DIM), Code.BAD_FIELD),
}


@pytest.mark.parametrize("lie", sorted(LIES))
@pytest.mark.parametrize("rule", ["sgd", "rowwise_adagrad"])
def test_a_lying_push_is_refused_with_nothing_changed(lie, rule):
    table = fixed_table(rule)
    table.apply(ids(1, 4), torch.ones(2, DIM))
    before = snapshot(table)
    pick, grads, code = LIES[lie]
    with pytest.raises(RowsRefused) as refused:
        table.apply(pick, grads)
    assert refused.value.code == code
    assert same(snapshot(table), before)


def test_pulls_refuse_duplicates_and_strays_and_create_nothing():
    table = hashed_table()
    table.gather(ids(10, 11))
    before = snapshot(table)
    with pytest.raises(RowsRefused, match="appears twice"):
        table.gather(ids(12, 13, 12))
    other = hashed_table(shards=2, shard=0)
    stray = next(i for i in range(100) if shard_of(i, 2, True) == 1)
    with pytest.raises(RowsRefused, match="belongs to shard 1"):
        other.gather(ids(stray))
    assert same(snapshot(table), before) and len(other) == 0


# -- hashed ids and eviction ----------------------------------------------------------

def test_hashed_rows_start_the_same_on_any_table_with_the_seed():
    a, b = hashed_table(), hashed_table()
    a.gather(ids(-5, 2 ** 50, 77))
    b.gather(ids(3, 4))
    rows = b.gather(ids(77, 2 ** 50, -5))
    assert torch.equal(rows, a.gather(ids(77, 2 ** 50, -5)))
    assert torch.equal(rows, seeded_rows(ids(77, 2 ** 50, -5), DIM, 5, 0.5))
    assert not torch.equal(rows, hashed_table(seed=6).gather(ids(77, 2 ** 50, -5)))


def test_hashed_push_creates_then_updates_like_the_fixed_table():
    table = hashed_table(rule="sgd")
    table.apply(ids(9, 2), torch.ones(2, DIM))
    assert torch.equal(table.gather(ids(2, 9)), seeded_rows(ids(2, 9), DIM, 5, 0.5) - LR)
    assert len(table) == 2 and table.created == 2


def test_lfu_keeps_at_most_its_rows_over_ever_new_ids():
    table = hashed_table(evict=("lfu", 64))
    held = []
    for batch in range(100):
        new = torch.arange(batch * 16, batch * 16 + 16, dtype=torch.int64)
        table.apply(new, torch.ones(16, DIM), now=float(batch))
        assert len(table) <= 64
        held.append(table.nbytes())
    assert len(set(held[4:])) == 1  # flat once full
    assert table.weight.shape[0] == 64
    assert table.evictions == table.created - 64 == 1600 - 64
    # rows, adagrad's sum, and per slot: id, used, last touch, uses, free-stack entry; the
    # id map's buffer, at its least (1,024 entries of 16 bytes)
    assert table.stats() == {"rows": 64, "bytes": 64 * (DIM * 4 + DIM * 4 + 8 + 1 + 8 + 8 + 8)
                             + 1024 * 16, "created": 1600, "evictions": 1536}


def test_lfu_evicts_least_used_then_oldest():
    table = hashed_table(evict=("lfu", 3))
    for now, pick in enumerate([ids(1), ids(1), ids(2), ids(3)]):
        table.gather(pick, now=float(now))
    table.gather(ids(4), now=9.0)  # 2 and 3 were used once: 2 is older
    assert sorted(table.map.items()[0].tolist()) == [1, 3, 4]
    table.gather(ids(5, 1), now=10.0)  # 1 is in the request: 3 goes (used once, oldest)
    assert sorted(table.map.items()[0].tolist()) == [1, 4, 5] and table.evictions == 2
    with pytest.raises(RowsRefused) as refused:
        table.gather(ids(6, 7, 8, 9))
    assert refused.value.code == Code.TOO_LARGE


def test_an_evicted_row_comes_back_fresh():
    table = hashed_table(evict=("lfu", 2), rule="adagrad")
    table.apply(ids(1), torch.ones(1, DIM), now=0.0)
    first = table.gather(ids(1), now=0.0)
    table.gather(ids(2, 3), now=1.0)  # 1 is evicted
    assert 1 not in table.map.items()[0].tolist()
    assert torch.equal(table.gather(ids(1), now=2.0), seeded_rows(ids(1), DIM, 5, 0.5))
    table.apply(ids(1), torch.ones(1, DIM), now=2.0)  # its accumulator restarted too
    assert torch.equal(table.gather(ids(1), now=2.0), first)


def test_ttl_evicts_by_the_clock():
    table = hashed_table(evict=("ttl", 10.0))
    table.gather(ids(1), now=0.0)
    table.gather(ids(2), now=5.0)
    assert table.expire(10.0) == 0  # exactly 10 s old: kept
    assert table.expire(12.0) == 1 and table.map.items()[0].tolist() == [2]
    table.apply(ids(2), torch.ones(1, DIM), now=16.0)  # aged out first, then made afresh
    assert table.evictions == 2 and table.created == 3
    assert torch.equal(table.gather(ids(2), now=16.0), seeded_rows(ids(2), DIM, 5, 0.5) - LR)


def test_slots_are_reused_and_memory_stays_flat_under_ttl():
    table = hashed_table(evict=("ttl", 3.0))
    sizes = []
    for t in range(60):
        table.gather(torch.arange(t * 100, t * 100 + 100, dtype=torch.int64), now=float(t))
        sizes.append(table.nbytes())
    assert len(table) == 400 and len(set(sizes[10:])) == 1


# -- checkpoints ---------------------------------------------------------------------

@pytest.mark.parametrize("rule", SPARSE_RULES)
def test_state_dict_round_trip_is_bit_exact(rule):
    a = hashed_table(evict=("lfu", 20), rule=rule)
    gen = torch.Generator().manual_seed(3)
    steps = [(torch.randperm(50, generator=gen)[:8], torch.randn(8, DIM, generator=gen))
             for _ in range(10)]
    for t, (pick, grads) in enumerate(steps[:5]):
        a.apply(pick, grads, now=float(t))
    b = hashed_table(evict=("lfu", 20), rule=rule)
    b.load_state_dict(snapshot(a))
    assert same(snapshot(b), snapshot(a))
    for t, (pick, grads) in enumerate(steps[5:]):
        a.apply(pick, grads, now=float(t + 5))
        b.apply(pick, grads, now=float(t + 5))
    assert same(snapshot(b), snapshot(a)) and b.evictions == a.evictions > 0


def test_fixed_state_dict_round_trip_and_misfit():
    a = fixed_table("adagrad")
    a.apply(ids(1, 4), torch.ones(2, DIM))
    b = fixed_table("adagrad")
    b.load_state_dict(snapshot(a))
    assert same(snapshot(b), snapshot(a))
    with pytest.raises(ConfigError, match="does not fit"):
        hashed_table().load_state_dict(snapshot(a))


def test_restart_keeps_row_ages():
    a = hashed_table(evict=("ttl", 10.0))
    a.gather(ids(1), now=100.0)
    a.gather(ids(2), now=108.0)
    b = hashed_table(evict=("ttl", 10.0))
    b.load_state_dict(snapshot(a), now=5.0)  # a restarted shard's clock starts anew
    assert b.expire(8.0) == 1 and b.map.items()[0].tolist() == [2]


# -- pieces ---------------------------------------------------------------------------

def test_id_map_against_a_dict():
    gen = torch.Generator().manual_seed(0)
    m, oracle = IdMap(), {}
    for _ in range(30):
        new = torch.unique(torch.randint(-2 ** 62, 2 ** 62, (20,), generator=gen))
        new = new[torch.tensor([int(k) not in oracle for k in new], dtype=torch.bool)]
        slots = torch.randint(0, 1000, (new.numel(),), generator=gen)
        m.insert(new, slots)
        oracle.update(zip(new.tolist(), slots.tolist()))
        gone = torch.tensor(list(oracle)[::3], dtype=torch.int64)
        m.remove(gone)
        for k in gone.tolist():
            del oracle[k]
        probe = torch.cat([torch.tensor(list(oracle), dtype=torch.int64), gone])
        assert m.find(probe).tolist() == [oracle.get(k, -1) for k in probe.tolist()]
    keys, slots = m.items()
    assert keys.tolist() == sorted(oracle) and slots.tolist() == [oracle[k] for k in keys.tolist()]


def test_parse_evict():
    assert parse_evict("none") == ("none", 0)
    assert parse_evict("ttl:1.5") == ("ttl", 1.5)
    assert parse_evict("lfu:1000") == ("lfu", 1000)
    for bad in ("lfu", "lfu:0", "lfu:1.5", "ttl:-1", "ttl:nan", "ttl:inf", "lru:5", "none:1"):
        with pytest.raises(ConfigError, match="--evict"):
            parse_evict(bad)


def test_settings_a_user_gets_wrong():
    with pytest.raises(ConfigError, match="needs --id-space hashed"):
        fixed_table(evict=("lfu", 5))
    with pytest.raises(ConfigError, match="--id-space"):
        SparseTable(DIM, make_sparse_rule("sgd", DIM, LR), id_space="dense")
    with pytest.raises(ValueError, match="dim must be"):
        make_sparse_rule("sgd", 0, LR)
    with pytest.raises(ValueError, match="valid rules"):
        make_sparse_rule("adam", DIM, LR)


def test_fixed_init_made_in_chunks_equals_one_piece(monkeypatch):
    monkeypatch.setattr("asyncsgd.servers.sparse_table._INIT_CHUNK", 5)
    mine = SHARD + SHARDS * torch.arange(LOCAL, dtype=torch.int64)
    assert torch.equal(fixed_table().weight, seeded_rows(mine, DIM, 5, 0.5))


@pytest.mark.parametrize("rule", ["adagrad", "rowwise_adagrad"])
def test_ttl_shrinks_after_a_burst_and_keeps_what_it_holds(rule):
    table = hashed_table(evict=("ttl", 5.0), rule=rule)
    table.apply(torch.arange(5000, dtype=torch.int64), torch.ones(5000, DIM), now=0.0)
    table.apply(ids(7, 10 ** 9), torch.full((2, DIM), 3.0), now=4.0)
    rows, state = table.gather(ids(10 ** 9, 7), now=4.0), table.rule.state["sum"][
        table.map.find(ids(10 ** 9, 7))]
    peak = table.nbytes()
    assert table.expire(6.0) == 4999 and len(table) == 2
    assert table.weight.shape[0] == 1024 and table.nbytes() < peak / 4
    assert torch.equal(table.rule.state["sum"][table.map.find(ids(10 ** 9, 7))], state)
    assert torch.equal(table.gather(ids(10 ** 9, 7), now=6.0), rows)
    assert table.map.find(ids(7, 10 ** 9)).tolist() == [0, 1]
