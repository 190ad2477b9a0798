"""The fused common path (servers/fused.py) answers exactly as the general path: the same
replies, parameters, counters, stats, audit and checkpoint, bit for bit, over a sequence of
pushes with duplicates, stale pushes, refusals and a NaN push, whole or in parts (pure
ShardState)."""

import random

import pytest
import torch

from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.servers.store import ParamStore
from asyncsgd.servers.zero_copy import ZeroCopyStore
from asyncsgd.wire.protocol import (BYE, HEARTBEAT, PARAMS, PULL, PUSH, STATS, Key, Message,
                                    Segment)

SIZE = 8


def _grad(step: int, n: int = SIZE) -> torch.Tensor:
    """Small integers and halves: exact under lr 1, distinct per step."""
    return (torch.arange(n, dtype=torch.float32) % 5 - 2 + step) / 2


def _push(worker, seq, grad, clock, inc=1, shard=0, offset=0, pull=True, **meta):
    return Message(type=PUSH, worker=worker, incarnation=inc, seq=seq, clock=clock,
                   shard=shard, meta={**({Key.PULL: True} if pull else {}), **meta},
                   segments=[Segment(offset, grad)])


def _script(version):
    """The messages, each made when it is sent (``version``: the shard's now), and how many
    of them the fused path takes (None: unless the shard refuses NaN)."""
    nan = _grad(9).clone()
    nan[3] = float("nan")
    yield lambda: _push("w1", 1, _grad(1), version()), 0  # first contact: general
    for seq in range(2, 7):  # the common message
        yield lambda seq=seq: _push("w1", seq, _grad(seq), version()), 1
    yield lambda: _push("w1", 4, _grad(4), version()), 0  # a duplicate: not applied again
    yield lambda: _push("w2", 1, _grad(11), 0), 0  # w2's first, stale
    for seq in range(2, 5):  # stale pushes, computed on version 0
        yield lambda seq=seq: _push("w2", seq, _grad(seq + 20), 0), 1
    # A push in parts applied as its parts arrive (early.py): a whole push meanwhile takes
    # the general path, which undoes it first; once it is committed, the fused one again
    half = SIZE // 2
    yield lambda: _push("w4", 1, _grad(42), version()), 0
    yield lambda: _push("w3", 1, _grad(40), version()), 0
    yield lambda: _push("w3", 2, _grad(41)[:half], version(), part=0, parts=2), 0
    yield lambda: _push("w4", 2, _grad(43), version()), 0  # while w3's push is open
    yield lambda: _push("w3", 2, _grad(41)[half:], version(), offset=half, part=1, parts=2), 0
    yield lambda: _push("w3", 3, _grad(44)[:half], version(), part=0, parts=2), 0
    yield lambda: _push("w3", 3, _grad(44)[half:], version(), offset=half, part=1, parts=2), 0
    yield lambda: _push("w4", 3, _grad(45), version()), 1
    yield lambda: _push("w1", 7, nan, version()), None  # refused: NaN (unless not checked)
    yield lambda: _push("w1", 8, _grad(8), version(), offset=3), 0  # refused: out of range
    yield lambda: _push("w1", 9, _grad(9), version(), shard=1), 0  # refused: another shard
    yield lambda: _push("w1", 10, _grad(10), version(), compute=-1.0), 0  # refused: compute
    yield lambda: _push("w1", 11, _grad(11), version(), loss=0.5, samples=32,
                        traffic=[100, 200], compute=0.01), 1  # reported: train and traffic
    yield lambda: _push("w1", 12, _grad(12), version() + 5), 1  # ahead: from a past life
    yield lambda: _push("w1", 13, _grad(13), version(), pull=False), 0  # a push alone
    yield lambda: _push("w1", 14, _grad(14).to(torch.bfloat16), version()), 0  # widened
    yield lambda: _push("w1", 15, _grad(15), version(), pull_dtype="float16"), 0
    yield lambda: _push("w1", 18, _grad(18), version()), 1  # travels as float32 again
    yield lambda: _push("w1", 16, _grad(16), version(), part=0, parts=2), 0  # in parts
    yield lambda: Message(type=PULL, worker="w1", incarnation=1, seq=19), 0
    yield lambda: Message(type=HEARTBEAT, worker="w2", incarnation=1, seq=5), 0
    yield lambda: Message(type=STATS, seq=1), 0
    yield lambda: Message(type=BYE, worker="w2", incarnation=1, seq=6), 0
    yield lambda: _push("w2", 7, _grad(7), version()), 0  # departed: readmitted in general
    yield lambda: _push("w2", 8, _grad(8), version()), 1
    yield lambda: _push("w1", 1, _grad(30), version(), inc=2), 0  # restarted: new incarnation
    yield lambda: _push("w1", 2, _grad(31), version(), inc=2), 1
    yield lambda: _push("w1", 12, _grad(12), version()), 0  # the old incarnation: refused
    for seq in range(3, 12):  # past the dedupe window of 4
        yield lambda seq=seq: _push("w1", seq, _grad(seq), version(), inc=2), 1
    yield lambda: _push("w1", 4, _grad(4), version(), inc=2), 0  # out of the window: refused
    yield lambda: _push("w1", 11, _grad(11), version(), inc=2), 0  # in it: a duplicate


