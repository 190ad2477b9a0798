"""Runs that end as asked on a busy machine, started through the installed CLI.

Beside ``SPINNERS`` busy processes on this host (on two cores a load average of
4 and more, as other work often makes it): ``--max-seconds`` is the time the
command takes, start-up and stop included, within ``OVERRUN`` seconds; a run
that met it ends exit 0, status ok, without stopping any process by force; and
``single`` leaves the busy cores to the work that holds them.

Before ``run/lifetime.py``, ``hogwild --procs 8 --max-seconds 15`` beside 6
busy processes ended 25 s after it started: 5.3 s of imports before its clock
started, 3.1 s for 8 workers to tear torch down, 1.7 s for the parent's.
"""

import os
import subprocess
import sys
import time

import pytest

from asyncsgd.run.process_group import available_cores
from conftest import Server, asyncsgd_cmd, finish, read_json, worker
from faults import record_figure

# They load the machine on purpose and time the commands: make test runs them alone
pytestmark = pytest.mark.solo

SPINNERS = 4
BUDGET = 12
# Five processes importing torch beside the spinners: the server and both workers were
# ready 8.7 s after the launch, and in 2 of 3 runs later than 12 s (no update at all)
PS_BUDGET = 20
# DDP's ranks took 14.0-17.2 s only to start beside the spinners on a 2-vCPU AMD EPYC (the
# parent 4 s, the ranks in their group at 8.4 s, DDP's constructor importing torch._dynamo
# 5 s more), so --max-seconds 12 ended at 14-20 s: the ranks stop at their first check,
# after start-up. A budget it can start within, as the server's
DDP_BUDGET = 20
OVERRUN = 6  # seconds; measured beside 4 spinners: hogwild 0.4, ddp 0.8, ps-server 1.8
FORCED = ("still running", "SIGTERM", "SIGKILL", "killed by signal")
TASK = ("--task", "tasks_for_tests:dense_rows", "--epochs", 1_000_000, "--progress", "off")


@pytest.fixture(scope="module")
def busy_machine():
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(SPINNERS)]
    try:
        yield
    finally:
        for s in spinners:
            s.kill()
            s.wait()


def _timed(cli_env, *args) -> tuple:
    started = time.monotonic()
    res = subprocess.run(asyncsgd_cmd(*args), env=cli_env, capture_output=True, text=True,
                         timeout=180, stdin=subprocess.DEVNULL)
    return res, time.monotonic() - started


def _ended_on_budget(res, seconds: float, out, budget: float = BUDGET) -> dict:
    assert res.returncode == 0, res.stderr
    summary = read_json(out / "summary.json")
    assert (summary["status"], summary["stopped_by"]) == ("ok", "max_seconds"), summary
    assert seconds <= budget + OVERRUN, (seconds, res.stderr)
    forced = [line for line in res.stderr.splitlines() if any(f in line for f in FORCED)]
    assert not forced, res.stderr
    return summary


@pytest.mark.parametrize("mode, args, budget", [
    ("hogwild", ("--procs", 8), BUDGET),
    ("ddp", ("--procs", 2, "--dist-timeout", 120), DDP_BUDGET),
])
def test_max_seconds_is_the_commands_time_on_a_busy_machine(busy_machine, cli_env, tmp_path,
                                                            mode, args, budget):
    out = tmp_path / "run"
    res, seconds = _timed(cli_env, mode, *args, *TASK, "--max-seconds", budget, "--out", out)
    # Whether it trained at all depends on the machine (a fresh clone's first run of 8
    # processes beside the spinners took longer than the budget to start); how it ends,
    # and when, must not.
    summary = _ended_on_budget(res, seconds, out, budget)
    record_figure(f"{mode} --max-seconds {budget} beside {SPINNERS} busy processes",
                  seconds=round(seconds, 1), training_seconds=summary.get("train_seconds"),
                  samples=summary["samples"])


def test_ps_server_stops_its_shards_and_workers_without_force(busy_machine, cli_env, tmp_path):
    """The server's budget holds its shards' start-up; at the end every shard drains and
    saves on its own (no 'still running; sending SIGTERM'), and the workers, told 'bye',
    end exit 0."""
    started = time.monotonic()
    srv = Server(cli_env, tmp_path / "run", "--task", TASK[1], "--shards", 2, "--workers", 2,
                 "--max-seconds", PS_BUDGET)
    try:
        # a worker too slow to join before the budget ended gives up within the wait below
        workers = [worker(cli_env, srv.address, r, 2, *TASK, "--server-timeout", 30)
                   for r in range(2)]
        code, _, err = srv.wait(timeout=180)
        seconds = time.monotonic() - started
        results = finish(workers, timeout=60)
    finally:
        srv.close()
    res = subprocess.CompletedProcess([], code, "", err)
    summary = _ended_on_budget(res, seconds, tmp_path / "run", PS_BUDGET)
    assert summary["updates"] > 0
    joined = len(summary["workers_joined"])
    late = 0
    for w_code, _, w_err in results:
        assert not any(f in w_err for f in FORCED), w_err
        if w_code != 0 and "no answer from the server" in w_err and "joined" not in w_err:
            # Started too slowly to reach the server within its budget (a CI run beside
            # other work once took more than 12 s): it never joined, so no one could tell
            # it the run had ended; it says so in one line instead of hanging.
            late += 1
            assert w_err.strip().splitlines()[-1].startswith("error: no answer from the server")
            continue
        assert w_code == 0, w_err
    assert joined >= 1 and joined + late == 2, (summary["workers_joined"], late)
    record_figure(f"ps-server --max-seconds {PS_BUDGET} beside {SPINNERS} busy processes",
                  seconds=round(seconds, 1), updates=summary["updates"], late_workers=late)


def test_single_leaves_busy_cores_alone(busy_machine, run_cli, tmp_path):
    """Default --threads: the cores not busy with other work (the 1-minute load average),
    at least 1 (what a thread per busy core costs: experiments/README.md, "The synchronous
    modes")."""
    deadline = time.monotonic() + 90
    while os.getloadavg()[0] < 1.0 and time.monotonic() < deadline:
        time.sleep(1)  # the 1-minute average rises by about 1 in 20 s beside 4 spinners
    before = os.getloadavg()[0]
    assert before >= 1.0, "the spinners did not raise the load average"
    res = run_cli("single", "--task", "tasks_for_tests:dense_rows", "--epochs", 1,
                  "--progress", "off", "--out", tmp_path / "run")
    after = os.getloadavg()[0]
    assert res.returncode == 0, res.stderr
    threads = read_json(tmp_path / "run" / "summary.json")["threads"]
    cores = available_cores()
    assert threads in {max(1, cores - int(load)) for load in (before, after)}, (threads, cores,
                                                                              before, after)
    if cores > 1:
        assert threads < cores
