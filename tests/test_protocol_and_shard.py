"""The wire protocol and the shard's state object, without sockets or processes."""

import random

import msgpack
import pytest
import torch

from asyncsgd.wire.protocol import (ACK, BYE, ERROR, HEARTBEAT, PARAMS, PULL, PUSH, STATS, VERSION,
                                    Key, Message, ProtocolError, Segment, decode, encode, split)
from asyncsgd.config import parse_consistency
from asyncsgd.servers.shard import ShardConfig, ShardState


def _frames(msg):
    return [bytes(f) for f in encode(msg)]


def test_round_trip_keeps_every_field_and_tensor():
    grads = torch.arange(10, dtype=torch.float32)
    msg = Message(type=PUSH, worker="w1", incarnation=7, seq=42, clock=3, shard=1,
                  meta={"loss": 0.5, "samples": 32},
                  segments=[Segment(0, grads[:6]), Segment(6, grads[6:].to(torch.float64))])
    back = decode(_frames(msg))
    assert (back.type, back.worker, back.incarnation, back.seq, back.clock, back.shard) == \
        (PUSH, "w1", 7, 42, 3, 1)
    assert back.meta == {"loss": 0.5, "samples": 32}
    assert [s.offset for s in back.segments] == [0, 6]
    assert torch.equal(back.segments[0].data, grads[:6])
    assert back.segments[1].data.dtype == torch.float64


def test_a_segment_sent_again_sends_its_tensors_current_values():
    """encode keeps a sent segment's descriptor and byte view on it (a worker sends the same
    gradient views every step): the view follows the tensor's memory, so every message
    carries the values of the moment; a strided tensor's bytes are a copy, never kept."""
    flat = torch.zeros(12)
    views = [Segment(0, flat[:8]), Segment(8, flat[8:])]
    strided = Segment(0, torch.zeros(16)[::2])
    for step in range(3):
        flat.copy_(torch.arange(12) * (step + 1))
        strided.data.fill_(step)
        back = decode(_frames(Message(type=PUSH, worker="w", seq=step, segments=views)))
        assert torch.equal(torch.cat([s.data for s in back.segments]), flat)
        assert [s.offset for s in back.segments] == [0, 8]
        (again,) = decode(_frames(Message(type=PARAMS, segments=[strided]))).segments
        assert torch.equal(again.data, torch.full((8,), float(step)))
    assert all(v.wire is not None for v in views) and strided.wire is None


def test_split_keeps_frames_at_most_4_mib():
    flat = torch.zeros(3 * 1024 * 1024)  # 12 MiB of float32
    segments = split(flat, offset=100)
    assert [s.offset for s in segments] == [100, 100 + 2 ** 20, 100 + 2 * 2 ** 20]
    assert all(s.data.numel() * 4 <= 4 * 2 ** 20 for s in segments)


def _header(**fields):
    base = {"v": VERSION, "t": PUSH, "w": "w", "i": 0, "s": 1, "c": 0, "sh": 0, "m": {}, "d": []}
    base.update(fields)
    return msgpack.packb(base)


@pytest.mark.parametrize("frames, code", [
    ([], "empty"),
    ([_header()[:-3]], "bad-header"),                              # truncated header
    ([b"\x00" * (65 * 1024)], "header-too-large"),
    ([_header(v=VERSION + 1)], "bad-version"),
    ([_header(t="launch")], "bad-type"),
    ([msgpack.packb([1, 2, 3])], "bad-header"),                    # not a map
    ([_header(d=[[0, "float32", [4]]]), b"\x00" * 15], "length-mismatch"),
    ([_header(d=[[0, "object", [1]]]), b"\x00" * 8], "bad-dtype"),
    ([_header(d=[[0, "float32", [2 ** 39, 2 ** 39]]]), b""], "length-mismatch"),
    ([_header(d=[[0, "float32", [1]]])], "frame-count"),
    ([_header(d=[[-1, "float32", [1]]]), b"\x00" * 4], "bad-descriptor"),
    ([_header(s="7")], "bad-field"),
    ([msgpack.packb({"v": VERSION, "t": PUSH, "m": msgpack.ExtType(1, b"x")})], "bad-header"),
])
def test_malformed_messages_raise_protocol_errors(frames, code):
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == code