def _reply(peer, msg, store) -> tuple:
    """Everything a reply says, its tensors as bytes (read once what is pending is applied:
    the shard process applies it before it sends)."""
    store.apply_pending()
    return (peer, msg.type, msg.worker, msg.incarnation, msg.seq, msg.clock, msg.shard,
            msg.meta, msg.token,
            [(s.offset, s.data.dtype, s.data.float().numpy().tobytes()) for s in msg.segments])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            a.numpy().tobytes() == b.numpy().tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


CONFIGS = [
    dict(),
    dict(rule="adam", lr=0.5, staleness_lr=True),
    dict(max_grad_norm=20.0),  # steps up to ~14 within it, later ones refused
    dict(reject_nonfinite=False),
    dict(rule="momentum", lr_schedule="cosine:100"),
]


@pytest.mark.parametrize("store, later", [(ParamStore, False), (ZeroCopyStore, True)])
@pytest.mark.parametrize("extra", CONFIGS, ids=lambda c: ",".join(c) or "default")
def test_the_fused_path_answers_exactly_as_the_general_path(store, later, extra):
    cfg = dict(index=0, start=0, end=SIZE, lr=1.0, heartbeat_timeout=50.0, dedupe_window=4)
    cfg.update(extra)
    states = [ShardState(ShardConfig(**cfg), torch.arange(SIZE, dtype=torch.float32),
                         store=store, settle_later=later, fused=fused) for fused in (True, False)]
    fused, general = states
    assert fused.fused and not general.fused
    audits = [[], []]
    for state, audit in zip(states, audits):
        state.audit = lambda *a, audit=audit: audit.append(a)
    expected = 0
    now = 1.0
    for make, common in _script(lambda: general.version):
        now += 0.25
        before = fused.fused_pushes
        got = [[_reply(p, r, s.store) for p, r in s.handle(b"peer", make(), now)]
               for s in states]
        assert _same(got[0], got[1]), got
        if common is None:
            common = not cfg.get("reject_nonfinite", True)
        if common and (extra.get("max_grad_norm") is None or
                       float(make().segments[0].data.norm()) <= extra["max_grad_norm"]):
            expected += 1
            assert fused.fused_pushes == before + 1 and got[0][0][1] == PARAMS
            assert got[0][0][7][Key.ACK][Key.APPLIED] is True
        else:
            assert fused.fused_pushes == before
        assert [s._unsettled is None for s in states] == [general._unsettled is None] * 2
        assert fused.now == general.now and fused.policy.now == general.policy.now
        for state in states:
            state.settle()  # as the shard process does once the reply is out
        assert _same(fused.params, general.params) and fused.version == general.version
        assert fused.counters == general.counters and fused.staleness == general.staleness
        assert _same(fused.stats(now), general.stats(now))
    assert fused.fused_pushes == expected >= (8 if "max_grad_norm" in extra else 20)
    assert general.fused_pushes == 0
    assert audits[0] == audits[1] and len(audits[0]) == fused.counters["updates"]
    assert _same(fused.stats(now), general.stats(now))
    assert _same(fused.state_dict(), general.state_dict())
    counters = fused.counters
    early = "max_grad_norm" not in extra  # (a bound on the whole push: none start early)
    assert (counters["early_undone"] >= 1) == early and (counters["early_pushes"] == 1) == early
    assert counters["duplicates"] == 2 and counters["rejected"] >= 5
    assert counters["nonfinite"] == (1 if cfg.get("reject_nonfinite", True) else 0)
    if "max_grad_norm" not in extra:  # (its stale pushes are too large)
        assert sum(fused.staleness[1:]) >= 4  # the stale pushes were counted stale


