"""Full checkpoints: a run stopped anywhere and resumed ends with exactly the parameters of
the same run never stopped (bit for bit, one process), with momentum, adam, a simulated
staleness queue or --accumulate (checkpoints fall between its steps), and a dropout model
(so torch's generator must continue too)."""

from __future__ import annotations

import signal

import pytest
import torch

from asyncsgd.config import DDPConfig, HogwildConfig, SingleConfig
from asyncsgd.modes import ddp, hogwild
from asyncsgd.modes.single import train
from asyncsgd.run.checkpoint import load_checkpoint, save_checkpoint

from conftest import (asyncsgd_cmd, one_line_error, read_events, read_json, signal_parent,
                      start_training, stop_tree)

TASK, SAMPLES, EPOCHS = "tasks_for_tests:dropout_regression", 160, 3
STEPS = EPOCHS * (SAMPLES * 4 // 5) // 16  # 128 training rows, batches of 16: 8 a epoch


def _cfg(out, config=SingleConfig, **settings) -> SingleConfig:
    return config(**{**dict(task=TASK, samples=SAMPLES, epochs=EPOCHS, threads=1,
                                  eval_every=1e6, checkpoint_every=0, progress="off",
                                  out=str(out)), **settings})


def _model(run_dir) -> dict:
    return load_checkpoint(run_dir / "checkpoint.pt")["model"]


def _stopped_midway(tmp_path, monkeypatch, run=train, rows=128, **settings):
    """A run stopped by --max-seconds part way through (not at an epoch's end): each step
    sleeps 20 ms, and the budget is cut until the stop lands inside the run."""
    monkeypatch.setenv("ASYNCSGD_TEST_STEP_SLEEP", "0.02")
    for budget in (0.35, 0.2, 0.1, 0.6, 0.05):
        out = tmp_path / f"stopped-{budget}"
        result = run(_cfg(out, max_seconds=budget, **settings))
        state = load_checkpoint(out / "checkpoint.pt")["state"]
        row = state["processes"][0]["row"]
        if result.summary["stopped_by"] == "max_seconds" and 0 < row < rows:
            return out, state
    pytest.fail("no budget stopped the run inside an epoch")


@pytest.mark.parametrize("settings", [
    dict(momentum=0.9, weight_decay=0.01),
    dict(optimizer="adam", weight_decay=0.01),
    dict(momentum=0.5, simulate_staleness=2),
    dict(momentum=0.9, accumulate=2, clip_grad_norm=0.5),
], ids=["momentum", "adam", "staleness", "accumulate-clip"])
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch, settings):
    whole = tmp_path / "whole"
    train(_cfg(whole, **settings))
    stopped, state = _stopped_midway(tmp_path, monkeypatch, **settings)
    assert state["optimizer"] is not None
    monkeypatch.setenv("ASYNCSGD_TEST_STEP_SLEEP", "0")
    result = train(_cfg(None, resume=str(stopped), **settings))
    assert result.summary["stopped_by"] == "epochs"
    want, got = _model(whole), _model(stopped)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.processes
def test_a_resumed_ddp_run_is_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
    """Two ranks: the update rule (equal on both), the shared position and each rank's own
    generator continue."""
    settings = dict(config=DDPConfig, procs=2, momentum=0.9, eval_every=1e5)
    whole = tmp_path / "whole"
    ddp.train(_cfg(whole, **settings))
    stopped, state = _stopped_midway(tmp_path, monkeypatch, run=ddp.train, rows=64, **settings)
    assert len(state["processes"]) == 2
    assert not torch.equal(state["processes"][0]["rng"]["torch"],
                           state["processes"][1]["rng"]["torch"])
    monkeypatch.setenv("ASYNCSGD_TEST_STEP_SLEEP", "0")
    ddp.train(_cfg(None, resume=str(stopped), **settings))
    want, got = _model(whole), _model(stopped)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_the_oracle_tells_a_model_only_resume_apart(tmp_path, monkeypatch):
    """Without its training state (a version-1 checkpoint), the resumed momentum run is not
    the uninterrupted one, and the resume says what starts afresh."""
    settings = dict(momentum=0.9)
    whole = tmp_path / "whole"
    train(_cfg(whole, **settings))
    stopped, _ = _stopped_midway(tmp_path, monkeypatch, **settings)
    record = load_checkpoint(stopped / "checkpoint.pt")
    del record["state"]
    record["version"] = 1
    save_checkpoint(stopped / "checkpoint.pt", record)
    monkeypatch.setenv("ASYNCSGD_TEST_STEP_SLEEP", "0")
    train(_cfg(None, resume=str(stopped), **settings))
    want, got = _model(whole), _model(stopped)
    assert not all(torch.equal(want[name], got[name]) for name in want)


@pytest.mark.parametrize("mode, sleep", [(["single", "--threads", "1"], "0.05"),
                                         (["hogwild", "--procs", "1"], "0.1")],
                         ids=["single", "hogwild-1"])