def _state(mode="async", workers=1, size=6, rule="sgd", **kw):
    cfg = ShardConfig(index=0, start=0, end=size, rule=rule, lr=1.0, consistency=mode,
                      expected_workers=workers, heartbeat_timeout=5.0, **kw)
    return ShardState(cfg, torch.arange(size, dtype=torch.float32) * 10)


def _push(worker, seq, grad, clock=0, inc=1):
    return Message(type=PUSH, worker=worker, incarnation=inc, seq=seq, clock=clock, shard=0,
                   segments=[Segment(0, torch.as_tensor(grad, dtype=torch.float32))])


def _pull(worker, seq, inc=1):
    return Message(type=PULL, worker=worker, incarnation=inc, seq=seq)


def test_async_exact_oracle_and_exactly_once():
    state = _state()
    start = state.params.clone()
    total = torch.zeros(6)
    for seq in range(1, 21):
        grad = torch.randint(-5, 6, (6,)).float()
        for peer, reply in state.handle(b"a", _push("w1", seq, grad, clock=state.version), 0.0):
            assert reply.type == ACK and reply.meta["applied"]
        total += grad
    again = state.handle(b"a", _push("w1", 20, torch.ones(6), clock=state.version), 0.0)
    assert again[0][1].meta == {"applied": False, "duplicate": True}
    assert torch.equal(state.params, start - total)
    assert state.counters["updates"] == 20 and state.counters["duplicates"] == 1


def test_rejected_pushes_change_nothing():
    state = _state()
    start = state.params.clone()
    for grad, code in [([float("nan")] * 6, "non-finite"), ([float("inf")] * 6, "non-finite")]:
        (_, reply), = state.handle(b"a", _push("w", 1, grad), 0.0)
        assert reply.type == ERROR and reply.meta["code"] == code
    bad = Message(type=PUSH, worker="w", incarnation=1, seq=2, shard=0,
                  segments=[Segment(4, torch.ones(3))])
    (_, reply), = state.handle(b"a", bad, 0.0)
    assert reply.meta["code"] == "out-of-range"
    assert torch.equal(state.params, start) and state.version == 0


def test_ssp_holds_a_worker_more_than_k_ahead_until_the_slowest_catches_up():
    state = _state("ssp:1", workers=2)
    assert state.handle(b"a", _pull("fast", 1), 0.0) == []        # waits for the second worker
    served = state.handle(b"b", _pull("slow", 1), 0.0)
    assert sorted(p for p, r in served if r.type == PARAMS) == [b"a", b"b"]
    seq = 1
    for _ in range(2):                                              # fast pushes twice
        seq += 1
        state.handle(b"a", _push("fast", seq, torch.zeros(6), clock=state.version), 0.0)
    assert state.handle(b"a", _pull("fast", 10), 0.0) == []        # 2 ahead of slow > K = 1
    released = state.handle(b"b", _push("slow", 2, torch.zeros(6), clock=0), 0.0)
    assert (b"a", PARAMS) in [(p, r.type) for p, r in released]
    assert state.counters["max_pull_lead"] <= 1