def test_configurations_with_more_to_a_push_take_the_general_path():
    def state(**kw):
        return ShardState(ShardConfig(index=0, start=0, end=SIZE, **kw), torch.zeros(SIZE))

    assert state().fused
    for kw in (dict(consistency="ssp:1"), dict(consistency="sync"), dict(dc_lambda=0.04)):
        assert not state(**kw).fused, kw


def _parts(worker, seq, grad, clock, cuts=(3, 6), spans=None, **kw):
    """A push of ``grad`` in parts cut at ``cuts`` (or of its ``spans`` [(start, stop)]),
    each part as ``in_parts`` makes it."""
    bounds = [0, *cuts, len(grad)]
    spans = spans or list(zip(bounds, bounds[1:]))
    return [_push(worker, seq, grad[a:b], clock, offset=a, part=j, parts=len(spans), **kw)
            for j, (a, b) in enumerate(spans)]


def _parts_script(version):
    """Pushes in parts, each message made when it is sent, with whether the fused path takes
    it (a part) and whether it completes a push (``_script``'s second field for its last)."""
    nan = _grad(9).clone()
    nan[4] = float("nan")
    yield lambda: _push("w1", 1, _grad(1), version()), (0, 0)  # first contact: general
    yield lambda: _push("w2", 1, _grad(2), version()), (0, 0)
    for seq in (2, 3):  # the common push in parts: each part fused, the last applies it
        for j in range(3):
            yield lambda seq=seq, j=j: _parts("w1", seq, _grad(seq), version())[j], (1, j == 2)
    # two workers' pushes in parts interleaved
    yield lambda: _parts("w1", 4, _grad(4), version())[0], (1, 0)
    yield lambda: _parts("w2", 2, _grad(5), 0)[0], (1, 0)  # stale, computed on version 0
    yield lambda: _parts("w1", 4, _grad(4), version())[1], (1, 0)
    yield lambda: _parts("w2", 2, _grad(5), 0)[1], (1, 0)
    yield lambda: _parts("w2", 2, _grad(5), 0)[2], (1, 1)
    yield lambda: _parts("w1", 4, _grad(4), version())[2], (1, 1)
    # a new part 0 replaces the open push: general; then its parts fused
    yield lambda: _parts("w1", 5, _grad(5), version())[0], (1, 0)
    yield lambda: _parts("w1", 6, _grad(6), version())[0], (0, 0)
    yield lambda: _parts("w1", 6, _grad(6), version())[2], (0, 0)  # out of order: refused
    yield lambda: _parts("w1", 6, _grad(6), version())[1], (1, 0)
    yield lambda: _parts("w1", 6, _grad(6), version())[2], (1, 1)
    # a NaN in the middle part: refused in general, the rest dropped
    for j in range(3):
        yield lambda j=j: _parts("w1", 7, nan, version())[j], (int(j == 0), 0)
    # overlapping parts: refused at the last, in general
    overlap = [(0, 3), (2, 4), (4, 7)]
    for j in range(3):
        yield lambda j=j: _parts("w1", 8, _grad(8), version(), spans=overlap)[j], (int(j < 2), 0)
    # more values than the slice: refused at the part that passes it
    for j in range(3):
        yield lambda j=j: _parts("w1", 9, _grad(9), version(), spans=[(0, 6), (0, 3), (6, 8)])[j], \
            (int(j == 0), 0)
    # a push already applied, in parts again: a duplicate, answered in general
    for j in range(3):
        yield lambda j=j: _parts("w1", 6, _grad(6), version())[j], (int(j < 2), 0)
    # what a push reports rides on its parts; a bad compute refuses the push at its last
    for j in range(3):
        yield lambda j=j: _parts("w1", 10, _grad(10), version(), loss=0.5, samples=32,
                                 compute=0.01)[j], (1, j == 2)
    for j in range(3):
        yield lambda j=j: _parts("w1", 11, _grad(11), version(), compute=-1.0)[j], \
            (int(j < 2), 0)
    yield lambda: _parts("w1", 12, _grad(12), version() + 5, cuts=())[0], (1, 1)  # one part
    for j in range(2):  # ahead (a past life): its clock is the version at its part 0 ...
        yield lambda j=j: _parts("w1", 13, _grad(13), version() + 1, cuts=(4,))[j], (1, j)
        if not j:  # ... not the one at its last: another worker's push came between
            yield lambda: _push("w2", 3, _grad(3), version()), (0, 1)
    for j in range(2):  # a pull dtype, a push alone: general
        yield lambda j=j: _parts("w1", 14, _grad(14), version(), cuts=(4,),
                                 pull_dtype="float16")[j], (0, 0)
    for j in range(2):
        yield lambda j=j: _parts("w1", 15, _grad(15), version(), cuts=(4,), pull=False)[j], (0, 0)
    yield lambda: _parts("w1", 16, _grad(16), version())[1], (0, 0)  # no part 0: refused
    # part 0 decides: one that asks nothing back makes a push alone, whatever follows
    yield lambda: _parts("w1", 18, _grad(18), version(), cuts=(4,), pull=False)[0], (0, 0)
    yield lambda: _parts("w1", 18, _grad(18), version(), cuts=(4,))[1], (0, 0)
    # past the open pushes a shard keeps (16 here), a new one evicts the oldest: general
    for k in range(16):
        yield lambda k=k: _push(f"v{k}", 1, _grad(k), version()), (0, 0)
    for k in range(16):
        yield lambda k=k: _parts(f"v{k}", 2, _grad(k), version())[0], (1, 0)
    yield lambda: _parts("w2", 4, _grad(4), version())[0], (0, 0)
    yield lambda: _push("w1", 17, _grad(17), version()), (0, 1)  # whole again: fused


