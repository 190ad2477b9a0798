"""Row-sparse tables on a live ps-server (ctr, its 26 tables served by row): sparse pulls, and
exactly once across a shard SIGKILL under sync, where rows apply at once and the dense part at
its round, and under async, the shard killed between a push's apply and its ack. Hand-made
peers written from PROTOCOL.md (test_exactly_once.Peer); SGD with lr 1, so every row must
equal its start minus exactly the rows pushed and acknowledged, once each.
"""

import time

import pytest
import torch

from asyncsgd.run.kill_at import APPLIED_UNACKED, VARIABLE
from asyncsgd.wire.protocol import PARAMS, PULL, PUSH, Key, Message, Rows, Segment, encode
from asyncsgd.wire.sparse import ids_segment, rows_segment
from conftest import Server, finish, read_json, shard_stats, wait_for, worker
from test_exactly_once import Peer, applied, kill_shard, restarted

CTR = ("--task", "ctr:rows=1000", "--samples", 2000, "--lr", 1, "--shards", 1)


def observe(srv, port, asked):
    """(dense slice, [rows of each ids asked]) by an observer pull."""
    segments = [ids_segment(t, torch.tensor(ids, dtype=torch.int64)) for t, ids in asked]
    reply = srv.request(encode(Message(type=PULL, seq=1, meta={"observer": True},
                                       segments=segments)), port=port)
    assert reply.type == PARAMS, reply
    dense = torch.cat([torch.zeros(0)] + [s.data for s in reply.segments
                                          if type(s.data) is not Rows])
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
    kill_shard(srv, port, checkpointed_after=time.time())  # a's push waits in the checkpoint
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


@pytest.mark.parametrize("id_space", ["fixed", "hashed"])
def test_async_sparse_pushes_are_applied_once_across_a_shard_killed_before_its_ack(
        cli_env, tmp_path, id_space):
    """Pushes 1-2 acknowledged and checkpointed, 3-4 acknowledged after it, 5 applied and
    the shard SIGKILLed before its ack (the test-only kill_at hook, at the shard's 5th
    applied push). The restored shard holds 1-2; the worker re-sends 5, which it never heard
    acknowledged: 1, 2 and 5 are applied once each, rows and dense slice alike, and 3-4 are
    the lost updates the worker's clock (4) proves. Should a periodic checkpoint slip in
    after 3 or 4, the oracle follows the version the shard restored."""
    marker = tmp_path / "killed"
    env = {**cli_env, VARIABLE: f"{APPLIED_UNACKED}:5:{marker}"}
    srv = Server(env, tmp_path / "run", *CTR, "--no-exit-when-done", "--consistency", "async",
                 "--id-space", id_space, "--checkpoint-every", 0.5, "--heartbeat-timeout", 120)
    try:
        port = srv.stats()["shard_ports"][0]
        big = 10**15 + 7 if id_space == "hashed" else 998  # raw int64 ids when hashed
        asked = [(0, [3, 500, 999]), (7, [1, big]), (25, [0, 3])]
        dense0, rows0 = observe(srv, port, asked)
        gen = torch.Generator().manual_seed(1)
        dense = [torch.randn(len(dense0), generator=gen) for _ in range(5)]
        # (table, ids, value of every row's gradient): small integers, exact in float32
        rows = [[(0, [3, 500], 1.0), (7, [big], 2.0)], [(0, [500, 999], 4.0)],
                [(25, [0], 8.0), (0, [3], 16.0)], [(7, [1, big], 32.0)],
                [(0, [999], 64.0), (25, [3, 0], 128.0)]]

        def push(peer, i):
            send_push(peer, i + 1, dense[i], [(t, ids, torch.full((len(ids), 16), v))
                                              for t, ids, v in rows[i]], clock=i)

        a = Peer(srv, port, worker="a")
        for i in (0, 1):
            push(a, i)
            assert applied(a.reply())
        acked = time.time()
        checkpoint = srv.out / "shard-0.pt"
        wait_for(lambda: checkpoint.exists() and checkpoint.stat().st_mtime > acked + 0.05,
                 60, "a checkpoint holding pushes 1 and 2")
        pid = shard_stats(srv, port)["pid"]
        for i in (2, 3):
            push(a, i)
            assert applied(a.reply())
        push(a, 4)
        assert a.reply(2.0) is None  # applied, then killed before its ack went out
        wait_for(lambda: restarted(srv, port, pid), 60, "the restarted shard", 0.2)
        assert int(marker.read_text()) == pid
        version = shard_stats(srv, port)["version"]  # what the restored checkpoint held
        assert 2 <= version <= 4
        a.close()
        a = Peer(srv, port, worker="a")  # the worker reconnects and re-sends push 5
        push(a, 4)
        ack = a.reply()
        assert applied(ack) and ack.meta[Key.STALENESS] == 0  # ahead of the restored version
        push(a, 4)  # its retry: a duplicate now
        again = a.reply()
        assert not applied(again) and again.meta[Key.DUPLICATE] is True

        kept = list(range(version)) + [4]
        dense_now, rows_now = observe(srv, port, asked)
        assert torch.allclose(dense_now, dense0 - sum(dense[i] for i in kept), atol=1e-5)
        expect = [r.clone() for r in rows0]
        place = {(t, i): (k, j) for k, (t, ids) in enumerate(asked) for j, i in enumerate(ids)}
        for i in kept:
            for t, ids, v in rows[i]:
                for one in ids:
                    k, j = place[(t, one)]
                    expect[k][j] -= v
        assert all(torch.equal(got, want) for got, want in zip(rows_now, expect))
        stats = shard_stats(srv, port)
        assert stats["updates"] == version + 1 and stats["lost_updates"] == 4 - version
        assert stats["rows_pushed"] == sum(len(ids) for i in kept for _, ids, _ in rows[i])
        a.close()
    finally:
        srv.close()