def test_sigterm_then_resume_from_the_cli_continues_exactly(tmp_path, run_cli, cli_env, mode,
                                                            sleep):
    """What a user does: SIGTERM a run part way (exit 143, saved), --resume it; its final
    parameters are those of the run never stopped. One Hogwild worker races nobody, so its
    resume is exact too: its momentum buffer, place in the data and generator live in
    shared memory the parent checkpoints once the worker has stopped."""
    common = [*mode, "--task", TASK, "--samples", str(SAMPLES), "--epochs", str(EPOCHS),
              "--momentum", "0.9", "--eval-every", "1000000", "--progress", "off"]
    assert run_cli(*common, "--out", tmp_path / "whole").returncode == 0
    stopped = tmp_path / "stopped"
    env = {**cli_env, "ASYNCSGD_TEST_STEP_SLEEP": sleep}
    proc = start_training(asyncsgd_cmd(*common, "--out", stopped), stopped, env)
    _, err, _, _ = stop_tree(proc, signal_parent(signal.SIGTERM), timeout=120)
    assert proc.returncode == 143, err
    (worker,) = load_checkpoint(stopped / "checkpoint.pt")["state"]["processes"]
    assert (worker["epoch"], worker["row"]) != (EPOCHS, 0)
    assert worker["rng"] is not None
    assert run_cli(mode[0], "--resume", stopped, "--progress", "off").returncode == 0
    want, got = _model(tmp_path / "whole"), _model(stopped)
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.processes
def test_hogwild_checkpoints_every_workers_state(tmp_path):
    """Two workers: each one's own momentum buffer (not the same: their batches differ), its
    own position at the end of the run, and its own generator."""
    out = tmp_path / "run"
    hogwild.train(_cfg(out, config=HogwildConfig, procs=2, momentum=0.9, epochs=1))
    a, b = load_checkpoint(out / "checkpoint.pt")["state"]["processes"]
    assert (a["epoch"], a["row"]) == (b["epoch"], b["row"]) == (1, 0)
    assert not torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert not torch.equal(a["optimizer"]["buffers"][0], b["optimizer"]["buffers"][0])


def test_two_hogwild_workers_resume_each_where_it_stopped(tmp_path, run_cli, cli_env):
    """Stopped part way and resumed, two workers together train on exactly every row of
    every epoch once: each continued from its own saved row (a restart of the epoch would
    count more samples, a skip fewer). Each worker's 6 steps sleep 0.3 s: at 0.1 s a loaded
    machine (load 4) let both finish before the SIGTERM that follows the first train event."""
    out = tmp_path / "run"
    common = ["--task", TASK, "--samples", str(SAMPLES), "--epochs", str(EPOCHS),
              "--momentum", "0.9", "--eval-every", "1000000", "--progress", "off"]
    env = {**cli_env, "ASYNCSGD_TEST_STEP_SLEEP": "0.3"}
    proc = start_training(asyncsgd_cmd("hogwild", "--procs", "2", *common, "--out", out),
                          out, env)
    _, err, _, _ = stop_tree(proc, signal_parent(signal.SIGTERM), timeout=120)
    assert proc.returncode == 143, err
    state = load_checkpoint(out / "checkpoint.pt")["state"]
    assert [(p["epoch"], p["row"]) for p in state["processes"]] != [(EPOCHS, 0)] * 2
    res = run_cli("hogwild", "--resume", out, "--progress", "off")
    assert res.returncode == 0, res.stderr
    assert read_json(out / "summary.json")["samples"] == 128 * EPOCHS


@pytest.mark.parametrize("change, fragment", [
    (lambda state: state["processes"][0].update(row=10 ** 6),
     "resumes at row 1000000 of an epoch of 128 rows"),
    (lambda state: state["processes"][0].update(epoch="x"), "malformed training state"),
    (lambda state: state["optimizer"]["buffers"].update({0: torch.zeros(3)}),
     "optimizer buffer 0 has shape (3,)"),
])
def test_a_saved_state_that_does_not_fit_is_one_line_and_trains_nothing(tmp_path, run_cli,
                                                                        change, fragment):
    out = tmp_path / "run"
    train(_cfg(out, momentum=0.9, epochs=1))
    record = load_checkpoint(out / "checkpoint.pt")
    change(record["state"])
    save_checkpoint(out / "checkpoint.pt", record)
    before = len(read_events(out))
    res = run_cli("single", "--resume", out, "--epochs", "2", "--progress", "off")
    one_line_error(res, fragment)
    # refused before the run was touched, or its resume ended at once as failed
    added = [(e["event"], e.get("status")) for e in read_events(out)[before:]]
    assert added in ([], [("resume", None), ("stop", "failed")]), added
    assert torch.equal(load_checkpoint(out / "checkpoint.pt")["model"]["net.0.weight"],
                       record["model"]["net.0.weight"])