def test_sync_applies_the_round_once_everyone_pushed_and_survives_a_dead_worker():
    state = _state("sync", workers=2, sync_reduce="sum")
    start = state.params.clone()
    state.handle(b"a", _pull("a", 1), 0.0)
    state.handle(b"b", _pull("b", 1), 0.0)
    assert state.handle(b"a", _push("a", 2, [1.0] * 6), 0.0) == []  # ack held until the round ends
    assert state.handle(b"a", _pull("a", 3), 0.0) == []
    out = state.handle(b"b", _push("b", 2, [2.0] * 6), 0.1)
    kinds = sorted((p, r.type) for p, r in out)
    assert kinds == [(b"a", ACK), (b"a", PARAMS), (b"b", ACK)]
    assert torch.equal(state.params, start - 3.0) and state.version == 1
    # Round 2: b goes silent; after the heartbeat timeout a's push completes the round alone.
    state.handle(b"a", _push("a", 4, [1.0] * 6, clock=1), 1.0)
    assert state.tick(2.0) == []
    state.handle(b"a", Message(type=HEARTBEAT, worker="a", incarnation=1), 9.5)  # a stays alive
    released = state.tick(10.0)
    assert (b"a", ACK) in [(p, r.type) for p, r in released]
    assert torch.equal(state.params, start - 4.0) and state.counters["dropped_workers"] == 1


def test_a_sync_round_with_no_sockets_applies_the_mean_and_answers_the_held_pulls():
    """ShardState alone, as the protocol's rules: pulls held until the round is applied,
    the default reduce is the mean, every push acknowledged once, and the parameters the
    held pulls get are the new ones."""
    state = _state("sync", workers=2)
    start = state.params.clone()
    assert state.handle(b"a", _pull("a", 1), 0.0) == []              # waits for the second worker
    assert sorted(p for p, r in state.handle(b"b", _pull("b", 1), 0.0)) == [b"a", b"b"]
    assert state.handle(b"a", _push("a", 2, [1.0] * 6), 0.0) == []
    assert state.handle(b"a", _pull("a", 3), 0.0) == []              # held: round 1 is open
    out = state.handle(b"b", _push("b", 2, [5.0] * 6), 0.0)
    assert sorted((p, r.type) for p, r in out) == [(b"a", ACK), (b"a", PARAMS), (b"b", ACK)]
    assert torch.equal(state.params, start - 3.0) and state.version == 1   # mean of 1 and 5
    (params,) = [r for p, r in out if r.type == PARAMS]
    assert params.meta["version"] == 1 and torch.equal(params.segments[0].data, start - 3.0)
    (_, refused), = state.refuse(b"c", "bad-field", "a test's malformed request")
    assert refused.type == ERROR and state.counters["rejected"] == 1 and state.version == 1


def test_staleness_lr_divides_the_step_by_the_staleness_exactly():
    """--staleness-lr: a push computed s versions ago moves the parameters by lr * g / s
    (s of 0 or 1: the whole step). Hand-computed, plain SGD with lr 1."""
    state = _state(staleness_lr=True)
    start = state.params.clone()
    for seq in (1, 2, 3, 4):                                         # versions 1..4, fresh
        state.handle(b"a", _push("fresh", seq, [1.0] * 6, clock=state.version), 0.0)
    assert torch.equal(state.params, start - 4.0)
    (_, ack), = state.handle(b"b", _push("old", 1, [8.0] * 6, clock=0), 0.0)  # 4 versions late
    assert ack.meta == {"applied": True, "staleness": 4}
    assert torch.equal(state.params, start - 4.0 - 2.0)             # 8 / 4
    state.handle(b"b", _push("old", 2, [8.0] * 6, clock=state.version - 1), 0.0)
    assert torch.equal(state.params, start - 6.0 - 8.0)             # staleness 1: whole step


def test_dc_asgd_compensates_against_what_the_worker_pulled_exactly():
    """--dc-asgd L (Zheng et al. 2017): g + L * g * g * (params now - params pulled), computed
    here by hand for each element; plain SGD with lr 1."""
    lam = 0.5
    state = _state(dc_lambda=lam)
    p0 = state.params.tolist()                                        # 0, 10, ..., 50
    state.handle(b"b", _pull("late", 1), 0.0)                         # late's backup: p0
    g_a = [1.0, 2.0, 3.0, 4.0, 0.0, -2.0]
    state.handle(b"a", _push("first", 1, g_a, clock=0), 0.0)           # first pulled nothing
    p1 = [p - g for p, g in zip(p0, g_a)]
    assert state.params.tolist() == p1
    g_b = [1.0, 1.0, 2.0, -1.0, 3.0, 0.5]
    state.handle(b"b", _push("late", 2, g_b, clock=0), 0.0)
    compensated = [g + lam * g * g * (now - pulled) for g, now, pulled in zip(g_b, p1, p0)]
    assert compensated == [0.5, 0.0, -4.0, -3.0, 3.0, 0.75]
    assert state.params.tolist() == [p - c for p, c in zip(p1, compensated)]


