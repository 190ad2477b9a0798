"""`asyncsgd ddp` and `single` failing: a raising rank, Ctrl-C, SIGTERM, torchrun, bad flags."""

import json
import signal
import sys
import time

import pytest
import torch

from asyncsgd.core.tasks import partition_indices
from conftest import (asyncsgd_cmd, one_line_error, read_json, signal_group, signal_parent,
                      start_training, stop_tree)

ROWS = 1000


def _seed_where_rank_owns_row_7(rank):
    return next(s for s in range(100) if 7 in partition_indices(ROWS, 2, rank, s).tolist())


@pytest.mark.parametrize("owner", [0, 1])
def test_raising_rank_surfaces_its_traceback_and_nobody_hangs(tmp_path, run_cli, owner):
    out = tmp_path / "run"
    started = time.monotonic()
    res = run_cli("ddp", "--task", "tasks_for_tests:failing_dense", "--samples", ROWS,
                  "--procs", 2, "--threads", 1, "--epochs", 50, "--progress", "off",
                  "--seed", _seed_where_rank_owns_row_7(owner), "--dist-timeout", 120,
                  "--out", out, timeout=180)
    took = time.monotonic() - started
    assert res.returncode == 1, res.stderr
    assert f"error: rank {owner} raised an exception" in res.stderr  # the cause, not its echo
    assert "ValueError: boom at row 7" in res.stderr
    assert took < 60  # the peer failed fast on the closed connection, not at --dist-timeout
    summary = read_json(out / "summary.json")  # rank 0 saved the run either way
    assert summary["status"] == "failed" and summary["stopped_by"] == "error"
    assert "boom at row 7" in summary["error"] and f"rank {owner}" in summary["error"]
    assert (out / "checkpoint.pt").exists()


def test_hanging_rank_ends_at_the_dist_timeout(tmp_path, run_cli):
    # Rank 1 sleeps for an hour inside a step; rank 0 waits in the all-reduce until
    # --dist-timeout, saves the run, and the parent ends the hung rank.
    out = tmp_path / "run"
    started = time.monotonic()
    res = run_cli("ddp", "--task", "tasks_for_tests:hanging_dense", "--samples", ROWS,
                  "--procs", 2, "--threads", 1, "--epochs", 50, "--progress", "off",
                  "--seed", _seed_where_rank_owns_row_7(1), "--dist-timeout", 5,
                  "--out", out, timeout=180)
    assert res.returncode == 1, res.stderr
    assert "error: rank 0 raised an exception" in res.stderr and "Timed out" in res.stderr
    assert time.monotonic() - started < 60
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed" and "Timed out" in summary["error"]


def test_single_raising_saves_the_run_and_reports(tmp_path, run_cli):
    out = tmp_path / "run"
    res = run_cli("single", "--task", "tasks_for_tests:failing_dense", "--threads", 1,
                  "--progress", "off", "--out", out)
    assert res.returncode == 1
    assert "error: training raised an exception" in res.stderr
    assert "ValueError: boom at row 7" in res.stderr
    assert read_json(out / "summary.json")["status"] == "failed"


@pytest.mark.parametrize("sig, group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_signal_stops_every_rank_saves_and_resumes(tmp_path, cli_env, sig, group):
    out = tmp_path / "run"
    proc = start_training(asyncsgd_cmd("ddp", "--task", "tasks_for_tests:dense_rows",
                                       "--procs", 2, "--threads", 1, "--epochs", 1_000_000,
                                       "--progress", "off", "--dist-timeout", 60, "--out", out),
                          out, cli_env)
    _, stderr, took, children = stop_tree(proc, (signal_group if group else signal_parent)(sig))
    assert proc.returncode == 128 + sig, stderr  # 130 for Ctrl-C, 143 for SIGTERM
    assert len(children) >= 2
    assert took < 30
    assert "Traceback" not in stderr
    assert f"--resume {out}" in stderr
    summary = read_json(out / "summary.json")
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "interrupted"
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["samples"] == summary["samples"] > 0


def test_single_ctrl_c_saves_the_run(tmp_path, cli_env):
    out = tmp_path / "run"
    proc = start_training(asyncsgd_cmd("single", "--task", "tasks_for_tests:dense_rows",
                                       "--threads", 1, "--epochs", 1_000_000, "--progress", "off",
                                       "--out", out), out, cli_env)
    _, stderr, took, _ = stop_tree(proc, signal_group(signal.SIGINT))
    assert proc.returncode == 130 and took < 15, stderr
    assert "Traceback" not in stderr
    summary = read_json(out / "summary.json")
    assert summary["status"] == "interrupted"
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["samples"] == summary["samples"] > 0


def test_sigterm_under_torchrun_stops_every_rank_and_saves(tmp_path, cli_env):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "asyncsgd", "ddp", "--task", "tasks_for_tests:dense_rows", "--threads", "1",
           "--epochs", "1000000", "--progress", "off", "--dist-timeout", "60", "--out", str(out)]
    proc = start_training(cmd, out, cli_env)
    _, stderr, took, children = stop_tree(proc, signal_parent(signal.SIGTERM))
    assert len(children) >= 2 and took < 45, stderr
    summary = read_json(out / "summary.json")  # torchrun passed SIGTERM on; rank 0 saved
    assert summary["status"] == "interrupted", stderr
    assert (out / "checkpoint.pt").exists()


@pytest.mark.parametrize("command, args, env, fragments", [
    ("ddp", ["--procs", "0"], {}, ["--procs", "0 is not in the range"]),
    ("ddp", ["--backend", "nccl"], {}, ["--backend nccl"]),
    ("ddp", ["--amp", "fp16"], {}, ["--amp fp16 needs --device cuda"]),
    ("single", ["--amp", "fp16"], {}, ["--amp fp16 needs --device cuda"]),
    ("ddp", ["--amp", "fp32"], {}, ["--amp", "'fp32' is not one of"]),
    ("ddp", ["--dist-timeout", "0"], {}, ["--dist-timeout"]),
    ("ddp", [], {"RANK": "0", "WORLD_SIZE": "2"}, ["$MASTER_ADDR", "torchrun"]),
    ("ddp", ["--procs", "3"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "1"}, ["--procs 3", "WORLD_SIZE=2"]),
    ("ddp", [], {"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}, ["$RANK='x' is not an integer"]),
])
def test_bad_input_gives_one_clear_line(run_cli_here, command, args, env, fragments):
    res = run_cli_here(command, *args, "--progress", "off", env=env)
    one_line_error(res, *fragments)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
@pytest.mark.parametrize("command", ["single", "ddp"])
def test_cuda_without_gpu_is_one_clear_line(run_cli_here, command):
    one_line_error(run_cli_here(command, "--device", "cuda", "--progress", "off"),
                   "no CUDA GPU", "--device cpu")


def test_resuming_another_modes_run_is_one_clear_line_from_rank_0(tmp_path, run_cli):
    # The check happens in rank 0 (it opens the checkpoint); the parent reports it as is.
    run = tmp_path / "hogwild-run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"mode": "hogwild", "config": {}}))
    res = run_cli("ddp", "--resume", run, "--procs", 2, "--threads", 1, "--progress", "off",
                  "--dist-timeout", 60)
    one_line_error(res, "is a hogwild run", "asyncsgd hogwild --resume")
    assert res.returncode == 2
