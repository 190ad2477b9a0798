"""A run directory read back: its settings, events and summary, its task and model.

The one reader of the Python API (``asyncsgd.load_run``) and of the reports
(``compare``, ``plot``), so that both see a run the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import config_from_dict
from ..core.scoring import Metric
from ..core.tasks import Task, task_of
from ..errors import CheckpointError
from .checkpoint import load_checkpoint
from .metrics import (bytes_to_target, first_progress, samples_to_target, scores,
                      steady_throughput, summarize, time_to_target)
from .rundir import SUMMARY, RunDir
from .settings import MODES, saved_settings


@dataclass
class Run:
    """A finished (or running, or killed) run, read back."""

    path: Path
    record: dict  # config.json: mode, settings, task, versions, host, command line
    events: list  # every event of metrics.jsonl, oldest first
    summary: dict  # summary.json; empty while the run has not ended
    recorded_summary: bool = True  # False: summary.json is missing or unreadable
    _task: Optional[Task] = field(default=None, repr=False, compare=False)

    @classmethod
    def read(cls, path) -> "Run":
        """Any run directory, of any mode, whole or cut short."""
        run = RunDir.open(str(path))
        try:
            summary, recorded = run.read_summary(), True
        except CheckpointError:  # killed before the end (``summarized`` makes one up)
            summary, recorded = {}, False
        return cls(run.path, run.read_config(), list(run.events()), summary, recorded)

    @classmethod
    def load(cls, path) -> "Run":
        """A training run whose settings, task and model can be loaded (``load_run``):
        refused, with one line, where its mode or its summary.json cannot be read."""
        run = cls.read(path)
        if run.mode not in MODES:
            raise CheckpointError(f"{path} holds a run of mode {run.mode!r}; load_run reads "
                                  f"{', '.join(MODES)} runs")
        if (run.path / SUMMARY).is_file() and not run.recorded_summary:
            RunDir(run.path).read_summary()  # raises: summary.json is not valid JSON
        run.config  # its settings are checked now, not at the first use
        return run

    @property
    def mode(self) -> Optional[str]:
        """hogwild, single, ddp or ps."""
        return self.record.get("mode")

    @functools.cached_property
    def config(self) -> Any:
        """Its settings: a HogwildConfig, SingleConfig, DDPConfig or ServerConfig."""
        if self.mode not in MODES:
            raise CheckpointError(f"{self.path} holds a run of mode {self.mode!r}, which has "
                                  "no settings dataclass")
        cls = MODES[self.mode][0]
        return config_from_dict(cls, saved_settings(RunDir(self.path), cls))

    @property
    def metrics(self) -> list:
        """Every event of metrics.jsonl (``events``): pandas.DataFrame(run.metrics)."""
        return self.events

    @functools.cached_property
    def summarized(self) -> dict:
        """summary.json, or for a run killed before writing it, one summarized from what it
        recorded (status 'incomplete'): what a report counts."""
        if self.recorded_summary:
            return self.summary
        task = self.record.get("task", {})
        return summarize(self.events, mode=self.record.get("mode", "?"),
                         task=task.get("name", "?"), target=None,
                         metric=Metric.described(task.get("metric")), stopped_by="unknown",
                         status="incomplete")

    @property
    def seed(self) -> Optional[int]:
        return self.record.get("config", {}).get("seed")

    @property
    def metric(self) -> Metric:
        """The metric the run recorded (runs from before metrics were recorded: accuracy)."""
        return Metric.described(self.record.get("task", {}).get("metric"))

    def task(self) -> Task:
        """The run's task, with its data (built once)."""
        if self._task is None:
            self._task = task_of(self.config)
        return self._task

    def model(self, device: str = "cpu", task: Optional[Task] = None):
        """The task's model with the weights of the run's checkpoint (the final ones of a
        finished run), in eval mode: ready for inference. ``task``: the Task object a run
        given one as ``task=`` was trained on (nothing can build it again by name)."""
        if task is not None:
            self._task = task
        checkpoint = load_checkpoint(RunDir(self.path).checkpoint)
        model = self.task().build_model(self.config.seed)
        try:
            model.load_state_dict(checkpoint["model"])
        except (KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{RunDir(self.path).checkpoint} does not fit task "
                                  f"{self.task().name}'s model: {str(exc).splitlines()[0]}"
                                  ) from exc
        return model.to(device).eval()

    def untrained(self) -> Optional[str]:
        """Why a run that ended without an error is no result: it trained no sample (its
        processes took its whole budget to start, say) and did not start at its target;
        None when it trained."""
        if (not self.recorded_summary or self.summary.get("samples", 1) != 0
                or self.summary.get("stopped_by") == "target"):  # met untrained: a result
            return None
        start = first_progress(self.events)
        return (f"trained no samples: stopped by {self.summary.get('stopped_by')} after "
                f"{self.summary.get('train_seconds', '?')} s"
                + ("" if start else ", before its first step (its start-up took the time: "
                   "give it a longer budget)"))

    def outcome(self) -> tuple:
        """(status, error) as the run's own files tell it, for a report that was not there
        to see it end (``asyncsgd plot``): summary.json's status and error where the run
        wrote one. Without it, a run that recorded no evaluation or trained on nothing
        failed at start (a port in use, say: config.json and a start event are all it
        left) and is no result; one that did was cut short (killed) and is reported for
        what it recorded, as is one stopped by Ctrl-C or SIGTERM after it trained (it saved
        what it had: the caller warns that it was cut short)."""
        missing = [what for what, seen in (("evaluation", scores(self.events, self.metric)),
                                            ("training", first_progress(self.events)))
                   if not seen]
        if self.recorded_summary:
            status = self.summary.get("status", "ok")
            if status == "interrupted" and not missing:
                return "ok", None
            untrained = self.untrained() if status == "ok" else None
            if untrained:
                return "not trained", untrained
            error = self.summary.get("error")
            if status != "ok" and not error:
                error = f"summary.json says {status} (stopped by {self.summary.get('stopped_by')})"
            return status, error
        if not missing:
            return "ok", None
        return "failed", (f"failed at start: no summary.json, and its metrics.jsonl "
                          f"({len(self.events)} event(s)) records no {' and no '.join(missing)}"
                          "; its error is not in the run directory (see the output of the "
                          "command that ran it)")

    def numbers(self, goal) -> dict:
        """The row of this run in a report; ``goal``: an ``analysis.report.Goal`` (the
        metric and the target it is ranked by)."""
        start = first_progress(self.events)
        values = scores(self.events, goal.metric)
        target, metric = goal.target, goal.metric
        summary = self.summarized
        return {
            "final_metric": values[-1] if values else None,
            "best_metric": metric.best(values),
            "time_to_target": time_to_target(self.events, target, metric),
            "samples_to_target": samples_to_target(self.events, target, metric),
            "bytes_to_target": bytes_to_target(self.events, target, metric),
            "samples_per_second": steady_throughput(self.events),
            "startup_seconds": start["t"] if start else None,
            "samples": summary.get("samples"),
            "train_seconds": summary.get("train_seconds"),
            "staleness_p50": summary.get("staleness_p50"),
            "staleness_p99": summary.get("staleness_p99"),
            # max over min of how many times samples were trained (core.coverage)
            "coverage_spread": (summary.get("coverage") or {}).get("spread"),
        }
