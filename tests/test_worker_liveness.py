"""A worker's liveness is independent of its work: heartbeats flow while it computes, so a
step longer than the server's heartbeat timeout never gets a healthy worker dropped; and a
worker stopped with Ctrl-C or SIGTERM says goodbye, so the barriers drop it at once.
"""

import re
import signal
import subprocess
import time

import pytest
import torch

from asyncsgd.run.process_group import available_cores
from asyncsgd.servers.shard_process import DRAIN_SECONDS
from asyncsgd.workers.client import PSClient
from conftest import asyncsgd_cmd, finish, shard_stats, wait_for, worker
from faults import observe, record_figure

SLOW = "tasks_for_tests:slow_counter"


def test_a_worker_computing_longer_than_the_heartbeat_timeout_stays_a_member(server, cli_env):
    """Sync, two workers, steps of 3 s against a 1.5 s heartbeat timeout. Summed rounds of
    exactly both workers' pushes leave the counter at minus every sample trained on; a
    worker dropped meanwhile would have cut a round short and seen its push refused as
    stale (the old client sent heartbeats only while it waited on the server)."""
    rows, step = 32, 3.0  # two workers, 16 rows each, batch 8: 2 steps each
    srv = server("--task", SLOW, "--samples", rows, "--workers", 2, "--consistency", "sync",
                 "--sync-reduce", "sum", "--heartbeat-timeout", 1.5, "--no-exit-when-done",
                 "--eval-every", 1000)
    env = dict(cli_env, ASYNCSGD_TEST_STEP_SECONDS=str(step))
    procs = [worker(env, srv.address, r, 2, "--task", SLOW, "--samples", rows, "--epochs", 1,
                    "--heartbeat", 0.2) for r in range(2)]
    results = finish(procs, timeout=120)
    assert all(code == 0 for code, _, _ in results), results
    port = srv.stats()["shard_ports"][0]
    stats = shard_stats(srv, port)
    assert stats["dropped_workers"] == 0, stats
    assert stats["stale"] == 0 and stats["updates"] == 2, stats
    assert observe(srv, port, 1).item() == -rows


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_worker_says_goodbye_and_the_survivor_goes_on(server, cli_env, sig):
    """Sync with a heartbeat timeout of 60 s: without a goodbye the survivor's rounds would
    stall for a minute after the other worker is stopped."""
    task = ("--task", "tasks_for_tests:dense_counter", "--samples", 4000)
    srv = server(*task, "--workers", 2, "--consistency", "sync", "--heartbeat-timeout", 60,
                 "--no-exit-when-done", "--eval-every", 1000)
    procs = [worker(cli_env, srv.address, r, 2, *task, "--epochs", 1000, "--heartbeat", 0.2)
             for r in range(2)]
    survivor, stopped = procs
    try:
        port = srv.stats()["shard_ports"][0]
        wait_for(lambda: shard_stats(srv, port)["updates"] >= 20, 120, "20 sync rounds")
        stopped.send_signal(sig)
        _, err = stopped.communicate(timeout=60)
        said_bye = time.monotonic()
        assert stopped.returncode == 128 + sig, err  # 130 for Ctrl-C, 143 for SIGTERM
        assert "Traceback" not in err, err
        before = shard_stats(srv, port)["updates"]
        wait_for(lambda: shard_stats(srv, port)["updates"] >= before + 50, 20,
                 "the survivor's rounds going on without the stopped worker")
        going_on = time.monotonic() - said_bye
        stats = shard_stats(srv, port)
        assert stats["dropped_workers"] == 0 and stats["live_workers"] == 1, stats
        assert survivor.poll() is None
    finally:
        for p in procs:  # Ctrl-C: the survivor says goodbye too, so the server stops at once
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
    assert survivor.returncode == 130  # its own goodbye, not a kill
    record_figure(f"worker stopped by {sig.name}", exit_code=128 + sig, heartbeat_timeout_s=60,
                  survivor_rounds_again_within_s=round(going_on, 2))


def test_a_server_whose_workers_all_left_stops_without_waiting_for_stragglers(server):
    """A stopping shard answers stragglers for DRAIN_SECONDS: a worker the front welcomed may
    not have reached it yet. Once every welcomed worker said goodbye none can come, and the
    shards stop at once; a server with a welcomed worker that never left still waits."""
    task = ("--task", "tasks_for_tests:dense_counter", "--lr", 1, "--eval-every", 1000,
            "--no-exit-when-done", "-v")
    left, silent = server(*task), server(*task)
    params = torch.zeros(1)
    with PSClient(left.address, "w", left.signature(), rank=0, world=1, heartbeat=0.5,
                  server_timeout=20) as client:
        client.push_pull(torch.ones(1), params)  # at the shard: live there until its bye
    assert params.item() == -1
    silent.admit("w")  # welcomed by the front, never at a shard, never says goodbye
    ended = {}
    for name, srv in (("left", left), ("silent", silent)):
        started = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        code, _, err = srv.wait(timeout=60)
        ended[name] = time.monotonic() - started, err
        assert code == 130 and "Traceback" not in err, err
    note = "shard 0: stopping; every worker the front welcomed has left"
    assert note in ended["left"][1], ended["left"][1]
    assert note not in ended["silent"][1], ended["silent"][1]
    assert ended["silent"][0] >= DRAIN_SECONDS, ended  # a lower bound: load only adds to it
    record_figure("ps-server stopped with Ctrl-C", every_worker_left_s=round(ended["left"][0], 2),
                  one_welcomed_worker_still_to_come_s=round(ended["silent"][0], 2))


def _threads_seen(err: str) -> int:
    return int(re.search(r"(\d+) torch thread\(s\);", err).group(1))


def test_workers_beside_their_server_share_its_cores_by_default(server, cli_env):
    """docs/parameter-server.md's setup on one host: by default each worker takes cores //
    (workers + shards here) threads (the old default took cores // 1 each, many times slower:
    experiments/README.md, "Worker threads"); more than the cores is warned about, naming
    the fix."""
    task = ("--task", "tasks_for_tests:dense_pair", "--samples", 400)
    srv = server(*task, "--shards", 2, "--workers", 2, "--no-exit-when-done")
    runs = {"default": ("--threads", 0), "too many": ("--threads", available_cores() + 1)}
    for what, flags in runs.items():
        procs = [subprocess.Popen(  # -v: the worker logs the threads it chose
            asyncsgd_cmd("-v", "worker", "--server", srv.address, "--rank", r, "--world", 2,
                         *task, "--epochs", 1, "--progress", "off", *flags),
            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL) for r in range(2)]
        for code, _, err in finish(procs):
            assert code == 0, err
            warned = "exceed its" in err and "use --threads" in err
            if what == "default":
                assert _threads_seen(err) == max(1, available_cores() // 4), err
                assert not warned, err
            else:
                assert _threads_seen(err) == available_cores() + 1 and warned, err
