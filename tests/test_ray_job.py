"""``asyncsgd ray-job`` and ``asyncsgd.ray`` on Ray clusters the tests start: a worker
actor's process SIGKILLed mid-run (Ray restarts it, it rejoins, nothing is lost); a worker
dead for good (the job stops, saved, and resumes to the target); three Ray nodes on this
host (the server beside the driver); the installed CLI with a Ray of its own, its errors,
Ctrl-C and SIGTERM. Every process a test starts (Ray's own, the actors', the shards)
carries a marker in its environment: none may outlive it.

Ray is the ``ray`` extra, which the suite's setup installs (pip install -e '.[dev,ray]'):
without it this file fails to import rather than skip, so CI cannot pass without it."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

import asyncsgd.ray
from asyncsgd import ps
from asyncsgd.errors import AsyncSGDError
from conftest import (asyncsgd_cmd, free_port, marked_processes, one_line_error, read_events,
                      read_json, wait_for)

pytestmark = pytest.mark.processes  # every test starts Ray

try:
    import ray
except ImportError as exc:  # not a skip: the suite's setup installs the extra
    raise ImportError("tests/test_ray_job.py needs Ray: pip install -e '.[dev,ray]' "
                      "(make setup does)") from exc

TARGET = 0.85
JOB_SECONDS = 240  # a job reached 0.85 in 11-13 s on 2 idle cores; a loaded machine is slower
STATS_SECONDS = 30  # the server answered ps-stats in ms; on 2 loaded cores once not in 5 s
JOB = dict(task="mnist1d-cnn", workers=2, target=TARGET, epochs=1000, progress="off")


def readme_command() -> list:
    """docs/cluster.md's ``cluster:ray`` block as asyncsgd's arguments (the tests run what users
    copy, adding --out)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "cluster.md").read_text()
    found = re.search(r"<!-- cluster:ray -->\n```bash\n(.+?)\n```", text, re.S)
    assert found, "docs/cluster.md has no cluster block ray"
    argv = shlex.split(found.group(1))
    assert argv[:2] == ["asyncsgd", "ray-job"], argv
    return argv[1:]


def job_processes(mark: str) -> list:
    """The job's processes (its actors and the shards) among the marked ones: not Ray's."""
    found = []
    for p in marked_processes(mark):
        try:
            line = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "AsyncSGD" in line or "multiprocessing" in line:
            found.append(p)
    return found


def stats(job) -> dict:
    return ps.stats(job.address, timeout=STATS_SECONDS)


def trained(out) -> bool:
    """The server evaluated after some updates (a last line still being written is not
    read)."""
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "eval" and event.get("updates", 0) > 0:
            return True
    return False


def _gone(mark: str) -> None:
    gone, alive = psutil.wait_procs(marked_processes(mark), timeout=20)
    assert not alive, f"processes outlived the test: {alive}"


