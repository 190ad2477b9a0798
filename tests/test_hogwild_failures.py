"""Failures with real processes: a raising worker, Ctrl-C, SIGTERM; no orphans, no leaks."""

import os
import signal
import time

import psutil
import pytest

from asyncsgd.core.tasks import partition_indices
from conftest import (asyncsgd_cmd, assert_no_shm_leak, read_json, shm_entries, signal_group,
                      signal_parent, start_training, stop_tree)
from faults import record_figure


def test_raising_worker_surfaces_its_traceback(tmp_path, run_cli):
    procs, rows = 3, 1000
    owner = next(r for r in range(procs) if 7 in partition_indices(rows, procs, r, 0).tolist())
    started = time.monotonic()
    res = run_cli("hogwild", "--task", "tasks_for_tests:failing", "--samples", rows,
                  "--procs", procs, "--epochs", 50, "--out", tmp_path / "run", "--progress", "off")
    assert res.returncode == 1
    assert f"worker {owner} raised" in res.stderr
    assert "ValueError: boom at row 7" in res.stderr  # the child's own traceback
    assert "Traceback" in res.stderr
    assert time.monotonic() - started < 120
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["status"] == "failed" and f"worker {owner}" in summary["error"]


def _start_training(out, cli_env, *extra):
    return start_training(asyncsgd_cmd("hogwild", "--procs", 3, "--epochs", 100000, "--out", out,
                                       "--progress", "off", *extra), out, cli_env)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_child_without_leaks(tmp_path, cli_env, sig):
    shm_before = shm_entries()
    out = tmp_path / "run"
    proc = _start_training(out, cli_env, "--eval-every", 0.5)
    act = signal_group(sig) if sig == signal.SIGINT else signal_parent(sig)
    _, stderr, took, children = stop_tree(proc, act, timeout=30, orphan_wait=5)
    assert len(children) >= 3
    assert proc.returncode == 128 + sig, stderr  # 130 for Ctrl-C, 143 for SIGTERM
    assert took < 15
    assert "Traceback" not in stderr
    assert_no_shm_leak(shm_before)
    summary = read_json(out / "summary.json")
    assert summary["status"] == "interrupted" and summary["samples"] > 0
    assert (out / "checkpoint.pt").is_file()  # nothing lost: resumable


@pytest.mark.parametrize("start_method,whole_group", [
    ("spawn", False), ("forkserver", False), ("spawn", True), ("forkserver", True)])
def test_parent_sigkill_leaves_no_orphans_or_shm(tmp_path, cli_env, start_method, whole_group):
    """The parent alone (its workers end with it), or its whole process group, the
    resource tracker included: nothing of the run tokens the workers pass may stay in
    /dev/shm. (``--lock``'s multiprocessing Lock would: see asyncsgd/modes/hogwild.py.)"""
    shm_before = shm_entries()
    proc = _start_training(tmp_path / "run", cli_env, "--start-method", start_method,
                           "--share-cores", "ring")
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 3  # the workers (and forkserver / resource tracker)
        if whole_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive, f"orphans after the parent was killed: {alive}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_no_shm_leak(shm_before)


@pytest.mark.parametrize("victim,reported", [
    ("worker", "was killed by signal SIGKILL"),
    ("forkserver", "was lost with the fork server that started it")])
def test_child_killed_by_sigkill_is_reported_clearly(tmp_path, cli_env, victim, reported):
    """The default start method forks workers from a fork server: a killed worker is
    reported as killed, and a killed fork server (which takes its workers along) as such."""
    shm_before = shm_entries()
    out = tmp_path / "run"
    proc = _start_training(out, cli_env, "--start-method", "forkserver")

    def kill(proc, children):
        def role(c):  # forked workers share the fork server's command line: its children
            line = " ".join(c.cmdline())
            if "resource_tracker" in line:
                return "resource_tracker"
            return "forkserver" if "forkserver" in line and c.ppid() == proc.pid else "worker"
        targets = [c for c in children if role(c) == victim]
        assert len([c for c in children if role(c) == "worker"]) >= 3
        targets[0].send_signal(signal.SIGKILL)

    _, stderr, stopped_in, _ = stop_tree(proc, kill)
    assert proc.returncode == 1, stderr
    assert reported in stderr and "Traceback" not in stderr, stderr
    assert_no_shm_leak(shm_before)
    assert read_json(out / "summary.json")["status"] == "failed"
    record_figure(f"Hogwild {victim} SIGKILL", reported=reported,
                  run_stopped_s=round(stopped_in, 1), orphans=0, shm_leaks=0)


def test_a_budget_shorter_than_start_up_ends_the_run_as_completed(tmp_path, run_cli):
    """--max-seconds 1 with 8 spawned workers, which take several seconds to import torch on
    2 cores: the workers still starting are stopped at once, and the parent's own SIGTERM is
    never reported as their failure (main: 'worker 0 was killed by signal SIGTERM', exit 1)."""
    started = time.monotonic()
    res = run_cli("hogwild", "--task", "tasks_for_tests:dense_counter", "--procs", 8,
                  "--epochs", 1000, "--max-seconds", 1, "--out", tmp_path / "run",
                  "--progress", "off", timeout=180)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    assert "killed by signal" not in res.stderr and "still running" not in res.stderr, res.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert (summary["status"], summary["stopped_by"]) == ("ok", "max_seconds")
    record_figure("hogwild budget shorter than start-up", max_seconds=1, procs=8,
                  wall_seconds=round(took, 1), status=summary["status"])
