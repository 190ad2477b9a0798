"""Dynamic dispatch on a real parameter server: every row once per epoch, a killed worker's
rows re-handed exactly."""

import subprocess

from asyncsgd.run.kill_at import BEFORE_PUSH, VARIABLE
from conftest import asyncsgd_cmd, finish, read_json, worker

TASK = ("--task", "tasks_for_tests:regression", "--samples", 480)  # 384 training rows
CHUNK = 128  # core.dispatch.CHUNK: 3 chunks an epoch


def test_three_workers_of_different_speeds_one_killed_mid_chunk(server, cli_env, tmp_path):
    """Worker 0 is SIGKILLed with its 5th batch computed: it had pushed 4 batches of 16 of
    the two chunks it held (256 rows), so 192 rows come back; the others train them, and
    every row is trained exactly once in each of the 3 epochs."""
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
    assert summary["rehanded"] == 2 * CHUNK - 4 * 16
    assert summary["unattributed"] == 0
