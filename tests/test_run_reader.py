"""run.reader.Run, the one reader of a run directory: what the API (load_run) and the
reports (compare, plot) each read from it. Files only: no process, no socket."""

import pytest

from asyncsgd.analysis.report import Goal
from asyncsgd.config import SingleConfig
from asyncsgd.core.scoring import ACCURACY
from asyncsgd.errors import CheckpointError
from asyncsgd.run.metrics import MetricsLog, summarize
from asyncsgd.run.reader import Run
from asyncsgd.run.rundir import RunDir

TASK = {"name": "synthetic", "train_samples": 100, "test_samples": 10,
        "metric": ACCURACY.describe()}


def _write(path, mode="single", summary=True):
    """A run that trained 80 samples and scored 0.5; summary.json only when ``summary``."""
    run = RunDir.create(str(path), mode)
    run.write_config(mode, {"seed": 3, "lr": 0.05}, TASK, argv=[])
    metrics = MetricsLog(run)
    metrics.write("start", 0.0, 0)
    metrics.write("train", 1.0, 80, worker=0, loss=2.0, steps=10, epoch=0)
    metrics.write("eval", 1.5, 80, loss=1.0, accuracy=0.5)
    metrics.close()
    if summary:
        run.write_summary(summarize(list(run.events()), mode=mode, task="synthetic",
                                    target=None, stopped_by="epochs"))
    return path


def test_a_finished_run_reads_alike_for_the_api_and_the_report(tmp_path):
    run = Run.load(_write(tmp_path / "done"))
    assert run.mode == "single" and run.seed == 3 and run.record["config"]["lr"] == 0.05
    assert isinstance(run.config, SingleConfig) and (run.config.seed, run.config.lr) == (3, 0.05)
    assert run.metrics is run.events and [e["event"] for e in run.events] == [
        "start", "train", "eval"]
    assert run.recorded_summary and run.summarized is run.summary
    assert run.summary["samples"] == 80 and run.summary["status"] == "ok"
    assert run.numbers(Goal(ACCURACY, 0.5))["time_to_target"] == 1.5


def test_a_killed_run_has_no_summary_for_the_api_and_a_made_up_one_for_the_report(tmp_path):
    run = Run.read(_write(tmp_path / "killed", summary=False))
    assert run.summary == {} and not run.recorded_summary
    assert run.summarized["status"] == "incomplete" and run.summarized["samples"] == 80
    assert run.numbers(Goal(ACCURACY))["samples"] == 80
    assert run.outcome() == ("ok", None)
    assert Run.load(tmp_path / "killed").summary == {}


def test_load_refuses_what_the_report_still_reads(tmp_path):
    _write(tmp_path / "other", mode="worker")
    assert Run.read(tmp_path / "other").seed == 3  # a report reads any mode's directory
    with pytest.raises(CheckpointError, match="holds a run of mode 'worker'; load_run reads"):
        Run.load(tmp_path / "other")
    _write(tmp_path / "torn")
    (tmp_path / "torn" / "summary.json").write_text("{")
    assert Run.read(tmp_path / "torn").summarized["status"] == "incomplete"
    with pytest.raises(CheckpointError, match="summary.json is not valid JSON"):
        Run.load(tmp_path / "torn")
