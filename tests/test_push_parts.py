"""Pushes larger than one frame travel in parts; each part is checked on arrival, and the
push is still applied whole or not at all."""

import json

import pytest
import torch

from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import ACK, ERROR, PARAMS, PUSH, STATS, Message, encode, in_parts, split
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.servers.store import ParamStore
from asyncsgd.servers.zero_copy import ZeroCopyStore
from tasks_for_tests import index_counter
from asyncsgd.workers.client import PSClient, ServerRefused

SIZE = 12


def _state(store=ParamStore, **kw):
    cfg = ShardConfig(index=0, start=0, end=SIZE, lr=1.0, heartbeat_timeout=5.0, **kw)
    return ShardState(cfg, torch.arange(SIZE, dtype=torch.float32) * 10, store=store)


def _parts(grad, seq=1, worker="w", pull=False, clock=0):
    """The push of ``grad`` as the client sends it, in frames of 4 elements (3 parts)."""
    whole = Message(type=PUSH, worker=worker, incarnation=1, seq=seq, clock=clock, shard=0,
                    meta={"loss": 2.0, "samples": 8, **({"pull": True} if pull else {})},
                    segments=split(torch.as_tensor(grad, dtype=torch.float32), frame_bytes=16))
    return in_parts(whole)


def test_a_push_in_parts_is_applied_once_when_its_last_part_arrives():
    state = _state()
    start = state.params.clone()
    grad = torch.randint(-5, 6, (SIZE,)).float()
    first, second, last = _parts(grad, pull=True)
    assert state.handle(b"a", first, 0.0) == [] and state.handle(b"a", second, 0.0) == []
    assert state.version == 0 and torch.equal(state.params, start)
    (_, reply), = state.handle(b"a", last, 0.0)
    assert reply.type == PARAMS and reply.meta["ack"]["applied"]
    assert torch.equal(state.params, start - grad) and state.version == 1
    assert state.counters["pushes"] == 1 and state.train["w"] == [2.0, 1, 8]
    (_, again), = [r for p in _parts(grad) for r in state.handle(b"a", p, 0.0)]
    assert again.type == ACK and again.meta["duplicate"], "a re-sent push applies once"
    assert torch.equal(state.params, start - grad)


def test_a_bad_part_refuses_the_whole_push_with_one_error():
    state = _state()
    start = state.params.clone()
    grad = torch.ones(SIZE)
    grad[5] = float("nan")  # in the second part
    replies = [r for p in _parts(grad) for r in state.handle(b"a", p, 0.0)]
    assert [(r.type, r.meta["code"]) for _, r in replies] == [(ERROR, "non-finite")]
    assert torch.equal(state.params, start) and state.version == 0
    assert state.counters["nonfinite"] == 1 and not state.streams.open
    (_, ok), = [r for p in _parts(torch.ones(SIZE)) for r in state.handle(b"a", p, 0.0)]
    assert ok.type == ACK and ok.meta["applied"], "the refused push was not remembered as applied"
    assert torch.equal(state.params, start - 1)


@pytest.mark.parametrize("order", [[1, 2], [0, 2], [0, 1, 1]])
def test_parts_out_of_order_are_refused_and_nothing_is_applied(order):
    state = _state()
    start = state.params.clone()
    parts = _parts(torch.ones(SIZE))
    replies = [r for j in order for _, r in state.handle(b"a", parts[j], 0.0)]
    assert replies and all(r.type == ERROR and r.meta["code"] == "bad-field" for r in replies)
    assert "part 0" in replies[0].meta["error"]
    assert torch.equal(state.params, start) and state.version == 0


def test_part_numbers_that_are_not_numbers_are_refused():
    state = _state()
    part = _parts(torch.ones(SIZE))[0]
    part.meta["parts"] = "three"
    (_, reply), = state.handle(b"a", part, 0.0)
    assert reply.type == ERROR and reply.meta["code"] == "bad-field"
    assert not state.streams.open


def test_unfinished_pushes_are_bounded_and_expire():
    state = _state(expected_workers=1)
    bound = state.streams.max_open
    for w in range(bound + 5):
        assert state.handle(b"a", _parts(torch.ones(SIZE), worker=f"w{w}")[0], 0.0) == []
    assert len(state.streams.open) == bound and "w0" not in state.streams.open
    first = _parts(torch.ones(SIZE), seq=1, worker="x")
    state.handle(b"a", first[0], 0.0)
    fresh = _parts(torch.full((SIZE,), 2.0), seq=2, worker="x")  # a new push replaces it
    replies = [r for p in fresh for r in state.handle(b"a", p, 0.0)]
    assert [r.type for _, r in replies] == [ACK]
    assert torch.equal(state.params, torch.arange(SIZE, dtype=torch.float32) * 10 - 2)
    state.tick(10.0)  # past the heartbeat timeout
    assert not state.streams.open