@pytest.mark.parametrize("store, later", [(ParamStore, False), (ZeroCopyStore, True)])
@pytest.mark.parametrize("extra", CONFIGS, ids=lambda c: ",".join(c) or "default")
def test_pushes_in_parts_take_the_fused_path_and_answer_exactly_as_the_general_path(
        store, later, extra):
    cfg = dict(index=0, start=0, end=SIZE, lr=1.0, heartbeat_timeout=50.0, dedupe_window=4,
               early_parts=False)
    cfg.update(extra)
    states = [ShardState(ShardConfig(**cfg), torch.arange(SIZE, dtype=torch.float32),
                         store=store, settle_later=later, fused=fused) for fused in (True, False)]
    fused, general = states
    audits = [[], []]
    for state, audit in zip(states, audits):
        state.audit = lambda *a, audit=audit: audit.append(a)
    # a bound on the whole gradient's norm: every part in general (it is checked once joined)
    bounded = "max_grad_norm" in extra
    unchecked = not cfg.get("reject_nonfinite", True)
    now = 1.0
    pushes = 0
    for step, (make, (part, applied)) in enumerate(_parts_script(lambda: general.version)):
        now += 0.25
        before = fused.fused_parts, fused.fused_pushes
        got = [[_reply(p, r, s.store) for p, r in s.handle(b"peer", make(), now)]
               for s in states]
        assert _same(got[0], got[1]), (step, got)
        sent = make()
        if unchecked and (sent.worker, sent.seq) == ("w1", 7):  # NaN: not refused, so taken
            part, applied = 1, sent.meta[Key.PART] == 2
        if bounded and Key.PARTS not in sent.meta:  # a whole push within the bound: fused
            applied = applied and float(sent.segments[0].data.norm()) <= extra["max_grad_norm"]
        elif bounded:
            part = applied = 0
        taken = (int(part), int(applied))
        assert (fused.fused_parts - before[0], fused.fused_pushes - before[1]) == taken, step
        pushes += taken[1]
        if taken[1]:
            assert got[0][0][1] == PARAMS and got[0][0][7][Key.ACK][Key.APPLIED] is True
        for state in states:
            state.settle()
        assert _same(fused.params, general.params) and fused.version == general.version
        assert fused.counters == general.counters and fused.staleness == general.staleness
        assert _same(fused.stats(now), general.stats(now))
        assert fused.streams.open.keys() == general.streams.open.keys()
        for key, stream in fused.streams.open.items():
            other = general.streams.open[key]
            assert (stream.seq, stream.received, stream.values, stream.failed) == \
                (other.seq, other.received, other.values, other.failed)
    assert _same(fused.state_dict(), general.state_dict())
    assert audits[0] == audits[1] and len(audits[0]) == fused.counters["updates"]
    assert fused.fused_pushes == pushes >= (1 if bounded else 10)
    assert general.fused_parts == general.fused_pushes == 0
    counters = fused.counters
    assert counters["duplicates"] == 1 and counters["rejected"] >= 5
    assert counters["nonfinite"] == (0 if unchecked else 1)
    assert sum(fused.staleness[1:]) >= 1  # w2's stale push in parts counted stale


