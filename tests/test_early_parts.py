"""Pushes in parts applied as their parts arrive (servers/early.py): bit for bit the whole
push when they complete, and nothing of them, parameters and the rule's state alike, when a
part fails, the worker vanishes, the push is replaced or expires."""


import pytest
import torch
import zmq

from asyncsgd.servers.early import EarlyPush
from asyncsgd.servers.rules import make_rule
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.servers.store import ParamStore
from asyncsgd.servers.zero_copy import ZeroCopyStore
from asyncsgd.wire.protocol import (ERROR, PARAMS, PULL, PUSH, Message, Segment, decode,
                                    encode, in_parts, split)
from conftest import shard_stats, wait_for

SIZE = 12
RULES = ["sgd", "momentum", "adam", "adagrad", "delayed-nesterov"]


def _state(rule="sgd", store=ParamStore, **kw):
    cfg = ShardConfig(index=0, start=0, end=SIZE, rule=rule, lr=0.5, heartbeat_timeout=5.0,
                      **kw)
    return ShardState(cfg, torch.arange(SIZE, dtype=torch.float32) / 7, store=store)


def _whole(grad, seq, worker="w", clock=0, pull=True):
    return Message(type=PUSH, worker=worker, incarnation=1, seq=seq, clock=clock, shard=0,
                   meta={"samples": 4, **({"pull": True} if pull else {})},
                   segments=split(torch.as_tensor(grad, dtype=torch.float32), frame_bytes=16))


def _parts(grad, seq, **kw):
    """The push of ``grad`` as the client sends it: 3 parts of 4 values."""
    return in_parts(_whole(grad, seq, **kw))


def _snapshot(state):
    """Everything a push writes: the parameters, the rule's state and its step count."""
    return (state.params.clone(), {k: v.clone() for k, v in state.rule.state.items()},
            state.rule.steps, state.version)


def _same(state, snapshot):
    params, rule_state, steps, version = snapshot
    assert torch.equal(state.params, params), "the parameters changed"
    assert rule_state.keys() == state.rule.state.keys()
    for key, value in rule_state.items():
        assert torch.equal(state.rule.state[key], value), f"the rule's {key} changed"
    assert (state.rule.steps, state.version) == (steps, version)


def _send(state, messages, peer=b"a", now=0.0):
    return [r for m in messages for _, r in state.handle(peer, m, now)]


@pytest.mark.parametrize("store", [ParamStore, ZeroCopyStore])
@pytest.mark.parametrize("rule", RULES)
def test_a_push_in_parts_applied_early_equals_the_whole_push_bit_for_bit(rule, store):
    parts, whole = _state(rule, store, staleness_lr=True), _state(rule, store, staleness_lr=True)
    gen = torch.Generator().manual_seed(42)
    for seq in range(1, 6):
        grad = torch.randn(SIZE, generator=gen)
        clock = max(0, seq - 3)  # stale from the fourth on: a staleness-scaled lr
        first, *rest = _parts(grad, seq, clock=clock)
        assert parts.handle(b"a", first, 0.0) == [] and parts.early is not None
        replies = _send(parts, rest)
        expected = _send(whole, [_whole(grad, seq, clock=clock)])
        assert [r.type for r in replies] == [PARAMS] and replies[0].meta == expected[0].meta
        assert torch.equal(parts.params, whole.params), f"push {seq}: not bit for bit"
    for key, value in whole.rule.state.items():
        assert torch.equal(parts.rule.state[key], value)
    assert parts.rule.steps == whole.rule.steps == 5
    assert (parts.counters["early_pushes"], parts.counters["early_undone"]) == (5, 0)
    assert parts.stats(0.0)["staleness"] == whole.stats(0.0)["staleness"]


def _warm(state, pushes=2):
    """A few good pushes first, so that the rule's state is not all zeros."""
    for seq in range(1, pushes + 1):
        _send(state, _parts(torch.randn(SIZE, generator=torch.Generator().manual_seed(seq)),
                            seq, clock=seq - 1))


