"""The same-host path (asyncsgd/wire/shared.py, PROTOCOL.md "Same host"): areas are sealed,
tagged and checked; a header naming an area is decoded as strictly as frames; a live
server admits only members to areas, applies pushes through them exactly, refuses bad
ones, keeps a bounded number, and a worker whose area went falls back to frames.
SGD with lr 1 from zeros: every weight equals minus the sum of the applied pushes.
"""

import contextlib
import os

import msgpack
import pytest
import torch

from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import (ATTACH, ERROR, PUSH, VERSION, Key, Message, ProtocolError,
                                    Segment, decode, encode)
from asyncsgd.wire.shared import Area, Areas, AreaUnavailable, supported
from asyncsgd.servers.evaluator import _TrainFeed
from conftest import shard_stats
from faults import observe
from tasks_for_tests import index_counter
from test_exactly_once import Peer, applied, grad
from asyncsgd.workers.client import PSClient

pytestmark = pytest.mark.skipif(not supported(), reason="no sealed memory files (memfd) here")

TASK = "tasks_for_tests:index_counter"
SIZE = 16


def test_an_area_is_sealed_tagged_and_checked():
    area = Area.create(link=3, elements=1000, worker="w", incarnation=1)
    try:
        mine = Area.open(os.getpid(), area.fd, 3, 1000, area.tag)
        mine.grads[:] = torch.arange(1000.0)
        assert torch.equal(area.grads, torch.arange(1000.0)), "one memory, seen from both maps"
        area.params.fill_(2.5)
        assert torch.equal(mine.params, torch.full((1000,), 2.5))
        assert area.grads.data_ptr() + 4 * 1000 <= area.params.data_ptr(), "slots overlap"
        fd = os.open(f"/proc/{os.getpid()}/fd/{area.fd}", os.O_RDWR)
        try:  # a peer cannot truncate the file under the shard (a SIGBUS there)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)
        finally:
            os.close(fd)
        with pytest.raises(AreaUnavailable, match="tag"):
            Area.open(os.getpid(), area.fd, 3, 1000, b"\x00" * 16)
        with pytest.raises(AreaUnavailable, match="bytes"):
            Area.open(os.getpid(), area.fd, 3, 999_999, area.tag)
        with pytest.raises(AreaUnavailable, match="cannot open"):
            Area.open(os.getpid(), 10_000, 3, 1000, area.tag)
    finally:
        area.close()


def test_area_headers_are_decoded_as_strictly_as_frames():
    slot = torch.zeros(8)
    header = {"v": VERSION, "t": PUSH, "w": "w", "i": 1, "s": 9, "c": 0, "sh": 0, "m": {},
              "x": 5, "d": [[2, "float32", [4]]]}

    def mine(link, worker, incarnation):
        return slot if (link, worker, incarnation) == (5, "w", 1) else None

    def code(frames, areas=mine):
        with pytest.raises(ProtocolError) as err:
            decode(frames, areas)
        assert err.value.seq == 9, "the error echoes the request"
        return err.value.code

    msg = decode([msgpack.packb(header)], mine)
    slot[2:6] = 7.0
    assert msg.segments[0].offset == 2 and torch.equal(msg.segments[0].data, torch.full((4,), 7.))
    assert code([msgpack.packb(header)], None) == "no-links"
    assert code([msgpack.packb({**header, "x": 6})]) == "unknown-link"
    assert code([msgpack.packb({**header, "w": "other"})]) == "unknown-link"
    assert code([msgpack.packb({**header, "x": -1})]) == "bad-field"
    assert code([msgpack.packb({**header, "x": "5"})]) == "bad-field"
    assert code([msgpack.packb({**header, "d": [[6, "float32", [4]]]})]) == "bad-descriptor"
    assert code([msgpack.packb({**header, "d": [[0, "float32", [2, 2]]]})]) == "bad-descriptor"
    assert code([msgpack.packb({**header, "d": [[0, "float32", [0]]]})]) == "bad-descriptor"
    assert code([msgpack.packb({**header, "d": [[0, "float64", [2]]]})]) == "bad-dtype"
    assert code([msgpack.packb(header), b"\x00" * 16]) == "frame-count"
    frames = encode(Message(type=PUSH, seq=1, segments=[Segment(1, torch.ones(3))]),
                    local=(5, slot))
    assert len(frames) == 1 and torch.equal(slot[1:4], torch.ones(3)), "written, not framed"


def test_an_area_counts_the_bytes_it_moved_and_frames_are_not_counted():
    """What crosses no socket is counted where it moves: a push decoded from an area, a
    reply written into one; a framed push, whose bytes the wire counts, is not."""
    areas = Areas(elements=8, limit=2)
    area = areas.attach("w", 1, b"peer")
    try:
        def push(**local):
            return encode(Message(type=PUSH, worker="w", incarnation=1, seq=1,
                                  segments=[Segment(2, torch.ones(4))]), **local)

        areas.received(decode(push(local=(area.link, area.grads)), areas.grads_of, b"peer"))
        assert areas.moved == 4 * 4
        areas.received(decode(push(), areas.grads_of, b"peer"))
        assert areas.moved == 4 * 4, "a framed push is the wire's to count"
        areas.sent(Message(type="params", segments=[Segment(0, torch.zeros(8))]))
        assert areas.stats()["area_bytes"] == 4 * 4 + 4 * 8
    finally:
        areas.close()