def _random_messages(rng, states, workers, steps):
    """``steps`` of random traffic (a seeded fuzz): pushes whole and in 1-4 parts of random
    cuts from up to 20 workers, parts skipped, repeated or old sequence numbers, clocks
    stale and ahead, NaN, overlaps, bf16 and 2-D parts, a pull dtype or no pull on any part,
    good and bad compute, an ack where none belongs, reports, byes, restarts and ticks
    (expiry); yields ``(now, peer, message)`` or ``(now, None, None)`` for a tick."""
    size = len(states[0].params)
    seqs, inc, pending = dict.fromkeys(workers, 0), dict.fromkeys(workers, 1), {}
    now = 1.0
    for _ in range(steps):
        now += rng.choice([0.01, 0.05, 0.1, 0.2]) if rng.random() < 0.98 else 6.0
        r = rng.random()
        w = rng.choice(workers[:rng.choice([2, 4, len(workers)])])
        version = states[1].version
        peer = rng.choice([b"p1", b"p2"])
        if r < 0.02:
            yield now, peer, Message(type=BYE, worker=w, incarnation=inc[w], seq=99)
        elif r < 0.03:
            inc[w], seqs[w] = inc[w] + 1, 0
        elif r < 0.06:
            yield now, None, None
        elif pending.get(w) and r < 0.6:
            yield now, peer, pending[w].pop(0)
            if rng.random() < 0.05 and pending[w]:
                pending[w].pop(0)  # a part lost on the way
        else:
            seqs[w] += rng.random() < 0.85
            seq = seqs[w] if rng.random() < 0.9 else max(1, seqs[w] - rng.randint(0, 6))
            grad = torch.tensor([rng.randint(-4, 4) / 2 for _ in range(size)])
            if rng.random() < 0.05:
                grad[rng.randrange(size)] = float("nan")
            clock = rng.choice([version, version, version, max(0, version - 3), 0, version + 2])
            meta = {Key.PULL: True} if rng.random() < 0.93 else {}
            if rng.random() < 0.2:
                meta.update({Key.LOSS: 0.5, Key.SAMPLES: 8, Key.TRAFFIC: [1, 2]})
            if rng.random() < 0.1:
                meta[Key.COMPUTE] = rng.choice([0.1, -1.0, "x"])
            if rng.random() < 0.04:
                meta[Key.PULL_DTYPE] = rng.choice(["float16", "bfloat16"])
            if rng.random() < 0.05:
                meta[Key.ACK] = {"x": 1}
            parts = rng.choice([1, 1, 2, 3, 4])
            if parts == 1 and rng.random() < 0.6:
                yield now, peer, Message(PUSH, w, inc[w], seq, clock, 0, meta, [Segment(0, grad)])
                continue
            bounds = [0, *sorted(rng.sample(range(1, size), parts - 1)), size]
            spans = list(zip(bounds, bounds[1:]))
            if rng.random() < 0.1 and len(spans) > 1:  # overlapping the part before
                spans[1] = (spans[1][0] - 1, spans[1][1] - 1)
            made = []
            for j, (a, b) in enumerate(spans):
                data = grad[a:b].clone()
                if rng.random() < 0.04:
                    data = data.to(torch.bfloat16)
                elif rng.random() < 0.02 and len(data) % 2 == 0:
                    data = data.reshape(2, -1)
                part = dict(meta if j == 0 else {k: v for k, v in meta.items() if k != Key.ACK})
                if j and rng.random() < 0.03:
                    part.pop(Key.PULL, None)
                elif j and rng.random() < 0.3:  # part 0 decides; a later part may say more
                    part[Key.PULL] = True
                if j and rng.random() < 0.03:
                    part[Key.PULL_DTYPE] = "float16"
                part.update({Key.PART: j, Key.PARTS: len(spans)})
                made.append(Message(PUSH, w, inc[w], seq, clock, 0, part, [Segment(a, data)]))
            yield now, peer, made.pop(0)
            pending[w] = made