def _bad_last(kind, seq):
    """A push whose last part fails ``kind``'s check (or never comes)."""
    grad = torch.full((SIZE,), 0.25)
    parts = _parts(grad, seq, clock=seq - 1)
    if kind == "nan-middle":  # 4 parts of 3 values: two come after the failing one
        parts = in_parts(Message(type=PUSH, worker="w", incarnation=1, seq=seq, clock=seq - 1,
                                 shard=0, meta={"pull": True},
                                 segments=split(grad, frame_bytes=12)))
    last = parts[-1]
    if kind in ("nan", "nan-middle"):  # the middle one's later part is dropped unanswered
        bad = last if kind == "nan" else parts[1]
        data = bad.segments[0].data.clone()
        data[-1] = float("nan")
        bad.segments = [Segment(bad.segments[0].offset, data)]
    elif kind == "out-of-range":  # one value too many: past the shard's slice
        last.segments = [Segment(last.segments[0].offset, torch.ones(5))]
    elif kind == "overlap":  # the second part's range again
        last.segments = [Segment(4, torch.ones(4))]
    return parts if kind in ("nan", "nan-middle", "out-of-range", "overlap") else parts[:-1]


@pytest.mark.parametrize("store", [ParamStore, ZeroCopyStore])
@pytest.mark.parametrize("rule", ["momentum", "adam", "delayed-nesterov"])
@pytest.mark.parametrize("kind", ["nan", "nan-middle", "out-of-range", "overlap", "expired",
                                  "replaced", "evicted", "checkpointed"])
def test_a_push_whose_last_part_fails_leaves_everything_exactly_as_before(kind, rule, store):
    """The proof test: parts 0 and 1 were applied to the scratch and the rule's state; the
    last fails (or never comes); parameters, rule state and step count are bit for bit as
    before the push, and a good push after it gives the oracle's parameters."""
    state, oracle = _state(rule, store), _state(rule, store)
    _warm(state), _warm(oracle)
    before = _snapshot(state)
    replies = _send(state, _bad_last(kind, 3))
    if kind in ("nan", "nan-middle", "out-of-range", "overlap"):
        code = {"nan": "non-finite", "nan-middle": "non-finite", "out-of-range": "out-of-range",
                "overlap": "bad-descriptor"}[kind]
        assert [(r.type, r.meta["code"]) for r in replies] == [(ERROR, code)]
    else:
        assert replies == [] and state.early is not None, "parts 0 and 1 applied early"
        if kind == "expired":
            assert state.tick(10.0) == [] and not state.streams.open
        elif kind == "evicted":  # other workers' unfinished pushes push it out
            for w in range(state.streams.max_open):
                state.handle(b"b", _parts(torch.ones(SIZE), 1, worker=f"o{w}")[0], 0.0)
            assert "w" not in state.streams.open
            assert state.early is None, "none of theirs starts early: others are open"
        elif kind == "checkpointed":  # a checkpoint holds the rule's state as before it
            saved = state.state_dict()
            assert saved["rule"]["steps"] == before[2]
            for key, value in before[1].items():
                assert torch.equal(saved["rule"]["state"][key], value)
            _send(state, _parts(torch.full((SIZE,), 0.25), 3, clock=2)[2:])  # its last part
            state.handle(b"a", _whole(torch.full((SIZE,), 0.25), 3, clock=2), 0.0)
            _send(oracle, [_whole(torch.full((SIZE,), 0.25), 3, clock=2)])
            assert state.counters["early_undone"] == 1
            assert torch.equal(state.params, oracle.params), "then applied whole, once"
            return
    if kind != "replaced":
        assert state.early is None
        assert state.counters["early_undone"] == 1
        _same(state, before)
    grad = torch.randn(SIZE, generator=torch.Generator().manual_seed(9))
    _send(state, _parts(grad, 3, clock=2))  # the push again (a new part 0 replaces one open)
    _send(oracle, [_whole(grad, 3, clock=2)])
    assert torch.equal(state.params, oracle.params)
    for key, value in oracle.rule.state.items():
        assert torch.equal(state.rule.state[key], value), key
    assert state.rule.steps == oracle.rule.steps == 3 and state.version == 3