def test_observer_pulls_join_no_barrier_and_stats_answer():
    state = _state("sync", workers=1)
    (_, params), = state.handle(b"e", Message(type=PULL, meta={"observer": True}), 0.0)
    assert params.type == PARAMS and not state.workers
    (_, stats), = state.handle(b"e", Message(type=STATS, seq=5), 0.0)
    assert stats.meta["version"] == 0 and stats.seq == 5
    (_, beat), = state.handle(b"w", Message(type=HEARTBEAT, worker="w", incarnation=1), 0.0)
    assert beat.type == HEARTBEAT
    (_, bye), = state.handle(b"w", Message(type=BYE, worker="w", incarnation=1), 0.0)
    assert bye.type == BYE and not state.workers["w"].alive


def test_restarted_worker_gets_a_fresh_dedupe_window():
    state = _state()
    state.handle(b"a", _push("w", 1, [1.0] * 6, inc=1), 0.0)
    (_, ack), = state.handle(b"a", _push("w", 1, [1.0] * 6, inc=2), 0.0)
    assert ack.meta["applied"] is True and state.version == 2


def test_state_dict_round_trip(tmp_path):
    state = _state(rule="adam")
    state.handle(b"a", _push("w", 1, [1.0] * 6), 0.0)
    torch.save(state.state_dict(), tmp_path / "s.pt")
    other = _state(rule="adam")
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(other.params, state.params) and other.version == 1


@pytest.mark.parametrize("text, parsed", [("async", ("async", 0)), ("ssp:3", ("ssp", 3)),
                                          ("sync", ("sync", 0))])
def test_parse_consistency(text, parsed):
    assert parse_consistency(text) == parsed


@pytest.mark.parametrize("text", ["ssp", "ssp:-1", "ssp:x", "bsp"])
def test_bad_consistency_is_a_clear_error(text):
    from asyncsgd.errors import ConfigError
    with pytest.raises(ConfigError, match="async, ssp:K"):
        parse_consistency(text)


def test_backup_workers_apply_the_first_pushes_of_each_round_and_drop_the_late():
    """--backup-workers 1 of 3, sum reduce: each round is the sum of the first two pushes
    to reach the shard; the third, computed on the round's starting version, comes after
    it: acknowledged as stale, counted, never applied. 30 rounds in seeded arrival orders."""
    rng = random.Random(5)
    state = _state("sync", workers=3, sync_reduce="sum", backup_workers=1)
    expected = state.params.clone()
    names = ["a", "b", "c"]
    for name in names:
        state.handle(name.encode(), _pull(name, 1), 0.0)
    seqs = dict.fromkeys(names, 1)
    for _ in range(30):
        version = state.version
        for i, name in enumerate(rng.sample(names, 3)):
            seqs[name] += 1
            grad = torch.tensor([float(rng.randint(-3, 3)) for _ in range(6)])
            out = state.handle(name.encode(), _push(name, seqs[name], grad, clock=version), 0.0)
            if i < 2:
                expected -= grad
                assert state.version == version + i, "the round waited for the backup worker"
                if i == 1:
                    assert sorted(r.meta[Key.APPLIED] for _, r in out) == [True, True]
            else:
                (_, ack), = out
                assert ack.meta == {Key.APPLIED: False, Key.STALE: True}, ack
        assert torch.equal(state.params, expected)
    assert (state.counters["updates"], state.counters["stale"]) == (30, 30)