def _everything(state, now) -> dict:
    """All a shard's state that a message can change, open pushes and records included."""
    state.settle()
    return {"params": state.params.clone(), "version": state.version,
            "counters": dict(state.counters), "staleness": list(state.staleness),
            "stats": state.stats(now), "now": (state.now, state.policy.now),
            "workers": {w: (r.incarnation, r.peer, r.last_seen, r.pushes, r.alive, r.wire,
                            r.reported_clock, r.window.state())
                        for w, r in state.workers.items()},
            "streams": [(w, o.seq, o.incarnation, o.parts, o.first.clock, o.first.meta,
                         o.started, [(g.offset, g.data.numpy().tobytes()) for g in o.segments],
                         o.received, o.values, o.failed) for w, o in state.streams.open.items()],
            "train": {w: list(v) for w, v in state.train.items()},
            "traffic": {w: list(v) for w, v in state.traffic.items()}}


@pytest.mark.parametrize("store, later", [(ParamStore, False), (ZeroCopyStore, True)])
@pytest.mark.parametrize("extra", CONFIGS, ids=lambda c: ",".join(c) or "default")
def test_random_traffic_is_answered_the_same_fused_or_not(store, later, extra):
    cfg = dict(index=0, start=0, end=12, lr=1.0, heartbeat_timeout=5.0, dedupe_window=4,
               early_parts=False, expected_workers=1)
    cfg.update(extra)
    taken = [0, 0]
    for seed in range(2):
        states = [ShardState(ShardConfig(**cfg), torch.arange(12, dtype=torch.float32),
                             store=store, settle_later=later, fused=fused)
                  for fused in (True, False)]
        audits = [[], []]
        for state, audit in zip(states, audits):
            state.audit = lambda *a, audit=audit: audit.append(a)
        workers = [f"w{i}" for i in range(20)]  # past the 16 open pushes a shard keeps
        rng = random.Random(seed)
        for step, (now, peer, msg) in enumerate(_random_messages(rng, states, workers, 300)):
            if msg is None:
                for state in states:
                    state.tick(now)
                continue
            got = []
            for state in states:  # each its own copy: a shard may keep or change what it got
                own = Message(msg.type, msg.worker, msg.incarnation, msg.seq, msg.clock,
                              msg.shard, dict(msg.meta),
                              [Segment(s.offset, s.data.clone()) for s in msg.segments])
                got.append([_reply(p, r, state.store) for p, r in state.handle(peer, own, now)])
            assert _same(got[0], got[1]), (seed, step, msg)
            assert _same(_everything(states[0], now), _everything(states[1], now)), (seed, step)
        assert audits[0] == audits[1]
        taken[0] += states[0].fused_parts
        taken[1] += states[0].fused_pushes
    if "max_grad_norm" not in extra:  # (there, parts are the general path's)
        assert taken[0] >= 100 and taken[1] >= 50, taken