def test_another_push_or_a_pull_between_parts_sees_none_of_it():
    """Worker a's parts interleaved with worker b's whole push and c's pull: c reads the
    parameters without a's parts, b's push undoes a's, which then applies whole at its last
    part, in the order the whole-push path applies them (momentum: order matters)."""
    state, oracle = _state("momentum"), _state("momentum")
    ga, gb = torch.full((SIZE,), 0.5), torch.arange(SIZE, dtype=torch.float32)
    first, second, last = _parts(ga, 1)
    state.handle(b"a", first, 0.0)
    (pulled,) = _send(state, [Message(type=PULL, worker="c", incarnation=1, seq=1)], b"c")
    assert torch.equal(torch.cat([s.data for s in pulled.segments]), oracle.params)
    state.handle(b"a", second, 0.0)
    _send(state, [_whole(gb, 1, worker="b")], b"b")
    assert state.early is None and state.counters["early_undone"] == 1
    (reply,) = _send(state, [last])
    assert reply.type == PARAMS and reply.meta["ack"]["applied"]
    _send(oracle, [_whole(gb, 1, worker="b"), _whole(ga, 1)])
    assert torch.equal(state.params, oracle.params)
    assert torch.equal(state.rule.state["momentum_buffer"], oracle.rule.state["momentum_buffer"])


def test_a_push_applied_early_is_applied_once_however_often_it_is_resent():
    state = _state("adam")
    grad = torch.full((SIZE,), 0.5)
    _send(state, _parts(grad, 1))
    after = _snapshot(state)
    first, second, _ = _parts(grad, 1)
    state.handle(b"a", first, 0.0)
    assert state.early is None, "a duplicate is not applied, not even early"
    (dup,) = _send(state, [second, _parts(grad, 1)[2]])
    assert dup.meta["ack"]["duplicate"]
    _same(state, after)
    # cut off before its last part, re-sent (after a reconnect) from part 0: applied once
    _send(state, _parts(grad, 2, clock=1)[:2])
    (ok,) = _send(state, _parts(grad, 2, clock=1))
    assert ok.meta["ack"]["applied"] and state.rule.steps == 2 and state.version == 2
    assert state.counters["early_undone"] == 1 and state.counters["early_pushes"] == 2


@pytest.mark.parametrize("setting", [{"consistency": "sync"}, {"dc_lambda": 0.1},
                                     {"max_grad_norm": 100.0}])
def test_where_the_whole_push_is_needed_parts_wait_for_the_last(setting):
    state = _state("sgd", **setting)
    first, second, last = _parts(torch.ones(SIZE), 1)
    state.handle(b"a", first, 0.0)
    assert state.early is None
    _send(state, [second, last])
    assert state.counters["early_pushes"] == 0


def test_a_push_begun_while_another_workers_is_open_waits_for_its_last_part():
    """Its parts would likely be undone when the other push is applied first: nothing is
    applied early, and both are applied whole, in the order they complete."""
    state, oracle = _state("adam"), _state("adam")
    a, b = _parts(torch.full((SIZE,), 0.5), 1), _parts(torch.ones(SIZE), 1, worker="b")
    state.handle(b"a", a[0], 0.0)
    assert state.early is not None
    state.handle(b"b", b[0], 0.0)
    _send(state, a[1:])
    state.handle(b"a", _parts(torch.full((SIZE,), 0.25), 2, clock=1)[0], 0.0)
    assert state.early is None, "a's next push started while b's is open"
    _send(state, b[1:], b"b")
    _send(oracle, [_whole(torch.full((SIZE,), 0.5), 1), _whole(torch.ones(SIZE), 1, worker="b")])
    assert torch.equal(state.params, oracle.params)
    assert (state.counters["early_pushes"], state.counters["early_undone"]) == (1, 0)


def test_the_early_object_undoes_its_parts_in_reverse_order():
    """EarlyPush alone: overlapping parts are refused before they write; undo restores the
    rule's state and step count, and the scratch goes back to the store."""
    store = ParamStore(torch.zeros(8), make_rule("momentum", 8, 1.0))
    store.rule.state["momentum_buffer"].copy_(torch.arange(8.0))
    early = EarlyPush(store, None, 1.0, 1.0)
    assert early.take(0, torch.ones(4)) and early.take(4, torch.ones(4))
    assert not early.take(2, torch.ones(4)), "an overlap writes nothing"
    assert store.rule.steps == 1 and torch.equal(store.params, torch.zeros(8))
    scratch = early.scratch
    early.undo()
    assert torch.equal(store.rule.state["momentum_buffer"], torch.arange(8.0))
    assert store.rule.steps == 0 and store.spare() is scratch
    early = EarlyPush(store, None, 1.0, 1.0)
    early.take(2, torch.ones(3))
    early.commit()  # the elements no part covered are the old parameters
    expected = torch.zeros(8)
    expected[2:5] = -(torch.arange(2.0, 5.0) * 0.9 + 1)  # momentum 0.9 on the buffer kept
    assert torch.equal(store.params, expected)