@pytest.mark.parametrize("transport,early", [("tcp", "off"), ("tcp", "on"), ("shared", "on")])
def test_large_pushes_in_parts_through_a_real_server_are_exact(server, transport, early):
    """2.2M parameters on two shards: over TCP, each shard's push and reply go in two
    4 MiB parts (with --early-parts on, applied as they arrive, the reply sent from the
    buffer swapped in); through shared memory, in each worker's area. Exact either way."""
    rows = 2_200_000
    srv = server("--task", "tasks_for_tests:index_counter", "--samples", rows, "--shards", 2,
                 "--eval-every", 1000, "--early-parts", early)
    layout = Layout.of(index_counter(rows).build_model())
    params = torch.full((layout.total,), 7.0)
    total = torch.zeros(layout.total)
    with PSClient(srv.address, "w", layout.signature(), rank=0, world=1, heartbeat=0.5,
                  server_timeout=20, transport=transport) as client:
        assert [a is not None for a in client.areas] == [transport == "shared"] * 2
        for step in range(3):
            grad = torch.randint(-4, 5, (layout.total,)).float()
            client.push_pull(grad, params)
            total += grad
            assert torch.equal(params, -total), f"step {step}: parameters are not exact"
        bad = torch.ones(layout.total)
        bad[-5] = float("inf")  # in the last part of the second shard
        with pytest.raises(ServerRefused, match="NaN or Inf"):
            client.push_pull(bad, params)
        client.push_pull(None, params)
        mid = client.ranges[1][0]  # shards are independent: the first took its slice
        assert torch.equal(params[:mid], -total[:mid] - 1)
        assert torch.equal(params[mid:], -total[mid:]), "a refused push changed the parameters"
        # asked before the client's goodbye, which ends the run (its only worker left)
        shards = [srv.request(encode(Message(type=STATS, seq=1)), port=port).meta
                  for port in srv.stats()["shard_ports"]]
    assert [s["pushes"] for s in shards] == [4, 3] and [s["nonfinite"] for s in shards] == [0, 1]
    srv.proc.wait(60)  # the client's goodbye ended the run: its summary sums the shards
    summary = json.loads((srv.out / "summary.json").read_text())
    if (transport, early) == ("tcp", "on"):  # the refused push was undone on shard 1
        assert [(s["early_pushes"], s["early_undone"]) for s in shards] == [(4, 0), (3, 1)]
        assert summary["early_parts"] == {"pushes": 7, "undone": 1}
    else:
        assert [s["early_pushes"] for s in shards] == [0, 0]
        assert "early_parts" not in summary
    assert [s["areas_made"] for s in shards] == [int(transport == "shared")] * 2
    # through the areas: each shard's slice in 4 pushes (the refused one too) and out in
    # its replies' parameters (5 on shard 0, 4 on shard 1, which refused one); none on TCP
    sizes = [end - start for start, end in client.ranges]
    assert [s["area_bytes"] for s in shards] == (
        [4 * sizes[0] * (4 + 5), 4 * sizes[1] * (4 + 4)] if transport == "shared" else [0, 0])


def test_a_deferred_update_goes_part_by_part_and_equals_the_immediate_one():
    """The shard process applies part j of an update just before sending part j of the
    reply; the result is bit for bit the update applied at once (Adam: one step a push)."""
    now, later = _state(rule="adam"), _state(store=ZeroCopyStore, rule="adam")
    start = later.params.clone()
    for seq in (1, 2):
        grad = torch.randn(SIZE)
        whole = Message(type=PUSH, worker="w", incarnation=1, seq=seq, clock=seq - 1, shard=0,
                        meta={"pull": True}, segments=split(grad, frame_bytes=16))
        (_, expected), = now.handle(b"a", whole, 0.0)
        (_, reply), = later.handle(b"a", whole, 0.0)
        assert reply.type == PARAMS and reply.meta == expected.meta
        if seq == 1:
            buffer = later.store.buffer  # as the shard process sends it: pending not applied
            assert torch.equal(buffer, start), "nothing is applied before it is sent"
            later.store.apply_pending(until=4)
            assert torch.equal(buffer[:4], now.params[:4])
            assert torch.equal(buffer[4:], start[4:])
    assert torch.equal(later.params, now.params) and later.rule.steps == now.rule.steps == 2
    for key, value in now.rule.state.items():
        assert torch.equal(later.rule.state[key], value)


def test_a_push_accounted_after_its_reply_is_still_applied_exactly_once():
    """With ``settle_later`` (the shard process's way: the reply goes out first), the push
    is accounted before the shard looks at anything else: a re-send right after it is a
    duplicate, and stats and checkpoints count it."""
    cfg = ShardConfig(index=0, start=0, end=SIZE, lr=1.0, heartbeat_timeout=5.0)
    state = ShardState(cfg, torch.zeros(SIZE), store=ZeroCopyStore, settle_later=True)
    push = Message(type=PUSH, worker="w", incarnation=1, seq=7, clock=0, shard=0,
                   meta={"loss": 2.0, "samples": 8, "pull": True},
                   segments=split(torch.ones(SIZE)))
    (_, reply), = state.handle(b"a", push, 0.0)
    assert reply.type == PARAMS and reply.meta["ack"]["applied"] and state.version == 1
    assert state.counters["pushes"] == 0, "not yet accounted: the caller settles after sending"
    again = Message(type=PUSH, worker="w", incarnation=1, seq=7, clock=0, shard=0,
                    meta={"pull": True}, segments=split(torch.ones(SIZE)))
    (_, dup), = state.handle(b"a", again, 0.0)
    assert dup.meta["ack"]["duplicate"] and state.version == 1
    assert torch.equal(state.params, -torch.ones(SIZE)), "the re-sent push applied once"
    stats = state.stats(0.0)
    assert stats["pushes"] == 1 and stats["staleness"][0] == 1 and stats["duplicates"] == 1
    assert state.train["w"] == [2.0, 1, 8]
    state.handle(b"a", Message(type=PUSH, worker="w", incarnation=1, seq=8, clock=1, shard=0,
                               meta={"pull": True}, segments=split(torch.ones(SIZE))), 0.0)
    assert state.state_dict()["dedupe"]["w"][3] == [7, 8], "a checkpoint holds the last push"
