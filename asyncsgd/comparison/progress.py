"""Compare's progress: which run is on, its ETA and the comparison's, its latest score.

Reads the running run's metrics.jsonl and draws it through ``run.progress`` (a bar or
log lines).
"""

from __future__ import annotations

import time
from typing import Optional, TextIO

from ..analysis.report import Attempt, Goal
from ..run.progress import Progress, fmt_time
from ..run.rundir import RunDir

SHOW_SECONDS = 1.0


class CompareProgress:
    """Which run is on, how long it has run since its launch, its ETA and the
    comparison's, and its latest evaluation (``run.progress``: a bar or log lines)."""

    def __init__(self, total: int, style: str, stream: TextIO, goal: "Goal",
                 train_samples: Optional[int] = None):
        """``train_samples``: the task's, for the samples budget of ``--epochs``."""
        if style == "auto":
            style = "bar" if getattr(stream, "isatty", lambda: False)() else "log"
        self.total, self.style, self.stream, self.goal = total, style, stream, goal
        self.train_samples = train_samples
        self.index = 0
        self._bar: Optional[Progress] = None
        self._next_show = 0.0
        self._budget = 0.0  # of the run on
        self._overheads: list = []  # seconds each finished run took beyond its budget

    def say(self, text: str) -> None:
        if self.style != "off":
            self.stream.write(text + "\n")
            self.stream.flush()

    def starting(self, run, what: str) -> None:
        """``run``: the ``mode_run.ModeRun`` starting (its cfg, spec, repeat and seed)."""
        self.index += 1
        reps = run.cfg.repeats
        self.say(f"[{self.index}/{self.total}] {run.spec.name}"
                 + (f", repeat {run.repeat + 1}/{reps}" if reps > 1 else "")
                 + f" (seed {run.seed}): {what}, budget {run.cfg.budget:g} s")
        epochs, self._budget = run.cfg.epochs, run.cfg.budget
        self._bar = Progress(f"{self.index}/{self.total} {run.spec.name}",
                             epochs * self.train_samples if epochs and self.train_samples
                             else None, self.style, self.stream, seconds=run.cfg.budget)
        self._next_show = 0.0

    def tick(self, run) -> None:
        now = time.monotonic()
        if self._bar is None or self.style == "off" or now < self._next_show:
            return
        self._next_show = now + SHOW_SECONDS
        events = list(RunDir(run.run_dir).events())
        last = events[-1] if events else {"t": 0.0, "samples": 0}
        evals = [e for e in events if e.get("event") == "eval"]
        metric = self.goal.metric
        if evals and evals[-1].get(metric.name) is not None:
            self._bar.evaluated(metric, evals[-1][metric.name], evals[-1]["loss"])
        rate = last["samples"] / last["t"] if last.get("t") else 0.0
        t = now - (run.launched or run.started)  # the run's clock: from its launch
        samples = last.get("samples", 0)
        self._bar.note(self.compare_eta(self._bar.eta(t, samples, rate)))
        self._bar.update(t, samples, rate)

    def compare_eta(self, run_eta: Optional[float]) -> str:
        """'compare ETA mm:ss' while runs remain after this one: what this one has left,
        then each of the others' budget, each run (this one too) plus the mean of what the
        finished ones took beyond their budget (final evaluation, exits, the report's
        reading)."""
        left = self.total - self.index
        if not left or run_eta is None:
            return ""
        overhead = sum(self._overheads) / len(self._overheads) if self._overheads else 0.0
        return f"compare ETA {fmt_time(run_eta + overhead + left * (self._budget + overhead))}"

    def finished(self, attempt: Attempt) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        took = f"in {attempt.seconds:.1f} s"
        if attempt.ok and attempt.seconds is not None:
            self._overheads.append(max(0.0, attempt.seconds - self._budget))
        if attempt.ok:
            numbers, metric = attempt.run.numbers(self.goal), self.goal.metric
            score = ("" if numbers["final_metric"] is None else
                     f": final test {metric.name} {metric.format(numbers['final_metric'])} "
                     f"(best {metric.format(numbers['best_metric'])})")
            self.say(f"[{self.index}/{self.total}] {attempt.label} done {took}{score}")
        else:
            self.say(f"[{self.index}/{self.total}] {attempt.label} {attempt.status.upper()} "
                     f"{took}: {attempt.error}")

