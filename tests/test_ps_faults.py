"""The parameter server under hostile input, with real processes and sockets on 127.0.0.1.

Exact oracle throughout: ``tasks_for_tests:index_counter`` with SGD lr 1 makes
every row's weight minus the number of times it was trained, so one lost or
doubled update shows.
"""

import re
import time
import types

import pytest

import torch
import zmq

from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import (ERROR, PARAMS, STATS, Message, ProtocolError, Segment,
                                    copy_into, encode)
from asyncsgd.workers.client import PSClient
from conftest import finish, worker
from faults import (FaultProxy, GarbageFlood, observe, oversized_frame, record_figure, tree_fds,
                    tree_rss)
from tasks_for_tests import index_counter

ROWS = 2000  # one worker, batch 8: 250 pushes an epoch
TASK = ["--task", "tasks_for_tests:index_counter", "--samples", ROWS]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def test_garbage_flood_neither_crashes_nor_stalls_a_good_worker(server, cli_env):
    srv = server(*TASK, "--shards", 2, "--no-exit-when-done")
    ports = [srv.port, *srv.stats()["shard_ports"]]
    fds_before = tree_fds(srv.proc.pid)
    calm = worker(cli_env, srv.address, 0, 1, *TASK, "--epochs", 1)
    started = time.monotonic()
    (code, _, err), = finish([calm])
    assert code == 0, err
    calm_seconds = time.monotonic() - started

    with GarbageFlood(ports, clients=6) as flood:
        good = worker(cli_env, srv.address, 0, 1, *TASK, "--epochs", 2)
        started = time.monotonic()
        (code, out, err), = finish([good])
        flooded_seconds = time.monotonic() - started
    assert code == 0, err
    assert "500 steps, 500 pushes" in out
    assert flood.sent >= 50, flood.sent
    assert flooded_seconds < 3 * calm_seconds + 30, (calm_seconds, flooded_seconds)

    stats = srv.stats()  # still serving
    assert srv.proc.poll() is None
    refused = sum(t["refused"] for t in stats["transport"])
    assert refused >= flood.sent // 2, (refused, flood.sent)
    ranges = Layout.of(index_counter(ROWS).build_model(0)).shard_ranges(2)
    rows = torch.cat([observe(srv, port, end - start)
                      for port, (start, end) in zip(stats["shard_ports"], ranges)])
    assert torch.equal(rows, torch.full((ROWS,), -3.0))  # 1 + 2 epochs, nothing else
    fds = _wait_for(lambda: tree_fds(srv.proc.pid) <= fds_before and tree_fds(srv.proc.pid),
                    40, f"file descriptors back to {fds_before}")
    record_figure("garbage flood", connections=flood.sent, refused=refused, crashes=0,
                  fds_before=fds_before, fds_after=fds,
                  good_worker_seconds=round(flooded_seconds, 2),
                  calm_worker_seconds=round(calm_seconds, 2))


def test_oversized_frames_drop_their_sender_and_nothing_else(server, cli_env):
    srv = server(*TASK, "--no-exit-when-done")
    shard_port = srv.stats()["shard_ports"][0]
    rss_before = tree_rss(srv.proc.pid)
    good = worker(cli_env, srv.address, 0, 1, *TASK, "--epochs", 3)

    # A raw peer announcing a 2**62-byte frame is hung up on without a buffer being made.
    hung_up = [oversized_frame(port) for port in (srv.port, shard_port)]
    assert max(hung_up) < 5.0, hung_up

    # A real zmq peer sending 64 MiB in one frame is disconnected the same way.
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(f"tcp://127.0.0.1:{shard_port}")
        sock.send(bytes(64 * 2 ** 20))
        assert monitor.poll(10_000), "the server kept a peer that sent a 64 MiB frame"
        sock.disable_monitor()
        monitor.close()
        sock.close()
    finally:
        ctx.term()

    (code, out, err), = finish([good])
    assert code == 0, err
    assert "750 steps, 750 pushes" in out
    rss_growth = tree_rss(srv.proc.pid) - rss_before
    assert rss_growth < 48 * 2 ** 20, rss_growth  # never a 64 MiB (let alone 2**62) buffer
    assert torch.equal(observe(srv, shard_port, ROWS), torch.full((ROWS,), -3.0))
    stats = srv.stats()
    assert sum(t["disconnects"] for t in stats["transport"]) >= 3
    record_figure("oversized frames", peers_dropped=3, seconds_to_hang_up=round(max(hung_up), 3),
                  server_rss_growth_mib=round(rss_growth / 2 ** 20, 1), crashes=0)


