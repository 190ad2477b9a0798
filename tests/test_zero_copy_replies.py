"""Parameters sent without copying are never torn by a later update (real zmq sockets)."""

import signal
import subprocess
import sys
import time
import weakref

import numpy
import pytest
import torch
import zmq

from asyncsgd.wire.protocol import PULL, PUSH, Message, Segment, split
from asyncsgd.wire.transport import (Reading, dealer, recv, recv_from, router, send,
                                     shared_frames)
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.servers.shard_process import _reply
from asyncsgd.servers.zero_copy import InFlight, ZeroCopyStore

SIZE = 4 * 2 ** 20  # 16 MiB of float32: more than the loopback socket buffers hold


def _shard():
    state = ShardState(ShardConfig(index=0, start=0, end=SIZE, lr=1.0),
                       torch.arange(SIZE, dtype=torch.float32), store=ZeroCopyStore)
    return state, state.store.inflight


def _pull(seq, worker="w"):
    return Message(type=PULL, worker=worker, incarnation=1, seq=seq, shard=0)


def _push(seq, value, clock, worker="w"):
    return Message(type=PUSH, worker=worker, incarnation=1, seq=seq, clock=clock, shard=0,
                   segments=split(torch.full((SIZE,), float(value))))


# A peer in its own process that says hello, is then stopped (SIGSTOP: its libzmq
# reads nothing, so the reply stays in flight), and once continued prints what it got.
PEER = """
import sys, torch, zmq
from asyncsgd.wire.protocol import decode, parts_of
ctx = zmq.Context(); sock = ctx.socket(zmq.DEALER); sock.connect(sys.argv[1]); sock.send(b"x")
print("hello", flush=True)
pieces, parts = {}, 1
while len(pieces) < parts:
    assert sock.poll(60000)
    msg = decode(sock.recv_multipart(copy=False))
    part, parts = parts_of(msg)
    pieces[msg.segments[0].offset] = msg.segments[0].data.clone()
flat = torch.cat([pieces[k] for k in sorted(pieces)])
print(msg.meta["version"], parts, len(flat), repr(flat.double().sum().item()), flush=True)
sock.close(0); ctx.term()
"""


@pytest.mark.processes
def test_update_during_a_zero_copy_send_moves_to_a_copy_and_the_reply_stays_whole():
    state, inflight = _shard()
    expected_old = torch.arange(SIZE, dtype=torch.float32)
    ctx = zmq.Context()
    server, endpoint = router(ctx, "tcp://127.0.0.1:0")
    peer_proc = subprocess.Popen([sys.executable, "-c", PEER, endpoint], stdout=subprocess.PIPE,
                                 text=True)
    try:
        assert peer_proc.stdout.readline().strip() == "hello"
        assert server.poll(20000)
        slow, _ = recv_from(server)
        peer_proc.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        sent_from = state.params
        for to, reply in state.handle(slow, _pull(1), time.monotonic()):
            _reply(server, state, to, reply)
        time.sleep(0.5)
        assert inflight.zero_copy(sent_from) and inflight.sends, \
            "a stopped peer cannot have taken a 16 MiB reply"
        for to, reply in state.handle(b"other", _push(1, 1, state.version, "v"),
                                      time.monotonic()):
            _reply(server, state, to, reply)
        assert state.params is not sent_from, "the update must not write the buffer being sent"
        assert inflight.copies == 1
        assert torch.equal(state.params, expected_old - 1)
        peer_proc.send_signal(signal.SIGCONT)
        out, _ = peer_proc.communicate(timeout=60)
        assert peer_proc.returncode == 0
        version, parts, numel, total = out.split()
        assert (int(version), int(parts), int(numel)) == (0, 4, SIZE), "4 parts of 4 MiB"
        assert float(total) == expected_old.double().sum().item(), "the reply was torn"
        # Once the send is done, updates write in place again: no more copies.
        deadline = time.monotonic() + 10
        while inflight.sends and time.monotonic() < deadline:
            inflight.writable(state.params)
            time.sleep(0.01)
        assert not inflight.sends, "the peer read the whole reply: no send may still hold it"
        current = state.params
        state.handle(b"other", _push(2, 2, state.version, "v"), time.monotonic())
        assert state.params is current and inflight.copies == 1
        assert torch.equal(state.params, expected_old - 3)
    finally:
        if peer_proc.poll() is None:
            peer_proc.send_signal(signal.SIGCONT)
            peer_proc.kill()
            peer_proc.wait(10)
        server.close(0)
        ctx.term()


def test_pinned_buffers_are_bounded_and_replies_fall_back_to_copies():
    inflight = InFlight(max_buffers=2)
    params = torch.zeros(8)

    class Pending:
        done = False

    inflight.sent(params, Pending())
    assert inflight.zero_copy(params), \
        "sending again from a buffer already in flight pins nothing new"
    moved = inflight.writable(params)
    assert moved is not params and torch.equal(moved, params)
    assert not inflight.zero_copy(moved), "a second pinned buffer would exceed max_buffers"