@pytest.fixture
def local_ray(monkeypatch, cache_dir):
    """A Ray cluster of 2 CPUs started by the test, as a user's script starts one; every
    process it and the job start carries the marker (Ray's processes inherit this
    process's environment, the actors the raylet's, the shards the server actor's)."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("ASYNCSGD_TEST_MARK", mark)
    monkeypatch.setenv("ASYNCSGD_CACHE", str(cache_dir))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # ray.init would join that cluster
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit 107 bytes
    began = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, logging_level="WARNING")
    print(f"ray.init took {time.monotonic() - began:.1f} s")
    try:
        yield mark
    finally:
        ray.shutdown()
        try:
            _gone(mark)
        finally:
            shutil.rmtree(temp, ignore_errors=True)


def check_reached(result, workers: int) -> None:
    summary = result.summary
    assert summary["status"] == "ok" and summary["stopped_by"] == "target", summary
    # the best, not the final, evaluation: pushes in flight when the target was reached are
    # still applied before the final one (a run here reached 86.4% and ended at 83.0%)
    assert summary["best_metric"] >= TARGET and summary["time_to_target"] is not None, summary
    assert len(summary["workers_joined"]) == workers, summary
    assert summary["lost_updates"] == 0 and summary["shard_restarts"] == 0, summary
    assert read_json(os.path.join(result.run_dir, "summary.json"))["final_metric"] == \
        summary["final_metric"]


# Known bug, open: on 2026-11-28 with ray 2.60.0 (and 2.59.0) this failed 4 times in 4 alone
# on an idle machine, on 73d23e8 as well (it passed once inside the whole suite): Ray restarts
# the actor, then the server's front leaves a stats request unanswered for 30 s. Still run,
# so a fix shows as XPASS.
@pytest.mark.xfail(reason="the front stops answering stats after a restarted worker actor "
                          "rejoins (open bug, fails on 73d23e8 too)", strict=False)
@pytest.mark.slow
def test_a_killed_worker_actor_is_restarted_and_rejoins(local_ray, tmp_path):
    """SIGKILL of a worker actor's process once the server applied updates: Ray restarts
    it, the new incarnation pushes again, the job reaches the target, the restart is
    counted and no update is lost."""
    victim = 1
    # rank 0 waits twice its compute time after each step: alone after the kill it cannot
    # reach the target before the victim is back, however loaded the cores (a restart took
    # 2-4 s here; training from the kill to the target alone ~10 s on idle cores)
    with asyncsgd.ray.start(**JOB, out=str(tmp_path / "run"), max_restarts=2,
                            slowdown="0:3") as job:
        name = f"-r{victim}"

        def pushes() -> int:
            counters = stats(job)["workers"]
            return sum(w["pushes"] for n, w in counters.items() if n.endswith(name))

        wait_for(lambda: stats(job)["updates"] >= 200 and pushes() > 0, JOB_SECONDS / 2,
                 "the job to train", every=0.1)
        [first] = job.incarnations()[victim]
        # not at Ray's default nice 15, which starved the job beside busy processes
        assert psutil.Process(first["pid"]).nice() == 0
        assert psutil.Process(job.server_place["pid"]).nice() == 0
        psutil.Process(first["pid"]).send_signal(signal.SIGKILL)  # the actor's process
        killed, before = time.monotonic(), pushes()
        restarted = wait_for(lambda: len(job.incarnations()[victim]) == 2 and time.monotonic(),
                             60, "Ray to restart the worker's actor", every=0.1)
        rejoined = wait_for(lambda: pushes() > before and time.monotonic(), 60,
                            "the restarted worker to push", every=0.1)
        print(f"restarted {restarted - killed:.1f} s after the kill, pushing again after "
              f"{rejoined - killed:.1f} s")
        second = job.incarnations()[victim][1]
        assert second["pid"] != first["pid"]
        result = job.wait()
    gone, alive = psutil.wait_procs(job_processes(local_ray), timeout=5)
    assert not alive, f"the job's processes outlived it in the caller's Ray: {alive}"
    check_reached(result, workers=2)
    assert result.restarts == {0: 0, 1: 1} and result.total_restarts == 1
    assert result.workers[victim] is not None and result.workers[victim].pushes > 0
    assert result.summary["lost_updates"] == 0


@pytest.mark.slow
def test_a_worker_dead_for_good_stops_the_job_which_resumes(local_ray, tmp_path):
    """Out of restarts, a dead worker ends the job: the driver kills the other worker, the
    server saves its run, and the error says how to continue it, which works: asyncsgd.ray.run
    on the Ray this process started, 2 worker actors, a server actor with 2 shards, to 85%;
    the job's actors and shards are gone when it returns."""
    out = tmp_path / "run"
    with asyncsgd.ray.start(**JOB, out=str(out), max_restarts=0, shards=2) as job:
        wait_for(lambda: stats(job)["updates"] >= 200, JOB_SECONDS / 2, "the job to train",
                 every=0.1)
        psutil.Process(job.incarnations()[1][0]["pid"]).send_signal(signal.SIGKILL)
        with pytest.raises(AsyncSGDError, match=(
                r"^worker 1's actor died and Ray restarted it 0 time\(s\) of --max-restarts 0 "
                rf"\(.+\); the job stopped; continue its run with: asyncsgd ray-job --resume "
                rf"{out}$")):
            job.wait()
    gone, alive = psutil.wait_procs(job_processes(local_ray), timeout=5)
    assert not alive, f"the job's processes outlived it in the caller's Ray: {alive}"
    summary = read_json(out / "summary.json")
    assert summary["status"] == "interrupted", summary
    saved = [e["updates"] for e in read_events(out) if e["event"] == "eval" and "updates" in e][-1]
    assert saved >= 200 and (out / "checkpoint.pt").is_file()
    began = time.monotonic()
    result = asyncsgd.ray.run(resume=str(out), target=TARGET, epochs=1000, progress="off")
    check_reached(result, workers=2)
    print(f"job to {TARGET}: {time.monotonic() - began:.1f} s, "
          f"time_to_target {result.summary['time_to_target']:.1f} s")
    assert result.run_dir == str(out) and result.summary["updates"] > saved
    assert [e["event"] for e in read_events(out)].count("resume") == 1
    assert result.restarts == {0: 0, 1: 0}
    for rank, worker in result.workers.items():  # each told by the server: target reached
        assert worker is not None and worker.stats.get("ended_by_server"), (rank, worker)
        assert worker.pushes > 0
    gone, alive = psutil.wait_procs(job_processes(local_ray), timeout=5)
    assert not alive, f"the job's processes outlived it in the caller's Ray: {alive}"