def _client_stats(out: str) -> dict:
    """Counters from a worker's closing line:
    '... (retries R, duplicate acks D; S bytes sent, V received)'."""
    found = re.search(r"\(retries (\d+), duplicate acks (\d+);", out)
    assert found, out
    return {"retries": int(found.group(1)), "duplicate acks": int(found.group(2))}


@pytest.mark.parametrize("transport", ["tcp", "shared"])
def test_drops_and_duplicates_lose_and_double_nothing(server, cli_env, transport):
    """Through shared memory too: the headers still cross the lossy proxy."""
    rows, epochs = 400, 3  # two workers, batch 8: 25 pushes an epoch each
    srv = server("--task", "tasks_for_tests:index_counter", "--samples", rows, "--shards", 2,
                 "--no-exit-when-done")
    proxy = FaultProxy(srv.port, drop=0.15, dup=0.15, seed=7)
    try:
        started = time.monotonic()
        procs = [worker(cli_env, proxy.address, r, 2, "--task", "tasks_for_tests:index_counter",
                        "--samples", rows, "--epochs", epochs, "--heartbeat", 0.05,
                        "--transport", transport)
                 for r in range(2)]
        results = finish(procs)
        seconds = time.monotonic() - started
    finally:
        proxy.close()
    pushes, client = 0, {"retries": 0, "duplicate acks": 0}
    for code, out, err in results:
        assert code == 0, err
        assert f"{25 * epochs} steps, {25 * epochs} pushes" in out, out
        pushes += 25 * epochs
        for key, value in _client_stats(out).items():
            client[key] += value
    stats = srv.stats()
    shard_stats = [srv.request(encode(Message(type=STATS, seq=1)), port=p).meta
                   for p in stats["shard_ports"]]
    ranges = Layout.of(index_counter(rows).build_model(0)).shard_ranges(2)
    params = torch.cat([observe(srv, port, end - start)
                        for port, (start, end) in zip(stats["shard_ports"], ranges)])
    assert torch.equal(params, torch.full((rows,), -float(epochs)))  # every push exactly once
    assert [s["updates"] for s in shard_stats] == [pushes, pushes]
    suppressed = sum(s["duplicates"] for s in shard_stats)
    counts = proxy.counts
    assert counts["pushes_dropped"] > 0 and counts["pushes_duplicated"] > 0, counts
    assert counts["acks_dropped"] > 0 and counts["acks_duplicated"] > 0, counts
    # Exact bookkeeping: every push message that reached a shard was applied or suppressed,
    # and every push beyond the first of each (worker, shard, step) was a worker's retry.
    delivered = counts["pushes"] - counts["pushes_dropped"] + counts["pushes_duplicated"]
    assert delivered == 2 * pushes + suppressed, (delivered, suppressed, counts)
    assert client["retries"] >= counts["pushes"] - 2 * pushes > 0, (client, counts)
    record_figure("drops and duplicates", steps_pushed=pushes, push_messages=counts.pop("pushes"),
                  ack_messages=counts.pop("acks"), **counts, worker_retries=client["retries"],
                  duplicates_suppressed=suppressed, updates_lost=0, updates_doubled=0,
                  seconds=round(seconds, 1))


def _ack_not_a_map(msg):
    if "ack" in msg.meta:
        msg.meta["ack"] = 5


