"""The hashed id space's structures against exact oracles (servers/id_map.py and the slots,
ttl queue and free stack of servers/sparse_table.py): plain objects, no processes.

Oracles: a Python dict of id -> slot for the map; for a table, a dict of id -> (row, last
touch) that applies sgd by hand and ages rows out by ttl's rule, or, under lfu, drops the
rows the table chose after checking that choice is a least-used one.
"""

import io
import math
import random

import pytest
import torch

from asyncsgd.core.sparse_ids import seeded_rows
from asyncsgd.errors import ConfigError
from asyncsgd.servers import id_map
from asyncsgd.servers.id_map import IdMap
from asyncsgd.servers.sparse_rules import make_sparse_rule
from asyncsgd.servers.sparse_table import SparseTable

DIM, LR, SEED, SCALE = 4, 0.5, 7, 0.5
SLOTS = 1 << 20


def table(evict=("none", 0)):
    return SparseTable(DIM, make_sparse_rule("sgd", DIM, LR), id_space="hashed", evict=evict,
                       seed=SEED, init_scale=SCALE)


def tensor(values):
    return torch.tensor(list(values), dtype=torch.int64)


def restored(t, evict, now=None):
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)
    buf.seek(0)
    fresh = table(evict)
    fresh.load_state_dict(torch.load(buf, weights_only=True), now)
    return fresh


def check_map(m, oracle):
    keys, slots = m.items()
    assert keys.tolist() == sorted(oracle)
    assert slots.tolist() == [oracle[k] for k in keys.tolist()]
    assert len(m) == len(oracle)


@pytest.mark.parametrize("seed", range(4))
def test_id_map_against_a_dict_across_merges(seed):
    """Batches from 1 id to 3,000 (so runs cascade into merges of every size), removals of
    up to a third (tombstones, then full merges), remaps and a rebuild from items."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    m, oracle, most_runs = IdMap(), {}, 0
    for step in range(400):
        kind = rng.random()
        if kind < 0.55:
            size = rng.choice([1, 2, 7, 60, 500, 3000])
            low, high = rng.choice([(-2 ** 62, 2 ** 62), (0, 5000)])
            new = torch.unique(torch.randint(low, high, (size,), generator=gen))
            new = new[torch.tensor([k not in oracle for k in new.tolist()], dtype=torch.bool)]
            new = new[torch.randperm(new.numel(), generator=gen)]  # unsorted, as pushes are
            slots = torch.randint(0, SLOTS, (new.numel(),), generator=gen)
            m.insert(new, slots)
            oracle.update(zip(new.tolist(), slots.tolist()))
        elif kind < 0.9 and oracle:
            keys = list(oracle)
            gone = rng.sample(keys, rng.randint(1, max(1, len(keys) // 3)))
            m.remove(tensor(gone))
            for k in gone:
                del oracle[k]
        elif kind < 0.95:
            moved = torch.randperm(SLOTS, generator=gen)
            oracle = {k: int(moved[s]) for k, s in oracle.items()}
            m.remap(moved)
        else:
            m = IdMap(*m.items())
        most_runs = max(most_runs, len(m._ends))
        probe = list(oracle)[-300:] + [rng.randint(-10, 5010) for _ in range(50)] + \
            [rng.randint(-2 ** 63, 2 ** 63 - 1) for _ in range(5)]
        assert m.find(tensor(probe)).tolist() == [oracle.get(k, -1) for k in probe], step
        # tombstones at most half the live ids, plus the batch removed last
        assert m.dead <= max(len(oracle) // 2, 0) + 3000
        entries = m._ends[-1] if m._ends else 0
        assert entries == len(m) + m.dead
    check_map(m, oracle)
    assert most_runs >= 3  # the cascade was exercised



class TableOracle:
    """A hashed table as a dict: id -> [row, uses, last touch]; sgd by hand."""

    def __init__(self, ttl=None):
        self.ttl, self.rows, self.created, self.evictions = ttl, {}, 0, 0

    def expire(self, now):
        if self.ttl is None:
            return 0
        stale = [k for k, (_, _, touched) in self.rows.items() if now - touched > self.ttl]
        self.drop(stale)
        return len(stale)

    def drop(self, gone):
        for k in gone:
            del self.rows[k]
        self.evictions += len(gone)

    def touch(self, ids, now, grads=None):
        self.expire(now)
        new = [k for k in ids if k not in self.rows]
        for k, row in zip(new, seeded_rows(tensor(new), DIM, SEED, SCALE) if new else []):
            self.rows[k] = [row, 0, now]
        self.created += len(new)
        for i, k in enumerate(ids):
            row = self.rows[k]
            if grads is not None:
                row[0] = row[0].clone().sub_(grads[i], alpha=LR)
            row[1] += 1
            row[2] = now

    def shift(self, by):
        for row in self.rows.values():
            row[2] += by


def check_table(t, oracle, some=None):
    """The table holds the oracle's ids; their rows and uses (of ``some`` ids, else of all)
    equal the oracle's; every slot is held or free, once."""
    keys, _ = t.map.items()
    assert keys.tolist() == sorted(oracle.rows)
    assert (len(t), t.created, t.evictions) == (len(oracle.rows), oracle.created,
                                                oracle.evictions)
    some = list(oracle.rows) if some is None else [k for k in some if k in oracle.rows]
    if some:
        ids = tensor(some)
        assert torch.equal(t.peek(ids), torch.stack([oracle.rows[k][0] for k in some]))
        assert torch.equal(t.uses[t.map.find(ids)], tensor(oracle.rows[k][1] for k in some))
    # every slot is held or on the free stack, once
    free = t.free[:t.free_count]
    assert sorted(free.tolist() + t.map.items()[1].tolist()) == list(range(t.weight.shape[0]))
    assert not bool(t.used[free].any())


