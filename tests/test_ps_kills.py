"""Processes of a parameter-server run killed, stopped and restarted, with exact oracles.

``tasks_for_tests:index_counter`` with SGD lr 1: a push is one batch of 8 rows,
each row's weight ends at minus the number of times its push was applied.
"""

import os
import shutil
import signal
import time

import pytest

import torch

from asyncsgd.core.tasks import partition_indices
from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.wire.layout import Layout
from conftest import (finish, periodic_checkpoint, read_events, read_json, shard_stats,
                      wait_for, worker)
from faults import observe, record_figure
from asyncsgd.servers.shard import params_digest
from tasks_for_tests import index_counter

TASK = "tasks_for_tests:index_counter"
BATCH = 8


def first_batches(rows: int, world: int, rank: int, batches: int, seed: int = 0) -> torch.Tensor:
    """Rows of a worker's first ``batches`` pushes in epoch 0: the order workers/worker.py
    draws (its partition, permuted by a generator seeded with seed*1000003 + rank*10007)."""
    part = partition_indices(rows, world, rank, 0)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007)
    return part[torch.randperm(len(part), generator=gen)][:batches * BATCH]


@pytest.mark.parametrize("transport", ["tcp", "shared"])
def test_worker_sigkill_mid_push_leaves_no_half_applied_update(server, cli_env, transport):
    rows = 200_000  # 400 KB of gradient per shard and push: a kill often lands mid-push
    srv = server("--task", TASK, "--samples", rows, "--shards", 2, "--no-exit-when-done",
                 "--heartbeat-timeout", 2)
    ports = srv.stats()["shard_ports"]
    args = ["--task", TASK, "--samples", rows, "--epochs", 1, "--transport", transport]
    survivor = worker(cli_env, srv.address, 0, 2, *args, "--max-seconds", 12)
    victim = worker(cli_env, srv.address, 1, 2, *args)
    victim_id = None

    def victim_pushes():
        nonlocal victim_id
        train = shard_stats(srv, ports[1]).get("train", {})
        victim_id = next((w for w in train if w.endswith("-r1")), None)
        return victim_id and train[victim_id][1] >= 20

    wait_for(victim_pushes, 120, "the victim's first pushes")
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    at_kill = sum(shard_stats(srv, p)["updates"] for p in ports)
    (code, out, err), = finish([survivor])
    assert code == 0, err
    survivor_pushes = int(out.split(" pushes")[0].split()[-1])
    stats = [shard_stats(srv, p) for p in ports]
    assert sum(s["updates"] for s in stats) > at_kill  # the survivor went on

    ranges = Layout.of(index_counter(rows).build_model(0)).shard_ranges(2)
    params = torch.cat([observe(srv, port, end - start)
                        for port, (start, end) in zip(ports, ranges)])
    expected = torch.zeros(rows)
    applied = []
    for (start, end), s in zip(ranges, stats):
        survivor_id = next(w for w in s["train"] if w.endswith("-r0"))
        assert s["train"][survivor_id][1] == survivor_pushes  # every acknowledged push kept
        n = s["train"][victim_id][1]
        applied.append(n)
        for rank, batches in ((0, survivor_pushes), (1, n)):
            touched = first_batches(rows, 2, rank, batches)
            touched = touched[(touched >= start) & (touched < end)]
            expected[touched] -= 1
    # Each shard holds exactly whole pushes of the victim: none half applied.
    assert torch.equal(params, expected)
    assert abs(applied[0] - applied[1]) <= 1, applied  # killed between its two shards at most
    record_figure("worker SIGKILL mid-push", victim_pushes_applied=applied,
                  survivor_pushes=survivor_pushes, half_applied=0)