def _version_not_an_int(msg):
    if msg.type == PARAMS:
        msg.meta["version"] = "latest"


def _segment_past_the_slice(msg):
    if msg.type == PARAMS:
        msg.segments[0].offset += 1


def _error_screaming(msg):
    if msg.type == PARAMS:
        msg.type, msg.segments = ERROR, []
        msg.meta = {"code": "boom", "error": "\x1b[2J" + "A" * 60_000}


@pytest.mark.parametrize("tamper,named", [
    (_error_screaming, ": ?[2JAAAA"),
    (_ack_not_a_map, "shard 0 acknowledged with a int, not a map"),
    (_version_not_an_int, "shard 0 sent version 'latest', not an integer in [0, 2**63)"),
    (_segment_past_the_slice, f"at 1 does not fit the {ROWS} values of the slice")])
def test_a_worker_refuses_a_malformed_reply_with_a_clear_error(server, cli_env, tamper, named):
    """A server (or whatever stands in its place) that answers with a reply the protocol
    allows no worker to use: the worker stops with one line naming what was wrong, not a
    traceback, and copies nothing of a reply whose parameters lie outside its slice."""
    srv = server(*TASK, "--shards", 1, "--no-exit-when-done")
    proxy = FaultProxy(srv.port, drop=0, dup=0, tamper=tamper)
    try:
        started = time.monotonic()
        (code, out, err), = finish([worker(cli_env, proxy.address, 0, 1, *TASK, "--epochs", 1,
                                          "--transport", "tcp")],
                                   timeout=120)
        seconds = time.monotonic() - started
    finally:
        proxy.close()
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], err[:2000]
    assert len(lines[0]) < 1200 and "\x1b" not in err  # a peer's text, bounded and printable
    assert seconds < 60
    stats = srv.stats()  # the server serves on, and heard the failed worker's goodbye
    assert stats["shard_ports"] and stats["joined"] and stats["left"] == stats["joined"], stats


def test_a_reply_with_a_segment_outside_the_slice_copies_nothing():
    flat = torch.zeros(10)
    reply = Message(type=PARAMS, segments=[Segment(0, torch.ones(4)), Segment(4, torch.ones(3))])
    with pytest.raises(ProtocolError, match="does not fit the 6 values"):
        copy_into(reply, flat, start=2, size=6)  # the second ends at 7 > 6
    assert torch.equal(flat, torch.zeros(10))
    scalar = Message(type=PARAMS, segments=[Segment(0, torch.tensor(1.0))])
    with pytest.raises(ProtocolError, match="does not fit"):
        copy_into(scalar, flat)


@pytest.mark.parametrize("shards", [
    None, [], [{"port": 5000, "start": 0, "end": 6}],  # short of the model's 10
    [{"port": 5000, "start": 0, "end": 5}, {"port": 5001, "start": 6, "end": 10}],  # a gap
    [{"port": 5000, "start": 0, "end": 6}, {"port": 5001, "start": 5, "end": 10}],  # overlap
    [{"port": 0, "start": 0, "end": 10}], [{"port": "5000", "start": 0, "end": 10}],
    [{"port": 5000, "start": -2, "end": 10}], [{"port": 5000, "start": 0, "end": 10.0}],
    [[5000, 0, 10]]])
def test_a_welcome_must_announce_contiguous_slices_covering_the_model(shards):
    """The slices a welcome announces bound what each shard's replies may write."""
    client = types.SimpleNamespace(hello={"signature": {"total": 10}}, host="127.0.0.1",
                                   server="tcp://127.0.0.1:5555")
    good = [{"port": 5000, "start": 0, "end": 4}, {"port": 5001, "start": 4, "end": 10}]
    assert PSClient._layout(client, {"shards": good}) == (
        ["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"], [(0, 4), (4, 10)])
    with pytest.raises(ProtocolError, match="contiguous slices covering the model"):
        PSClient._layout(client, {"shards": shards})