def random_ids(rng, pool, most):
    return rng.sample(range(pool), rng.randint(1, min(most, pool)))


@pytest.mark.parametrize("seed", range(3))
def test_ttl_table_against_the_oracle(seed):
    """Pushes and pulls at a clock that mostly moves on (sometimes back, sometimes not at
    all), ticks, bursts that make the table shrink, and checkpoints (ages kept or shifted)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    evict = ("ttl", 5.0)
    t, oracle, now = table(evict), TableOracle(5.0), 100.0
    for step in range(300):
        now += rng.choice([0.0, 0.0, 0.25, 1.0, 2.5, 5.0, 6.0, -0.5])
        kind = rng.random()
        ids = random_ids(rng, rng.choice([50, 3000]), rng.choice([5, 80]))
        if kind < 0.03:  # a burst of new ids, aged out together later
            ids = list(range(10 ** 6 + step * 4000, 10 ** 6 + step * 4000 + 3000))
        if kind < 0.45:
            grads = torch.randn(len(ids), DIM, generator=gen)
            t.apply(tensor(ids), grads, now=now)
            oracle.touch(ids, now, grads)
        elif kind < 0.85:
            assert torch.equal(t.gather(tensor(ids), now=now),
                               _rows_after(oracle, ids, now))
        elif kind < 0.95:
            assert t.expire(now) == oracle.expire(now)
        elif kind < 0.975:
            t = restored(t, evict)
        else:  # a restart: the shard's clock starts anew, each row as old as it was
            start = rng.uniform(0.0, 50.0)
            oracle.shift(start - t.clock)
            t, now = restored(t, evict, now=start), start
        check_table(t, oracle, None if step % 25 == 0 else ids)
    assert t.evictions > 1000 and t.weight.shape[0] < 4096 * 4


def _rows_after(oracle, ids, now):
    oracle.touch(ids, now)
    return torch.stack([oracle.rows[k][0] for k in ids])


@pytest.mark.parametrize("seed", range(3))
def test_lfu_table_against_the_oracle(seed):
    """Each eviction takes rows outside the request, least used then oldest (checked on the
    oracle's counts); the rows kept then hold exactly the oracle's values."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cap = 100
    evict = ("lfu", cap)
    t, oracle = table(evict), TableOracle()
    for step in range(300):
        now = float(step // 3)
        ids = random_ids(rng, rng.choice([150, 5000]), rng.choice([3, 40]))
        before = set(oracle.rows)
        over = len(before | set(ids)) - cap
        if rng.random() < 0.5:
            grads = torch.randn(len(ids), DIM, generator=gen)
            t.apply(tensor(ids), grads, now=now)
        else:
            grads = None
            t.gather(tensor(ids), now=now)
        gone = before - set(t.map.items()[0].tolist())
        assert len(gone) == max(over, 0) and not gone & set(ids)
        kept = before - gone - set(ids)
        if gone and kept:
            worst = max((oracle.rows[k][1], oracle.rows[k][2]) for k in gone)
            best = min((oracle.rows[k][1], oracle.rows[k][2]) for k in kept)
            assert worst <= best
        oracle.drop(sorted(gone))
        oracle.touch(ids, now, grads)
        if step % 50 == 49:
            t = restored(t, evict)
        check_table(t, oracle)
    assert t.weight.shape[0] == cap and t.evictions > 1000


def test_growing_table_against_the_oracle_and_a_checkpoint_without_a_free_stack():
    """No eviction: ids only arrive, in batches of 1 to 2,000 (the map's merges of every
    size); a checkpoint saved before the free stack existed loads and goes on the same."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    t, oracle = table(), TableOracle()
    for step in range(120):
        ids = random_ids(rng, 200_000, rng.choice([1, 30, 700]))
        grads = torch.randn(len(ids), DIM, generator=gen)
        t.apply(tensor(ids), grads, now=float(step))
        oracle.touch(ids, float(step), grads)
        if step == 60:
            state = t.state_dict()
            del state["free"]
            t = table()
            t.load_state_dict(state)
        check_table(t, oracle, None if step % 30 == 0 else ids)
    check_table(t, oracle)
    assert t.map.dead == 0 and len(t.map._ends) <= 1 + math.log(len(t), id_map.MERGE) + 1
    assert t.map.nbytes() <= 16 * 1.5 * len(t) + 16 * 700 * 1.5


def test_a_checkpoint_whose_free_slots_do_not_add_up_is_refused():
    t = table()
    t.apply(tensor([3, 9]), torch.ones(2, DIM))
    state = t.state_dict()
    state["free"] = state["free"][1:]
    with pytest.raises(ConfigError, match="2 ids and 1021 free slots for 1024 rows"):
        table().load_state_dict(state)


def test_an_id_map_refuses_unsorted_keys_and_negative_slots():
    with pytest.raises(ValueError, match="sorted and unique"):
        IdMap(tensor([2, 1]), tensor([0, 1]))
    with pytest.raises(ValueError, match=">= 0"):
        IdMap(tensor([1, 2]), tensor([0, -1]))
