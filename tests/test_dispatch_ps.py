"""Dynamic dispatch on a real parameter server: every row once per epoch, a killed worker's
rows re-handed exactly."""

import signal
import subprocess

from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.run.kill_at import BEFORE_PUSH, VARIABLE
from conftest import (Server, asyncsgd_cmd, finish, periodic_checkpoint, read_json, shard_stats,
                      signal_group, stop_tree, wait_for, worker)

TASK = ("--task", "tasks_for_tests:regression", "--samples", 480)  # 384 training rows
CHUNK = 128  # core.dispatch.CHUNK: 3 chunks an epoch


def test_three_workers_of_different_speeds_one_killed_mid_chunk(server, cli_env, tmp_path):
    """Worker 0 is SIGKILLed with its 5th batch computed: it had pushed 4 batches of 16 of
    the chunks it held (two, 256 rows, when it reached the server first), so 192 rows (64
    of one chunk) come back; the others train them, and every row is trained exactly once
    in each of the 3 epochs."""
    epochs = 3
    srv = server(*TASK, "--workers", 3, "--data-dispatch", "dynamic", "--epochs", epochs,
                 "--heartbeat-timeout", 2)
    killed = subprocess.Popen(
        asyncsgd_cmd("worker", "--server", srv.address, "--rank", 0, "--world", 3, *TASK,
                     "--threads", 1, "--progress", "off", "--epochs", epochs),
        env={**cli_env, VARIABLE: f"{BEFORE_PUSH}:5"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    others = [worker(cli_env, srv.address, r, 3, *TASK, "--epochs", epochs,
                     "--delay", f"const:{ms}ms@{r}") for r, ms in ((1, 5), (2, 20))]
    code, _, err = finish([killed])[0]
    assert code == -9, err
    for code, _, err in finish(others):
        assert code == 0, err
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    assert summary["coverage"] == {"granularity": "sample", "min": epochs, "max": epochs,
                                   "mean": epochs, "spread": 1.0}
    # it held two chunks when it came first, one when the others had taken the epoch's rest
    # first (a loaded suite run started them before it: 64 rehanded once)
    assert summary["rehanded"] in (2 * CHUNK - 4 * 16, CHUNK - 4 * 16)
    assert summary["unattributed"] == 0


def saved_epoch(out) -> int:
    """The epoch of shard 0's latest checkpoint after updates (-1 before there is one)."""
    if not periodic_checkpoint(out):
        return -1
    return int(load_checkpoint(out / "shard-0.pt")["shard"]["dispatch"]["cursor"][0])


def test_a_server_killed_whole_and_resumed_continues_the_epochs_position(cli_env, tmp_path):
    """The resumed shard 0 starts where its checkpoint's dispatcher stood; the chunks out
    then come back (what was trained on them after it died with the parameters), so every
    row is still counted once per epoch; the push in flight across the kill is the only
    one trained beyond that (``unattributed``, at most a batch per worker)."""
    out, epochs = tmp_path / "run", 12
    args = (*TASK, "--workers", 2, "--data-dispatch", "dynamic", "--epochs", epochs)
    first = Server(cli_env, out, *args, "--checkpoint-every", 0.3, own_group=True)
    resumed, procs = None, []
    try:
        procs = [worker(cli_env, first.address, r, 2, *TASK, "--epochs", epochs, "--heartbeat",
                        0.2, "--delay", f"const:{ms}ms@{r}") for r, ms in ((0, 2), (1, 6))]
        # past epoch 0: CI once killed it on a checkpoint taken within the first epoch
        wait_for(lambda: saved_epoch(out) > 0, 60, "a checkpoint past the first epoch")
        stop_tree(first.proc, signal_group(signal.SIGKILL))
        saved = load_checkpoint(out / "shard-0.pt")["shard"]["dispatch"]
        resumed = Server(cli_env, out, "--resume", out, port=first.port, own_group=True)
        port = resumed.stats()["shard_ports"][0]
        at_start = shard_stats(resumed, port)["dispatch"]
        results = finish(procs, timeout=120)
        assert resumed.wait()[0] == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for srv in (first, resumed):
            if srv is not None:
                srv.close()
    for code, _, err in results:
        assert code == 0, err
    assert saved["cursor"][0] < epochs  # killed mid-run
    # it went on from there: the counts and the cursor restored, and what was out given back
    assert at_start["epoch"] >= saved["cursor"][0] > 0
    assert at_start["coverage"]["mean"] >= round(saved["counts"].double().mean().item(), 4)
    assert at_start["rehanded"] == saved["rehanded"] + sum(
        stop - start for chunks in saved["held"].values() for _, start, stop in chunks)
    summary = read_json(out / "summary.json")
    assert summary["coverage"]["min"] == summary["coverage"]["max"] == epochs
    assert summary["unattributed"] in (0, 16, 32)