@pytest.mark.slow
def test_on_three_nodes_the_server_runs_beside_the_driver(monkeypatch, cache_dir, tmp_path):
    """Three Ray nodes on this host (Ray's own test cluster: a raylet each), the head with
    no CPU for workers, so Ray puts one on each of the others; the server's actor, pinned,
    runs on the driver's node and listens on every interface for them."""
    from ray.cluster_utils import Cluster
    mark = uuid.uuid4().hex
    monkeypatch.setenv("ASYNCSGD_TEST_MARK", mark)
    monkeypatch.setenv("ASYNCSGD_CACHE", str(cache_dir))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    temp = tempfile.mkdtemp(prefix="ray-")
    # Ray's Cluster writes the head's address to $RAY_TMPDIR/ray whatever temp_dir says
    # (/tmp/ray by default, which need not exist: FileNotFoundError)
    monkeypatch.setenv("RAY_TMPDIR", temp)
    os.makedirs(os.path.join(temp, "ray"))
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "temp_dir": temp})
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, logging_level="WARNING")
        workers_nodes = {n["NodeID"] for n in ray.nodes()
                         if n["Alive"] and n["Resources"].get("CPU", 0) > 0}
        assert len(workers_nodes) == 2
        with asyncsgd.ray.start(**JOB, out=str(tmp_path / "run")) as job:
            here = ray.get_runtime_context().get_node_id()
            assert job.server_place["node"] == here  # (Ray 2.9 attaches the driver to any
            # of the nodes on its host, 2.60 to the head)
            assert {s[0]["node"] for s in job.incarnations().values()} == workers_nodes
            assert job.address.startswith(f"tcp://{job.server_place['ip']}:")
            result = job.wait()
        check_reached(result, workers=2)
        assert read_json(tmp_path / "run" / "config.json")["config"]["bind"] == "tcp://0.0.0.0:0"
    finally:
        ray.shutdown()
        cluster.shutdown()
        try:
            _gone(mark)
        finally:
            shutil.rmtree(temp, ignore_errors=True)


def test_help_and_settings_refused_before_ray_starts(run_cli):
    """--help lists Ray's options with the server's and workers'; contradictory settings are
    one clear line before any Ray starts."""
    res = run_cli("ray-job", "--help", timeout=60)
    assert res.returncode == 0, res.stderr
    for flag in ("--workers", "--cpus-per-worker", "--gpus-per-worker", "--max-restarts",
                 "--address", "--start-timeout", "--shards", "--target", "--resume"):
        assert flag in res.stdout, flag
    assert "--servers" not in res.stdout and "--local-workers" not in res.stdout
    one_line_error(run_cli("ray-job", "--device", "cuda", timeout=60),
                   "--device cuda needs --gpus-per-worker")
    one_line_error(run_cli("ray-job", "--address", "ray://head:10001", timeout=60),
                   "Ray Client is not supported")
    one_line_error(run_cli("ray-job", "--workers", "0", timeout=60), "--workers")
    port = free_port()  # nothing listens there: Ray alone would retry for minutes
    one_line_error(run_cli("ray-job", "--address", f"127.0.0.1:{port}", timeout=60),
                   f"cannot reach the Ray cluster at 127.0.0.1:{port}", "Connection refused")


