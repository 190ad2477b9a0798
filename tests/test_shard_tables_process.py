"""Row-sparse tables on a live ps-server (ctr, its 26 tables served by row): sparse pulls, and
exactly once across a shard SIGKILL under sync, where rows apply at once and the dense part at
its round. Hand-made peers written from PROTOCOL.md (test_exactly_once.Peer); SGD with lr 1,
so every row must equal its start minus exactly the rows pushed and acknowledged, once each.
"""

import os
import signal
import time

import torch

from asyncsgd.wire.protocol import PARAMS, PULL, PUSH, Message, Rows, Segment, encode
from asyncsgd.wire.sparse import ids_segment, rows_segment
from conftest import shard_stats, wait_for
from test_exactly_once import Peer, applied

CTR = ("--task", "ctr:rows=1000", "--samples", 2000, "--lr", 1, "--shards", 1)


def observe(srv, port, asked):
    """(dense slice, [rows of each ids asked]) by an observer pull."""
    segments = [ids_segment(t, torch.tensor(ids, dtype=torch.int64)) for t, ids in asked]
    reply = srv.request(encode(Message(type=PULL, seq=1, meta={"observer": True},
                                       segments=segments)), port=port)
    assert reply.type == PARAMS, reply
    dense = torch.cat([s.data for s in reply.segments if type(s.data) is not Rows])
    rows = [s.data for s in reply.segments if type(s.data) is Rows]
    assert [(r.table, r.ids.tolist()) for r in rows] == [(t, ids) for t, ids in asked]
    return dense.clone(), [r.values.clone() for r in rows]


def send_push(peer, seq, dense, rows, clock=0):
    segments = [Segment(0, dense)] + [rows_segment(t, torch.tensor(ids), g) for t, ids, g in rows]
    peer.sock.send_multipart(encode(Message(
        type=PUSH, worker=peer.worker, seq=seq, clock=clock, shard=0,
        incarnation=peer.incarnation, segments=segments,
        token=peer.token(peer.incarnation))))


def test_sparse_pulls_and_rows_survive_a_shard_sigkill_in_a_sync_round(server):
    srv = server(*CTR, "--no-exit-when-done", "--workers", 2, "--consistency", "sync",
                 "--checkpoint-every", 0.3, "--heartbeat-timeout", 120)
    port = srv.stats()["shard_ports"][0]
    asked = [(0, [3, 500, 999]), (25, [0, 3])]
    dense0, rows0 = observe(srv, port, asked)
    a, b = Peer(srv, port, worker="a"), Peer(srv, port, worker="b")
    a.send(PULL, 1)
    b.send(PULL, 1)
    assert a.reply().type == b.reply().type == "params"
    gen = torch.Generator().manual_seed(0)
    ga, gb = torch.randn(len(dense0), generator=gen), torch.randn(len(dense0), generator=gen)
    ra = [(0, [3, 500], torch.full((2, 16), 2.0)), (25, [3], torch.full((1, 16), 0.5))]
    rb = [(0, [500, 999], torch.full((2, 16), 4.0))]
    send_push(a, 2, ga, ra)
    assert a.reply(1.0) is None  # the dense part waits for b's push ...
    _, rows = observe(srv, port, asked)
    assert torch.equal(rows[0][0], rows0[0][0] - 2.0)  # ... its rows do not
    send_push(a, 2, ga, ra)  # a retry of the waiting push: its rows are not applied again
    assert a.reply(1.0) is None
    pushed = time.time()
    checkpoint = srv.out / "shard-0.pt"
    wait_for(lambda: checkpoint.exists() and checkpoint.stat().st_mtime > pushed + 0.1, 60,
             "a checkpoint taken while a's push waits")
    pid = shard_stats(srv, port)["pid"]
    os.kill(pid, signal.SIGKILL)

    def restarted():
        try:
            return shard_stats(srv, port)["pid"] != pid
        except TimeoutError:
            return False
    wait_for(restarted, 60, "the restarted shard", 0.2)
    a.close()
    a = Peer(srv, port, worker="a")  # the worker reconnects and re-sends what is outstanding
    send_push(a, 2, ga, ra)
    assert a.reply(1.0) is None  # in the restored shard's round; its rows were checkpointed
    send_push(b, 2, gb, rb)
    acks = [a.reply(), b.reply()]
    assert all(r is not None and applied(r) for r in acks), acks
    dense, rows = observe(srv, port, asked)
    assert torch.allclose(dense, dense0 - (ga + gb) / 2, atol=1e-6)
    expect = [rows0[0].clone(), rows0[1].clone()]
    expect[0][0] -= 2.0                    # id 3: a's, once
    expect[0][1] = expect[0][1] - 2.0 - 4.0  # id 500: a's then b's, once each
    expect[0][2] -= 4.0                    # id 999: b's
    expect[1][1] -= 0.5                    # table 25, id 3: a's
    assert torch.equal(rows[0], expect[0]) and torch.equal(rows[1], expect[1])
    stats = shard_stats(srv, port)
    assert stats["updates"] == 1 and stats["lost_updates"] == 0
    assert stats["rows_pushed"] == 5 and stats["tables"]["tables.0.weight"]["rows"] == 1000