# ---- a real shard process, real sockets ----------------------------------------------

N = 16  # tasks_for_tests:index_counter's parameters with --samples 16


class Hand:
    """A hand-made worker on a DEALER to the shard: sends pushes in parts it chooses."""

    def __init__(self, srv, port, worker):
        self.srv, self.worker = srv, worker
        self.sock = srv.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        srv.tokens[(worker, 1)] = self.token = srv.admit(worker)

    def send(self, msg):
        msg.worker, msg.incarnation, msg.token = self.worker, 1, self.token
        self.sock.send_multipart(encode(msg))

    def reply(self):
        assert self.sock.poll(10_000), "no reply"
        return decode(self.sock.recv_multipart())

    def params(self, seq):
        self.send(Message(type=PULL, seq=seq, shard=0))
        reply = self.reply()
        assert reply.type == PARAMS
        return torch.cat([s.data for s in reply.segments]).clone()


def _real_parts(grad, seq, clock, bad=None):
    parts = in_parts(Message(type=PUSH, seq=seq, clock=clock, shard=0, meta={"pull": True},
                             segments=split(grad, frame_bytes=16)))
    if bad == "nan":
        data = parts[-1].segments[0].data.clone()
        data[0] = float("nan")
        parts[-1].segments = [Segment(parts[-1].segments[0].offset, data)]
    elif bad == "size":
        parts[-1].segments = [Segment(parts[-1].segments[0].offset, torch.ones(8))]
    return parts if bad in (None, "nan", "size") else parts[:-1]


@pytest.mark.parametrize("rule", ["momentum", "adam"])
def test_through_a_real_shard_a_failed_push_in_parts_leaves_no_trace(server, rule):
    """A real ps-server: good pushes in parts equal the rule applied to whole pushes; a
    NaN in the last part, a last part of the wrong size, a worker that vanishes before its
    last part (its push expires) each leave the parameters, and the rule's state (the next
    good push proves it: momentum and Adam's moments and step count feed it), bit for bit."""
    srv = server("--task", "tasks_for_tests:index_counter", "--samples", N, "--optimizer", rule,
                 "--lr", 0.25, "--no-exit-when-done", "--heartbeat-timeout", 1,
                 "--early-parts", "on")  # auto: off on 2 cores
    port = srv.stats()["shard_ports"][0]
    a = Hand(srv, port, "a")
    start = a.params(1)
    oracle = make_rule(rule, N, 0.25)
    expected = start.clone()
    gen = torch.Generator().manual_seed(3)
    version = 0

    def good(hand, seq):
        nonlocal version
        grad = torch.randn(N, generator=gen)
        for part in _real_parts(grad, seq, version):
            hand.send(part)
        reply = hand.reply()
        assert reply.type == PARAMS and reply.meta["ack"]["applied"], reply.meta
        oracle.step(expected, [(0, grad)])
        version += 1
        assert torch.equal(torch.cat([s.data for s in reply.segments]), expected)

    good(a, 2)
    for seq, bad in ((3, "nan"), (4, "size")):
        for part in _real_parts(torch.randn(N, generator=gen), seq, version, bad):
            a.send(part)
        reply = a.reply()
        assert reply.type == ERROR and reply.meta["code"] == {"nan": "non-finite",
                                                              "size": "out-of-range"}[bad]
        assert torch.equal(a.params(seq + 100), expected)
        good(a, seq + 10)
    b = Hand(srv, port, "b")
    for part in _real_parts(torch.randn(N, generator=gen), 1, version, "vanish"):
        b.send(part)
    assert torch.equal(a.params(200), expected), "a pull between parts sees none of them"
    b.sock.close(0)  # the worker vanishes before its last part
    wait_for(lambda: shard_stats(srv, port)["early_undone"] == 3, 20,
             "the vanished worker's push to expire")
    good(a, 30)
    stats = shard_stats(srv, port)
    assert (stats["early_pushes"], stats["nonfinite"], stats["updates"]) == (4, 1, 4)