def test_without_ray_installed_the_command_says_how_to_get_it(run_cli, cli_env, tmp_path):
    """A Python without Ray (a ``ray`` module that fails to import stands first on its
    path): one line naming the extra, before anything starts."""
    (tmp_path / "ray.py").write_text("raise ImportError(\"No module named 'ray'\")\n")
    cli_env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), cli_env["PYTHONPATH"]])
    one_line_error(run_cli("ray-job", "--progress", "off", timeout=60),
                   "asyncsgd ray-job needs Ray: pip install 'asyncsgd[ray]'")


def _cli_job(cli_env, mark, args):
    env = {**cli_env, "ASYNCSGD_TEST_MARK": mark, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.Popen(asyncsgd_cmd(*args), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _finish(proc, mark, timeout=JOB_SECONDS):
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _gone(mark)
    return proc.returncode, output


def test_an_error_in_an_actor_is_one_clear_line_and_nothing_is_left(cli_env):
    """A setting only the server's actor can check (the task): its error crosses Ray as
    the same one-line error as ps-server's, and the Ray the command started is gone."""
    mark = uuid.uuid4().hex
    code, output = _finish(_cli_job(cli_env, mark, ["ray-job", "--task", "no-such-task",
                                                    "--progress", "off"]), mark, timeout=120)
    assert code == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert errors[0].startswith("error: the server: unknown task 'no-such-task'"), output
    assert "Traceback" not in output, output


@pytest.mark.slow
def test_the_cli_runs_a_job_on_a_ray_of_its_own(cli_env, tmp_path):
    """The guide's command: a local Ray of its own, the job to the target, the report
    (restarts, lost updates, accuracy, run directory), and no process left. Its output, as
    in a log file (``> log.txt 2>&1``), is plain text: the actors' lines without colour
    codes, and without Ray's notice that token authentication is on."""
    mark, out = uuid.uuid4().hex, tmp_path / "run"
    code, output = _finish(_cli_job(cli_env, mark, readme_command() + ["--out", out]), mark)
    assert code == 0, output
    assert "Traceback" not in output, output
    assert "(AsyncSGDServer pid=" in output, output  # the server actor's progress lines
    assert "\x1b" not in output, output
    assert "Token authentication is enabled" not in output, output
    assert "2 worker(s), 0 restarted by Ray; 0 lost update(s)" in output, output
    assert re.search(r"final test accuracy: \d", output) and "stopped by: target" in output
    assert f"run directory: {out}" in output, output
    summary = read_json(out / "summary.json")
    assert summary["stopped_by"] == "target" and summary["best_metric"] >= TARGET


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_actor_and_the_server_saves_its_run(cli_env, tmp_path,
                                                                          stop):
    """Ctrl-C reaches the whole process group (Ray's own processes too, which ignore it;
    the actors run in groups of their own); SIGTERM (kill, Slurm, Kubernetes) only the
    driver. Either way the driver stops the job and shuts its Ray down."""
    mark, out = uuid.uuid4().hex, tmp_path / "run"
    proc = _cli_job(cli_env, mark, ["ray-job", "--workers", "2", "--epochs", "1000",
                                    "--out", out, "--progress", "off"])
    try:
        wait_for(lambda: proc.poll() is not None or trained(out), JOB_SECONDS / 2,
                 "the job to train", every=0.2)
        assert proc.poll() is None, proc.communicate()[0]
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
    finally:
        code, output = _finish(proc, mark, timeout=120)
    assert code == (130 if stop == "ctrl-c" else 143), output  # 128 + the signal
    assert f"continue with: asyncsgd ray-job --resume {out}" in output, output
    summary = read_json(out / "summary.json")
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "interrupted"
    assert (out / "checkpoint.pt").is_file()