def test_the_server_adds_up_every_shards_area_bytes_across_restarts_and_resumes():
    class Recorder:
        samples_offset, shared_offset, shared_bytes = 0, 10, None  # 10: before a resume

    feed = _TrainFeed(Recorder())
    feed.shared([{"area_bytes": 100}, {"area_bytes": 50}])
    assert feed.recorder.shared_bytes == 10 + 100 + 50
    feed.shared([{"area_bytes": 200}, {"area_bytes": 5}])  # shard 1 restarted from 0
    assert feed.recorder.shared_bytes == 10 + 200 + 50 + 5


def _attach(peer: Peer, seq: int, token=None) -> Message:
    peer.send(ATTACH, seq, token=token)
    return peer.reply()


def _push_through(peer: Peer, area: Area, seq: int, g: torch.Tensor) -> Message:
    """A push whose gradient is in ``area`` and whose header alone crosses the socket."""
    peer.sock.send_multipart(encode(Message(
        type=PUSH, worker=peer.worker, incarnation=peer.incarnation, seq=seq, shard=0,
        segments=[Segment(0, g)], token=peer.token(peer.incarnation)),
        local=(area.link, area.grads)))
    return peer.reply()


def test_members_push_exactly_through_their_area_and_nothing_else_gets_in(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    member, other, ghost = (Peer(srv, port, worker=w) for w in ("a", "b", "ghost"))
    refused = _attach(ghost, 1, token="0" * 32)
    assert refused.type == ERROR and refused.meta[Key.CODE] == "unknown-worker", refused
    reply = _attach(member, 2)
    assert reply.type == ATTACH and reply.seq == 2 and reply.shard == 0, reply
    m = reply.meta
    area = Area.open(m[Key.PID], m[Key.FD], m[Key.LINK], m[Key.ELEMENTS], bytes.fromhex(m[Key.TAG]))
    assert area.elements == SIZE
    assert applied(_push_through(member, area, 3, grad(1, 2, 3)))
    bad = grad(1)
    bad[5] = float("nan")
    nonfinite = _push_through(member, area, 4, bad)
    assert nonfinite.type == ERROR and nonfinite.meta[Key.CODE] == "non-finite", nonfinite
    stolen = _push_through(other, area, 5, grad(100))  # b names a's area: refused
    assert stolen.type == ERROR and stolen.meta[Key.CODE] == "unknown-link", stolen
    assert applied(member.push(6, grad(0, 0, 0, 4)))  # frames still work beside the area
    assert torch.equal(observe(srv, port, SIZE), -grad(1, 2, 3, 4))
    member.send("bye", 7)
    assert member.reply().type == "bye"
    assert shard_stats(srv, port)["areas"] == 0, "a worker's goodbye frees its area"
    gone = _push_through(member, area, 8, grad(9))
    assert gone.type == ERROR and gone.meta[Key.CODE] == "unknown-link", gone
    assert torch.equal(observe(srv, port, SIZE), -grad(1, 2, 3, 4))
    assert srv.proc.poll() is None


def test_areas_are_bounded_and_an_evicted_worker_falls_back_to_frames(server):
    """--workers 1: a shard keeps 8 areas. Ten workers attach; the first ones lose theirs,
    their next pushes go as frames and attach again, and every push lands exactly once."""
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done", "--workers", 1)
    port = srv.stats()["shard_ports"][0]
    signature = Layout.of(index_counter(SIZE).build_model(0)).signature()
    params, total = torch.zeros(SIZE), torch.zeros(SIZE)
    with contextlib.ExitStack() as clients_open:  # each says bye as it closes
        clients = [clients_open.enter_context(PSClient(
            srv.address, f"w{k}", signature, rank=k, world=10, heartbeat=0.5, server_timeout=20,
            transport="shared")) for k in range(10)]
        for step in range(2):
            for k, client in enumerate(clients):
                g = grad(*[float(k + step + 1)] * (k + 1))
                client.push_pull(g, params)
                total += g
                assert torch.equal(params, -total), (step, k)
        stats = shard_stats(srv, port)
        assert stats["areas"] == 8 and stats["areas_evicted"] >= 2, stats
        assert stats["areas_made"] > 10, "evicted workers attached again"
        assert stats["pushes"] == 20 and stats["updates"] == 20, stats
    assert shard_stats(srv, port)["live_workers"] == 0
    assert torch.equal(observe(srv, port, SIZE), -total)


def test_acks_of_pushes_through_areas_say_applied(server):
    """A push whose pull flag asks for the parameters gets them through the area too."""
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port, worker="p")
    m = _attach(peer, 1).meta
    area = Area.open(m[Key.PID], m[Key.FD], m[Key.LINK], m[Key.ELEMENTS], bytes.fromhex(m[Key.TAG]))
    peer.sock.send_multipart(encode(Message(
        type=PUSH, worker="p", incarnation=1, seq=2, shard=0, meta={Key.PULL: True},
        segments=[Segment(0, grad(5, 6))], token=peer.token(1)), local=(area.link, area.grads)))
    raw = peer.sock.recv_multipart()
    assert len(raw) == 1, "the parameters came through the area, not as frames"
    reply = decode(raw, lambda link, w, i: area.params if link == area.link else None)
    assert reply.type == "params" and reply.meta[Key.ACK][Key.APPLIED] is True, reply
    assert torch.equal(reply.segments[0].data, -grad(5, 6))