@pytest.mark.parametrize("rule,seed", [("adam", 1), ("momentum", 2), ("sgd", 3),
                                       ("delayed-nesterov", 4)])
def test_random_interleavings_answer_and_apply_exactly_as_the_whole_push_path(rule, seed):
    """A seeded fuzz: three workers' pushes in parts interleaved with each other, with
    whole pushes, pulls, NaN parts, parts out of order, re-sent pushes, expiries and
    checkpoints, fed to a shard applying parts early and to one applying whole pushes
    (--early-parts off): the same replies, bit for bit the same parameters after every
    message, and the same rule state at the end."""
    import random
    rng = random.Random(seed)
    early, whole = _state(rule, staleness_lr=True), _state(rule, early_parts=False,
                                                           staleness_lr=True)
    seqs = {w: 0 for w in "abc"}
    open_parts: dict = {}  # worker -> (seq, clock, grad, parts sent)
    now, worker = 0.0, "a"
    for step in range(400):
        if rng.random() < 0.4:  # else the same worker again: pushes interleave now and then
            worker = rng.choice("abc")
        roll = rng.random()
        builders = []
        if roll < 0.05:
            now += 6.0  # past the heartbeat timeout: open pushes expire, workers drop
            for state in (early, whole):
                assert [m.type for _, m in state.tick(now)] == []
            open_parts.clear()
            continue
        if roll < 0.08:
            assert early.state_dict()["params"].equal(whole.state_dict()["params"])
            continue
        if roll < 0.15:
            builders = [lambda: Message(type=PULL, worker=worker, incarnation=1,
                                        seq=seqs[worker] + 1000)]
        elif roll < 0.22:
            seqs[worker] += 1
            grad = torch.randn(SIZE, generator=torch.Generator().manual_seed(step))
            seq, clock = seqs[worker], rng.randint(0, whole.version)
            builders = [lambda: _whole(grad, seq, worker=worker, clock=clock)]
        else:
            if worker not in open_parts or rng.random() < 0.05:  # a new push, or re-sent
                if worker not in open_parts or rng.random() < 0.5:
                    seqs[worker] += 1
                grad = torch.randn(SIZE, generator=torch.Generator().manual_seed(step))
                if rng.random() < 0.1:
                    grad[rng.randrange(SIZE)] = float("nan")
                open_parts[worker] = (seqs[worker], rng.randint(0, whole.version), grad, 0)
            seq, clock, grad, sent = open_parts[worker]
            j = sent if rng.random() > 0.03 else rng.randrange(3)  # now and then out of order
            open_parts[worker] = (seq, clock, grad, sent + 1)
            if sent + 1 >= 3:
                del open_parts[worker]
            builders = [lambda: _parts(grad, seq, worker=worker, clock=clock)[j]]
        for build in builders:
            got = [early.handle(worker.encode(), build(), now),
                   whole.handle(worker.encode(), build(), now)]
            for (pa, ra), (pb, rb) in zip(*got):
                assert (pa, ra.type, ra.seq, ra.meta) == (pb, rb.type, rb.seq, rb.meta), step
                assert all(torch.equal(x.data, y.data) for x, y in zip(ra.segments,
                                                                       rb.segments)), step
            assert len(got[0]) == len(got[1]), step
            assert torch.equal(early.params, whole.params), f"step {step}"
    a, b = early.state_dict(), whole.state_dict()
    assert a["rule"]["steps"] == b["rule"]["steps"] and a["version"] == b["version"]
    for key, value in b["rule"]["state"].items():
        assert torch.equal(a["rule"]["state"][key], value), key
    # seeds 1-4: 9-17 pushes applied early, 18-29 undone (most by a hostile turn)
    assert early.counters["early_pushes"] >= 5 and early.counters["early_undone"] >= 5
    assert whole.counters["early_pushes"] == 0