def test_stopped_worker_is_dropped_then_rejoins_under_sync(server, cli_env):
    rows, epochs, timeout = 640, 3, 1.5  # two workers, 40 pushes an epoch each
    srv = server("--task", TASK, "--samples", rows, "--workers", 2, "--consistency", "sync",
                 "--sync-reduce", "sum", "--heartbeat-timeout", timeout, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    args = ["--task", TASK, "--samples", rows, "--epochs", epochs, "--heartbeat", 0.2]
    survivor = worker(cli_env, srv.address, 0, 2, *args)
    victim = worker(cli_env, srv.address, 1, 2, *args)

    def workers():
        return shard_stats(srv, port)["workers"]

    wait_for(lambda: shard_stats(srv, port)["updates"] >= 10, 120, "ten rounds")
    victim_id = next(w for w in workers() if w.endswith("-r1"))
    survivor_id = next(w for w in workers() if w.endswith("-r0"))
    victim.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    dead = wait_for(lambda: (lambda w: w if not w[victim_id]["alive"] else None)(workers()),
                    timeout + 10, "the victim marked dead")
    detection = time.monotonic() - stopped
    # Never dropped before --heartbeat-timeout of silence, by the shard's own clock.
    assert dead[victim_id]["last_seen_s"] >= timeout
    # Progress without the victim, counted in pushes the survivor got applied while the
    # victim's count stays frozen (it is stopped): no snapshot can come too late for it.
    wait_for(lambda: (lambda w: w[survivor_id]["pushes"] >= w[victim_id]["pushes"] + 5)(
        workers()), 30, "rounds without the stopped worker")
    frozen = workers()[victim_id]["pushes"]  # still stopped: its count cannot move yet
    victim.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    # Back once a push of it counts again. (Its being alive is no event to wait for: with the
    # survivor done it may finish its epochs and say bye between two looks.)
    wait_for(lambda: workers()[victim_id]["pushes"] > frozen, 30, "the victim back")
    rejoin = time.monotonic() - resumed
    results = finish([survivor, victim])
    for code, out, err in results:
        assert code == 0, err
        assert f"{40 * epochs} steps, {40 * epochs} pushes" in out, out
    stats = shard_stats(srv, port)
    weights = observe(srv, port, rows)
    # A push computed before a round it missed is acknowledged, not applied (sync's rule).
    applied = 2 * 40 * epochs - stats["stale"]
    assert weights.sum().item() == -BATCH * applied
    assert weights.min().item() >= -epochs and weights.max().item() <= 0
    assert stats["dropped_workers"] >= 1
    # The shard ticks every 0.1 s; the rest is this test's polling on a maybe loaded machine.
    assert detection <= timeout + 5.0, detection
    record_figure("worker SIGSTOP/SIGCONT (sync)", heartbeat_timeout_s=timeout,
                  detection_latency_s=round(detection, 2), rejoin_s=round(rejoin, 2),
                  stale_pushes_refused=stats["stale"])


def _kill_shard(srv, run_dir, port: int, index: int = 0) -> tuple:
    """SIGKILL shard ``index``; returns (copy of its checkpoint at that moment, kill time)."""
    pid = shard_stats(srv, port)["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    copy = run_dir / f"killed-shard-{index}.pt"
    shutil.copy(run_dir / f"shard-{index}.pt", copy)  # the dead process writes no more
    wait_for(lambda: _answers(srv, port) not in (None, pid), 60, "the restarted shard", 0.2)
    return copy, killed


def _answers(srv, port: int):
    try:
        return shard_stats(srv, port)["pid"]
    except TimeoutError:
        return None


def test_shard_sigkill_restarts_from_its_checkpoint_and_counts_lost_updates(server, cli_env):
    """Through shared memory: the restarted shard knows no area, the worker's next push
    falls back to frames and attaches again."""
    rows, epochs = 4000, 4  # one worker, 500 pushes an epoch
    srv = server("--task", TASK, "--samples", rows, "--checkpoint-every", 1)
    port = srv.stats()["shard_ports"][0]
    run_dir = srv.out
    # Paced (2 ms a step, >= 4 s in all): the kill must land mid-run however fast the
    # round trips are; unpaced, the 2000 pushes took ~2 s here, and the first periodic
    # checkpoint with 400 updates came when 1500-1900 of them were done.
    trainer = worker(cli_env, srv.address, 0, 1, "--task", TASK, "--samples", rows,
                     "--epochs", epochs, "--heartbeat", 0.2, "--transport", "shared",
                     "--delay", "const:2ms")
    wait_for(lambda: periodic_checkpoint(run_dir) and
             shard_stats(srv, port)["version"] >= 400, 120, "a checkpoint and 400 updates")
    copy, killed = _kill_shard(srv, run_dir, port)
    saved = load_checkpoint(copy)["shard"]
    restored = shard_stats(srv, port)["restored"]
    assert restored == {"version": saved["version"], "sha256": params_digest(saved["params"])}
    wait_for(lambda: shard_stats(srv, port)["version"] > saved["version"], 60,
             "the worker's pushes applied again")
    reconnect = time.monotonic() - killed
    (code, out, err), = finish([trainer])
    assert code == 0, err
    assert f"{500 * epochs} steps, {500 * epochs} pushes" in out
    assert "server unavailable" in err and "retrying" in err
    assert srv.wait()[0] == 0
    summary = read_json(run_dir / "summary.json")
    lost = summary["lost_updates"]
    assert summary["shard_restarts"] == 1
    weights = load_checkpoint(run_dir / "checkpoint.pt")["model"]["weight.weight"]
    # Lost = acknowledged pushes whose effect died with the shard: exactly what is missing.
    assert weights.sum().item() == -BATCH * (500 * epochs - lost)
    assert summary["updates"] == 500 * epochs - lost
    assert 0 < lost <= 500 * epochs - saved["version"]
    missing = 500 * epochs + int(weights.sum().item()) // BATCH  # pushes absent from the weights
    # shard 0's counters start again from zero in its new process; the run's do not
    evals = [e for e in read_events(run_dir) if e["event"] == "eval"]
    for key in ("samples", "bytes"):
        values = [e[key] for e in evals]
        assert values == sorted(values) and values[-1] > 0, (key, values)
    record_figure("shard SIGKILL + restart (exact)", checkpoint_version=saved["version"],
                  lost_updates_reported=lost, pushes_missing_from_weights=missing,
                  restored_bit_for_bit=True, reconnect_s=round(reconnect, 2))


def test_a_shard_killed_before_its_first_periodic_checkpoint_counts_every_update_lost(
        server, cli_env):
    """--checkpoint-every 0 (only at the start and the end): the shard's checkpoint from
    its start is all there is. Restarted from it (version 0), it counts as lost every
    acknowledged push it had applied, and the weights prove that count exact; without that
    checkpoint it would start over from the initial parameters as if it had lost nothing."""
    rows, epochs = 4000, 2  # one worker, 500 pushes an epoch
    srv = server("--task", TASK, "--samples", rows, "--checkpoint-every", 0)
    port = srv.stats()["shard_ports"][0]
    start = load_checkpoint(srv.out / "shard-0.pt")["shard"]
    assert start["version"] == 0 and (srv.out / "checkpoint.pt").is_file()
    trainer = worker(cli_env, srv.address, 0, 1, "--task", TASK, "--samples", rows,
                     "--epochs", epochs, "--heartbeat", 0.2, "--delay", "const:2ms")  # mid-run
    wait_for(lambda: shard_stats(srv, port)["version"] >= 200, 120, "200 updates")
    copy, _ = _kill_shard(srv, srv.out, port)
    assert load_checkpoint(copy)["shard"]["version"] == 0  # no periodic one came
    assert shard_stats(srv, port)["restored"] == {"version": 0,
                                                  "sha256": params_digest(start["params"])}
    (code, out, err), = finish([trainer])
    assert code == 0, err
    assert f"{500 * epochs} steps, {500 * epochs} pushes" in out
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    lost = summary["lost_updates"]
    assert lost >= 200, summary
    weights = load_checkpoint(srv.out / "checkpoint.pt")["model"]["weight.weight"]
    assert weights.sum().item() == -BATCH * (500 * epochs - lost)


def test_training_reaches_its_target_through_a_shard_crash(server, cli_env):
    srv = server("--task", "mnist1d-cnn", "--shards", 2, "--workers", 2, "--checkpoint-every", 1,
                 "--target", 0.8, "--max-seconds", 150)
    ports = srv.stats()["shard_ports"]
    procs = [worker(cli_env, srv.address, r, 2, "--epochs", 1000, "--heartbeat", 0.2)
             for r in range(2)]
    wait_for(lambda: periodic_checkpoint(srv.out, 1) and
             shard_stats(srv, ports[1])["updates"] >= 100, 120, "a checkpoint and 100 updates")
    _, killed = _kill_shard(srv, srv.out, ports[1], index=1)
    pushes = 0
    for code, out, err in finish(procs, timeout=240):
        assert code == 0, err
        assert "the server ended training" in out
        pushes += int(out.split(" pushes")[0].split()[-1])
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    assert summary["stopped_by"] == "target" and summary["best_metric"] >= 0.8
    assert summary["shard_restarts"] == 1
    # Every acknowledged push reached both shards. The shard that never crashed lost
    # nothing; the other applied all but the lost ones. (The training's stop may cut one
    # push per worker after one shard applied it: at most 2 more than the workers counted.)
    shard0, shard1 = (load_checkpoint(srv.out / f"shard-{i}.pt")["shard"] for i in (0, 1))
    assert shard0["counters"]["lost_updates"] == 0
    assert 0 <= shard0["version"] - pushes <= 2, (shard0["version"], pushes)
    assert summary["lost_updates"] == shard1["counters"]["lost_updates"]
    assert abs(pushes - shard1["version"] - summary["lost_updates"]) <= 2, \
        (pushes, shard1["version"], summary["lost_updates"])
    record_figure("shard SIGKILL + restart (mnist1d-cnn)", lost_updates=summary["lost_updates"],
                  best_accuracy=summary["best_metric"],
                  time_to_target_s=summary.get("time_to_target"))


def test_a_shard_dead_for_good_fails_the_run_saved_as_last_seen(server, cli_env):
    """--shard-restarts 0: a shard SIGKILLed ends the run as failed. The server cannot ask
    the dead shard, says so, and saves the run as its last evaluation saw it: summary.json
    keeps the PS fields (main: none of them on a failed run) and checkpoint.pt that
    evaluation's parameters, here every one of the 250 updates."""
    task = ["--task", "tasks_for_tests:dense_counter", "--samples", 2000]
    srv = server(*task, "--workers", 1, "--shard-restarts", 0, "--no-exit-when-done")
    (code, out, err), = finish([worker(cli_env, srv.address, 0, 1, *task, "--epochs", 1)])
    assert code == 0 and "250 pushes" in out, err
    wait_for(lambda: srv.stats()["updates"] == 250, 60, "an evaluation that saw every update")
    os.kill(srv.stats()["shard_stats"][0]["pid"], signal.SIGKILL)
    code, _, err = srv.wait()
    assert code == 1, err
    assert "a shard is down: the run is saved as the last evaluation saw it" in err, err
    summary = read_json(srv.out / "summary.json")
    assert (summary["status"], summary["stopped_by"]) == ("failed", "error")
    assert (summary["updates"], summary["samples"], summary["shard_restarts"]) == (250, 2000, 0)
    assert load_checkpoint(srv.out / "checkpoint.pt")["model"]["w"].item() == -2000