def test_a_ps_server_with_more_shards_than_dense_values_serves_tables_on_each(server):
    """tasks_for_tests:table_counter (a 48-row table and one dense scalar) on 3 shards:
    shards 0 and 1 hold rows alone (dense slices [0, 0)), shard 2 the scalar and its rows.
    The server starts, and each shard pulls and applies its rows; the scalar only on 2."""
    srv = server("--task", "tasks_for_tests:table_counter", "--samples", 48, "--lr", 1,
                 "--shards", 3, "--no-exit-when-done")
    ports = srv.stats()["shard_ports"]
    assert len(ports) == 3
    for shard, port in enumerate(ports):
        ids = [shard, shard + 3, shard + 45]
        dense0, (rows0,) = observe(srv, port, [(0, ids)])
        assert len(dense0) == (1 if shard == 2 else 0)
        peer = Peer(srv, port, worker="a", shard=shard)
        grads = torch.tensor([[1.0], [2.0], [4.0]])
        segments = [rows_segment(0, torch.tensor(ids), grads)]
        if shard == 2:
            segments.insert(0, Segment(0, torch.tensor([8.0])))
        peer.sock.send_multipart(encode(Message(
            type=PUSH, worker="a", seq=1, shard=shard, incarnation=1, segments=segments,
            token=peer.token(1))))
        assert applied(peer.reply())
        dense, (rows,) = observe(srv, port, [(0, ids)])
        assert torch.equal(rows, rows0 - grads)
        assert torch.equal(dense, dense0 - 8.0 if shard == 2 else dense0)
        peer.close()


def test_a_worker_trains_through_shards_that_hold_rows_alone(server, cli_env):
    """table_counter on 3 shards (two with an empty dense slice) and a real worker: the
    welcome's empty slices are accepted (a model without tables still refuses them), and
    lr 1 over 2 epochs leaves each row at -2 and the scalar at -96: the final loss is
    exactly -98 on every test sample."""
    args = ("--task", "tasks_for_tests:table_counter", "--samples", 48)
    srv = server(*args, "--lr", 1, "--shards", 3, "--workers", 1)
    (code, _, err), = finish([worker(cli_env, srv.address, 0, 1, *args, "--epochs", 2)])
    assert code == 0, err
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    assert summary["shards"] == 3 and summary["final_loss"] == -98.0, summary


def test_the_evaluator_reads_raw_ids_beyond_the_tables_rows_in_a_hashed_id_space(
        server, cli_env):
    """tasks_for_tests:raw_table_counter looks its 48-row table up at raw ids 10^12 + 7919 x
    row: with --id-space hashed a worker trains on them, and the server's evaluator pulls
    the test split's rows by those ids and evaluates through a local table (it refused
    them at start before). lr 1, 2 epochs: each test row at -2, the dense scalar at -96, so
    every test sample's output, and the final loss, is exactly -98."""
    args = ("--task", "tasks_for_tests:raw_table_counter", "--samples", 48)
    srv = server(*args, "--lr", 1, "--id-space", "hashed", "--workers", 1)
    (code, _, err), = finish([worker(cli_env, srv.address, 0, 1, *args, "--epochs", 2)])
    assert code == 0, err
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    assert summary["final_loss"] == -98.0
    # the 48 raw ids trained; the evaluator's observer pulls (raw ids, then rows 0-47 for
    # the saved model) created none
    table = summary["tables"]["weight.weight"]
    assert (table["rows"], table["created"]) == (48, 48), table