def test_in_parts_splits_a_reply_and_parts_of_checks_the_numbers():
    import pytest

    from asyncsgd.wire.protocol import PARAMS, ProtocolError, decode, encode, in_parts, parts_of
    whole = Message(type=PARAMS, seq=7, shard=1, clock=3,
                    meta={"version": 3, "ack": {"applied": True}},
                    segments=split(torch.arange(10.0), frame_bytes=16))
    parts = [decode(encode(m)) for m in in_parts(whole)]
    assert [parts_of(m) for m in parts] == [(0, 3), (1, 3), (2, 3)]
    assert [m.seq for m in parts] == [7, 7, 7]
    assert "ack" in parts[0].meta and all("ack" not in m.meta for m in parts[1:])
    assert torch.equal(torch.cat([m.segments[0].data for m in parts]), torch.arange(10.0))
    assert parts_of(Message(type=PARAMS)) == (0, 1)
    for meta in ({"part": 3, "parts": 3}, {"part": -1, "parts": 2}, {"part": "0", "parts": 2},
                 {"part": 0, "parts": 10 ** 9}):
        with pytest.raises(ProtocolError):
            parts_of(Message(type=PARAMS, meta=meta))


def _sending(store):
    """Mark ``store``'s buffer as read by a send still in flight: a ``Reading`` of an object
    held here, as pyzmq holds a sent frame's; returns what ends the send (drops it)."""
    held = [numpy.empty(1)]
    store.inflight.sent(store.buffer, Reading([weakref.ref(held[0])]))
    return held.clear


def test_an_update_of_a_buffer_being_sent_writes_the_exact_result_elsewhere_in_one_pass():
    """An update (SGD's fused path, and Momentum's copy-then-apply) of parameters a reply
    still reads leaves that buffer untouched and writes exactly what the update in place
    would have to another one; deferred, part by part: the segments up to the part being
    sent and the elements no segment covers (copied), nothing later."""
    from asyncsgd.servers.rules import make_rule

    size = 1000
    segments = [(700, torch.linspace(-3, 3, 300)), (0, torch.linspace(5, -1, 200)),
                (300, torch.full((100,), 0.25))]  # [200, 300) and [400, 700) are not pushed
    for name, hyper in (("sgd", {}), ("sgd", {"weight_decay": 0.01}), ("momentum", {})):
        start = torch.randn(size, generator=torch.Generator().manual_seed(0))
        store = ZeroCopyStore(start.clone(), make_rule(name, size, 0.1, **hyper))
        reference = make_rule(name, size, 0.1, **hyper)
        expected = start.clone()
        for step in range(2):  # the second step also reads the rule's state (momentum)
            reference.apply(expected, segments, lr_scale=0.5)
            sent_from = store.buffer
            before = sent_from.clone()
            released = _sending(store)
            store.update(segments, lr_scale=0.5, deferrable=True)
            assert store.buffer is not sent_from and store.inflight.copies == step + 1
            store.apply_pending(until=250)  # a reply part ending at element 250
            assert torch.equal(store.buffer[:250], expected[:250]), (name, hyper)
            store.apply_pending(until=650)
            assert torch.equal(store.buffer[:650], expected[:650]), (name, hyper)
            assert torch.equal(sent_from, before), "the buffer being sent was written"
            assert torch.equal(store.params, expected), (name, hyper)
            released()
    # Not deferrable: applied at once.
    store = ZeroCopyStore(torch.zeros(4), make_rule("sgd", 4, 1.0))
    sent_from = store.buffer
    release = _sending(store)  # (the send goes on while this is held)
    store.update([(0, torch.ones(4))], deferrable=False)
    assert store._pending is None and torch.equal(store.buffer, -torch.ones(4))
    assert torch.equal(sent_from, torch.zeros(4))
    release()


@pytest.mark.processes
def test_shared_gradient_frames_carry_each_sends_values_and_are_copied_when_asked():
    """``shared_frames`` (a worker's gradient segments, sent as zmq.Frames made once):
    every push over TCP carries the buffer's values at its send; a small or strided
    (copied) segment is left as it was; and a send asked to copy does copy (over
    inproc, where an uncopied message is the sender's memory itself)."""
    grads = torch.zeros(2 ** 17)  # 512 KiB: sent uncopied
    segments = shared_frames(split(grads))
    assert type(segments[0].wire[1]) is zmq.Frame
    small = shared_frames([Segment(0, torch.zeros(10))])[0]
    strided = shared_frames([Segment(0, torch.zeros(2 ** 18)[::2])])[0]
    assert type(small.wire[1]) is not zmq.Frame and strided.wire is None
    ctx = zmq.Context()
    server, endpoint = router(ctx, "tcp://127.0.0.1:0")
    client = dealer(ctx, endpoint)
    pair_out, pair_in = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for step in range(3):
            grads.fill_(step)
            assert send(client, Message(type=PUSH, worker="w", seq=step, segments=segments),
                        copy=False)
            assert server.poll(20000)
            _, got = recv_from(server)  # (the buffer is left alone until then, as a worker's)
            assert got.seq == step and torch.equal(got.segments[0].data, grads)
        pair_in.bind("inproc://shared-frames")
        pair_out.connect("inproc://shared-frames")
        for copy, expected in ((True, 3.0), (False, 4.0)):
            grads.fill_(3)
            assert send(pair_out, Message(type=PUSH, worker="w", segments=segments), copy=copy)
            grads.fill_(4)  # after the send: seen through an uncopied message only
            assert pair_in.poll(20000)
            got = recv(pair_in).segments[0].data
            assert torch.equal(got, torch.full_like(grads, expected)), f"copy={copy}"
    finally:
        for sock in (server, client, pair_out, pair_in):
            sock.close(0)
        ctx.term()
