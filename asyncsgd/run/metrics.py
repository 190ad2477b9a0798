"""metrics.jsonl: the events a run writes (``MetricsLog`` gives their fields) and the summary and
curves computed from them, one format for every mode.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Iterable, Optional

from ..core.scoring import ACCURACY, Metric
from ..errors import ConfigError
from .rundir import METRICS, RunDir

log = logging.getLogger(__name__)


class MetricsLog:
    """Appends events to metrics.jsonl (flushed per event) and, optionally, TensorBoard.

    Every event is one JSON object with at least ``event`` ("start", "resume", "train",
    "eval", "stop"), ``t`` (seconds since the run's command started, start-up included,
    continued across ``--resume``), ``samples`` (by all workers so far) and ``wall``
    (Unix time). The clock (``recorder.clock_origin``) starts when the kernel started the
    command's process (of a mode of several processes, its first: DDP's and Hogwild's
    parent, the parameter server), so times to a target count from the launch; the
    ``start`` event's ``clock`` says ``"command"``, or ``"call"`` for a run started from
    Python, counted from the call that built its Recorder (runs written before ``clock``
    existed counted from their Recorder). ``train`` events add ``worker``, ``loss`` (mean
    since that worker's previous event), ``steps`` and ``epoch``; ``eval`` events add
    ``loss`` and the task's metric keyed by its name (config.json's ``task.metric``).
    Modes may add fields of their own; readers ignore what they don't know.

    TensorBoard steps are integers. ``train/loss/worker<k>``, ``test/<metric>`` and
    ``test/loss`` are logged against training samples (all workers together), the
    honest x of a learning curve; ``test/<metric>_vs_seconds`` against whole seconds of
    ``t`` (since the command started, start-up included, as above; ``int(t)``): one
    point per second, the last evaluation in that second (written when the next second's
    comes, or at ``close``: the run's final evaluation is always there), so its x is what
    its name says. Every event keeps its own wall time, for TensorBoard's "Relative" and
    "Wall" axes.
    """

    def __init__(self, run: RunDir, tensorboard: bool = False, metric: Metric = ACCURACY):
        self.metric = metric
        self._fh = open(run.path / METRICS, "a", buffering=1)
        self._tb = None
        self._this_second: Optional[tuple] = None  # (second, value): its latest evaluation
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                self._fh.close()
                raise ConfigError("--tensorboard needs the tensorboard package: "
                                  "pip install tensorboard (or drop --tensorboard)") from exc
            self._tb = SummaryWriter(log_dir=str(run.path / "tensorboard"))

    def write(self, event: str, t: float, samples: int, **fields) -> dict:
        record = {"event": event, "t": round(float(t), 4), "samples": int(samples),
                  "wall": round(time.time(), 3), **fields}
        self._fh.write(json.dumps(record) + "\n")
        if self._tb is not None:
            if event == "train" and "loss" in fields:
                self._tb.add_scalar(f"train/loss/worker{fields.get('worker', 0)}",
                                    fields["loss"], samples)
            elif event == "eval":
                name = self.metric.name
                self._tb.add_scalar(f"test/{name}", fields[name], samples)
                self._tb.add_scalar("test/loss", fields["loss"], samples)
                second = int(t)
                if self._this_second is not None and self._this_second[0] != second:
                    self._write_second()
                self._this_second = (second, fields[name])
        return record

    def _write_second(self) -> None:
        second, value = self._this_second
        self._tb.add_scalar(f"test/{self.metric.name}_vs_seconds", value, second)
        self._this_second = None

    def close(self) -> None:
        if self._tb is not None:
            if self._this_second is not None:
                self._write_second()
            self._tb.close()
            self._tb = None
        if not self._fh.closed:
            self._fh.close()


def first_at_target(events: Iterable[dict], target: Optional[float],
                    metric: Metric = ACCURACY) -> Optional[dict]:
    """The first evaluation at or past ``target`` in ``metric``'s direction, or None."""
    if target is None:
        return None
    return next((e for e in events if e.get("event") == "eval"
                 and metric.reached(e.get(metric.name), target)), None)


def time_to_target(events: Iterable[dict], target: Optional[float],
                   metric: Metric = ACCURACY) -> Optional[float]:
    """Seconds (``t``: since the command started) until the first evaluation at or past
    ``target``."""
    hit = first_at_target(events, target, metric)
    return None if hit is None else hit["t"]


def samples_to_target(events: Iterable[dict], target: Optional[float],
                      metric: Metric = ACCURACY) -> Optional[int]:
    """Training samples (all workers together) until the first evaluation at or past
    ``target``: what reaching it cost, whatever the speed."""
    hit = first_at_target(events, target, metric)
    return None if hit is None else hit["samples"]


def bytes_to_target(events: Iterable[dict], target: Optional[float],
                    metric: Metric = ACCURACY) -> Optional[int]:
    """Bytes on the network (every process's traffic, each byte once) until the first
    evaluation at or past ``target``; None where the mode counts none."""
    hit = first_at_target(events, target, metric)
    return None if hit is None else hit.get("bytes")


def scores(events: Iterable[dict], metric: Metric = ACCURACY) -> list:
    """The metric's value at every evaluation, in order."""
    return [e[metric.name] for e in events
            if e.get("event") == "eval" and e.get(metric.name) is not None]


def summarize(events: list, *, mode: str, task: str, target: Optional[float],
              stopped_by: str, status: str = "ok", error: Optional[str] = None,
              metric: Metric = ACCURACY, **extra) -> dict:
    """summary.json: what a reader of one run wants to know first. Its seconds are ``t``'s:
    ``train_seconds`` is the last event's (the run's length, start-up included, so
    ``samples_per_second`` is over all of it; ``steady_throughput`` leaves start-up out)."""
    evals = [e for e in events if e.get("event") == "eval"]
    values = scores(evals, metric)
    last = max(events, key=lambda e: e.get("t", 0.0), default={})
    train_time = float(last.get("t", 0.0))
    samples = int(max((e.get("samples", 0) for e in events), default=0))
    summary = {
        "mode": mode, "task": task, "status": status, "stopped_by": stopped_by,
        "metric": metric.describe(),
        "final_metric": values[-1] if values else None,
        "best_metric": metric.best(values),
        "final_loss": evals[-1]["loss"] if evals else None,
        "samples": samples, "train_seconds": round(train_time, 3),
        "samples_per_second": round(samples / train_time, 1) if train_time > 0 else None,
        "target": target, "time_to_target": time_to_target(evals, target, metric),
        "samples_to_target": samples_to_target(evals, target, metric),
        "evaluations": len(evals),
        # bytes on the network, each once (modes that count them; None: not counted)
        "bytes": max((e["bytes"] for e in evals if e.get("bytes") is not None), default=None),
        "bytes_to_target": bytes_to_target(evals, target, metric),
    }
    shared = max((e.get("shared_bytes", 0) for e in evals), default=0)
    if shared:  # a same-host parameter server's tensors, moved through shared memory
        summary["shared_bytes"] = shared
    if error:
        summary["error"] = error
    summary.update(extra)
    return summary


def eval_curve(events: Iterable[dict], metric: Metric = ACCURACY) -> list:
    """(t, samples, score) of every evaluation, in order."""
    return [(e["t"], e.get("samples", 0), e[metric.name]) for e in events
            if e.get("event") == "eval" and e.get(metric.name) is not None]


def train_reports(events: Iterable[dict]) -> list:
    """(t, samples, loss summed over steps, steps) of each report of training loss.

    Modes write one ``train`` event per worker at a time, all with the same
    ``samples`` count; those are one report, at the latest of their times.
    """
    reports: list = []
    for e in events:
        if e.get("event") != "train" or e.get("loss") is None:
            continue
        steps = max(1, int(e.get("steps", 1)))
        if reports and reports[-1][1] == e.get("samples"):
            t, samples, loss_sum, n = reports[-1]
            reports[-1] = (max(t, e["t"]), samples, loss_sum + e["loss"] * steps, n + steps)
        else:
            reports.append((e["t"], e.get("samples"), e["loss"] * steps, steps))
    return reports


def train_curve(events: Iterable[dict]) -> list:
    """(t, samples, loss): the training loss of all workers at each report, their losses
    weighted by the steps each covers."""
    return [(t, samples, loss_sum / steps) for t, samples, loss_sum, steps
            in train_reports(events)]


def first_progress(events: list) -> Optional[dict]:
    """The first event after which training had processed samples: the end of start-up."""
    if not events:
        return None
    start = events[0].get("samples", 0)
    return next((e for e in events if e.get("samples", 0) > start), None)


def steady_throughput(events: list) -> Optional[float]:
    """Samples/s from the end of start-up (``first_progress``) to the last event.

    One definition for every mode, read from metrics.jsonl alone: spawning
    processes, connecting to a server or building a process group does not
    dilute it, and ``first_progress``'s ``t`` shows what start-up cost.
    """
    first = first_progress(events)
    if first is None:
        return None
    last = max(events, key=lambda e: e.get("t", 0.0))
    dt = last["t"] - first["t"]
    return (last["samples"] - first["samples"]) / dt if dt > 0 else None
