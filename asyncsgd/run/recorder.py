"""The bookkeeping side of a run, shared by every training mode: the ``Recorder`` owns the run
directory, clock, metrics, evaluations, checkpoints and progress, so modes only train.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Optional, Union

import torch.nn as nn

from ..config import NO_EPOCH_LIMIT, TrainConfig, identity_fields
from ..core.tasks import Task
from ..errors import CallbackError, CheckpointError, ConfigError, WorkerError
from .checkpoint import load_checkpoint, save_checkpoint
from .lifetime import command_started_at
from .loggers import check_loggers, open_loggers
from .metrics import MetricsLog, summarize
from .progress import Progress
from .rundir import RunDir
from .settings import write_settings_file
from .signals import sigterm_as_interrupt
from .sinks import Sinks, attached_sinks

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run returns: its directory and its summary.json."""

    run_dir: str
    summary: dict


@dataclass
class Outcome:
    """How a run ended: what stopped it, its status, and a worker failure to re-raise."""

    stopped_by: str
    status: str = "ok"
    error: Optional[WorkerError] = None

    @contextlib.contextmanager
    def watch(self):
        """Ctrl-C, SIGTERM and a failed worker end the block and are recorded, not raised,
        so every mode still saves its run before reporting them."""
        try:
            with sigterm_as_interrupt():
                yield self
        except KeyboardInterrupt:
            self.stopped_by, self.status = "interrupted", "interrupted"
        except (WorkerError, CallbackError) as exc:
            self.failed(exc)

    def failed(self, exc: Union[WorkerError, CallbackError]) -> None:
        self.stopped_by, self.status, self.error = "error", "failed", exc


def task_record(task: Task) -> dict:
    """What config.json says about the task: enough to read the run without building it."""
    return {"name": task.name, "description": task.description,
            "train_samples": len(task.train), "test_samples": len(task.test),
            "metric": task.metric.describe(), **task.info}


def check_target(cfg, task: Task) -> None:
    """--target in the task's metric, checked before any slow work."""
    try:
        task.metric.check_target(cfg.target)
    except ValueError as exc:
        raise ConfigError(f"{exc} (task {task.name} scores {task.metric.name})") from None


def clock_origin(started_at: Optional[float] = None) -> tuple:
    """(kind, ``time.monotonic()``) where a run's clock starts: ``"command"``, the start of
    the process of the command that runs it (``run.lifetime``: the kernel's record of it,
    so the interpreter, importing torch and loading the task count; a child process is
    handed its parent's), else ``"call"``: ``started_at``, or now (a run started from
    Python, whose caller's own start-up is not the run's). ``asyncsgd compare`` starts
    every mode's first process itself (the parameter server before its workers), so there
    the clock starts when compare launched the mode."""
    command = command_started_at()
    if command is not None:
        return "command", command
    return "call", time.monotonic() if started_at is None else started_at


class Recorder:
    @staticmethod
    def open_run(cfg: TrainConfig) -> RunDir:
        """The run directory, checked before any slow work: a fresh one, or the resumed one."""
        check_loggers(getattr(cfg, "log_to", ()))
        return RunDir.open(cfg.resume) if cfg.resume else RunDir.create(cfg.out, cfg.mode)

    def __init__(self, cfg: TrainConfig, task: Task, model: nn.Module, run: RunDir,
                 total_samples: Optional[int] = None, argv: Optional[list] = None,
                 started_at: Optional[float] = None):
        """``started_at``: the ``time.monotonic()`` at which the run began, when a mode
        started processes before it could build its Recorder (DDP's rank 0) and no command
        set the clock (``run.lifetime``): their start-up then counts, as it does in every
        mode. Where a command set it, the clock starts there (``clock_origin``)."""
        self.cfg, self.task, self.model, self.mode = cfg, task, model, cfg.mode
        check_target(cfg, task)
        self.t_offset, self.samples_offset, self.epochs_done = 0.0, 0, 0
        # Bytes on the network so far, for modes that count them (the parameter server):
        # eval events and checkpoints carry it, a resumed run continues from its checkpoint's
        self.bytes_offset, self.wire_bytes = 0, None
        # Bytes a same-host parameter server moved through shared memory instead (none of
        # them on the network, so not in wire_bytes): carried as wire_bytes is
        self.shared_offset, self.shared_bytes = 0, None
        self.lr: Optional[float] = None  # the lr in force, where a mode sets it (--lr-schedule)
        self.run = run
        if cfg.resume:
            self._restore()
        else:
            self.run.write_config(self.mode, cfg.to_dict(), task_record(task), argv)
            write_settings_file(self.run, cfg)
        self.metric = task.metric
        self.metrics = MetricsLog(self.run, tensorboard=cfg.tensorboard, metric=self.metric)
        # --log-to's loggers and the API's callbacks (run.sinks), told what metrics.jsonl is
        self.sinks = Sinks([*open_loggers(getattr(cfg, "log_to", ()), self.run.path),
                            *attached_sinks()])
        self.sinks.start(cfg.to_dict())
        # no --epochs, and --target or --max-seconds ends the run: no samples to count down
        unlimited = (getattr(cfg, "epochs", None) or 0) >= NO_EPOCH_LIMIT
        self.progress = Progress(self.mode, None if unlimited else total_samples, cfg.progress,
                                 seconds=cfg.max_seconds, since=self.t_offset)
        self.best_score: Optional[float] = None
        self.eval_seconds = 0.0  # the last evaluation's, and the shortest's: what the
        self._eval_shortest = 0.0  # final one will take, the workers stopped
        # The last checkpoint's save: the final one takes as long (a 2.6-million-row table's
        # model, 166 MB: 0.2 s, 0.8 s beside 4 busy processes on its core)
        self.checkpoint_seconds = 0.0
        # What a mode's stop costs besides the final evaluation and checkpoint, as it last
        # measured it (the parameter server: its tables' rows pulled for checkpoint.pt)
        self.stop_seconds = 0.0
        self._eval_samples: Optional[int] = None  # the samples the last evaluation saw
        self.last_eval: Optional[dict] = None
        self.clock, self._origin = self._start_clock(started_at)
        self._next_eval = 0.0
        self._next_checkpoint = cfg.checkpoint_every or math.inf
        self.metrics.write("start" if not cfg.resume else "resume", self.t(), self.samples_offset,
                           mode=self.mode, clock=self.clock,
                           resumed_from_t=self.t_offset if cfg.resume else None)

    def _start_clock(self, started_at: Optional[float]) -> tuple:
        """(kind, origin) of the run's clock (``clock_origin``); the virtual clock's
        recorder has its own."""
        return clock_origin(started_at)

    def _restore(self) -> None:
        saved = self.run.read_config()
        if saved.get("mode") != self.mode:
            raise ConfigError(f"{self.run.path} is a {saved.get('mode')} run; resume it with "
                              f"'asyncsgd {saved.get('mode')} --resume {self.run.path}'")
        saved_cfg = saved.get("config", {})
        for name in identity_fields(type(self.cfg)):
            if saved_cfg.get(name) != getattr(self.cfg, name):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self.cfg, name)} differs "
                                  f"from the resumed run's {saved_cfg.get(name)}; a resumed run "
                                  "keeps its task and data")
        ckpt = load_checkpoint(self.run.checkpoint)
        try:
            self.model.load_state_dict(ckpt["model"])
        except (KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{self.run.checkpoint} does not fit task {self.task.name}'s "
                                  f"model: {str(exc).splitlines()[0]}") from exc
        self.t_offset = float(ckpt.get("t", 0.0))
        self.samples_offset = int(ckpt.get("samples", 0))
        self.bytes_offset = int(ckpt.get("bytes") or 0)
        self.shared_offset = int(ckpt.get("shared_bytes") or 0)
        self.epochs_done = int(ckpt.get("epochs_done", 0))
        self._restored(ckpt)
        log.info("resuming %s from t=%.1fs, %d samples, epoch %d", self.run.path,
                 self.t_offset, self.samples_offset, self.epochs_done)

    def _restored(self, ckpt: dict) -> None:
        """What a subclass reads from the resumed checkpoint besides the model: called once
        it loaded, before anything is written to the run."""

    def t(self) -> float:
        """The run's clock (metrics.jsonl's ``t``): seconds since this command started
        (``clock_origin``), after those of the sessions a resumed run continues."""
        return self.t_offset + self.elapsed()

    def elapsed(self) -> float:
        """Seconds since this command started (``clock_origin``): its start-up included."""
        return time.monotonic() - self._origin

    def out_of_time(self, then: float = 0.0) -> bool:
        """--max-seconds, less what the stop costs (``reserve``), have passed since the
        command started (``then`` seconds from now): the time a user waits."""
        limit = self.cfg.max_seconds
        return bool(limit) and self.elapsed() + then + self.reserve() >= limit

    def reserve(self) -> float:
        """Seconds set aside before --max-seconds for what comes after the stop: the final
        evaluation (4 s of a 20 s lm run here), as long as the shortest one took (those
        beside hogwild's busy workers take longer); the final checkpoint, as long as the
        last; and the mode's own (``stop_seconds``)."""
        return self._eval_shortest + self.checkpoint_seconds + self.stop_seconds

    def train(self, samples: int, worker: int, loss: float, steps: int, epoch: int,
              **extra) -> None:
        self.metrics.write("train", self.t(), samples, worker=worker, loss=round(loss, 6),
                           steps=steps, epoch=epoch, **extra)

    def evaluate(self, samples: int, **extra) -> dict:
        """The task's loss and metric on its test set now, recorded and shown."""
        began = time.monotonic()
        result = self.task.evaluate(self.model)
        self.eval_seconds = time.monotonic() - began
        self._eval_shortest = min(self._eval_shortest or math.inf, self.eval_seconds)
        self.last_eval, self._eval_samples = result, samples
        score = result[self.metric.name]
        if self.metric.better(score, self.best_score):
            self.best_score = score
        fields = {"loss": round(result["loss"], 6), self.metric.name: round(score, 6)}
        if self.wire_bytes is not None:
            fields["bytes"] = int(self.wire_bytes)
        if self.shared_bytes:
            fields["shared_bytes"] = int(self.shared_bytes)
        if self.lr is not None:
            fields["lr"] = self.lr
        self.sinks.eval(self.metrics.write("eval", self.t(), samples, **fields, **extra))
        self.progress.evaluated(self.metric, score, result["loss"])
        self._next_eval = self.elapsed() + self.cfg.eval_every
        self.sinks.raise_failure()  # a failed sink stops the run, which then saves itself
        return result

    def eval_due(self) -> bool:
        return self.elapsed() >= self._next_eval

    def evaluate_if_due(self, samples: int) -> Optional[dict]:
        """An evaluation once --eval-every passed, unless the run is out of time: its final
        one comes next."""
        return (self.evaluate(samples) if self.eval_due()
                and not self.out_of_time(then=self.eval_seconds) else None)

    def target_reached(self) -> bool:
        """The latest evaluation is at or past --target, in the metric's direction."""
        return self.last_eval is not None and \
            self.metric.reached(self.last_eval[self.metric.name], self.cfg.target)

    def checkpoint(self, samples: int, epochs_done: int, **extra) -> None:
        began = time.monotonic()
        state = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        save_checkpoint(self.run.checkpoint, {
            "mode": self.mode, "task": self.task.name, "model": state, "samples": int(samples),
            "t": self.t(), "epochs_done": int(epochs_done), **extra,
            **({"bytes": int(self.wire_bytes)} if self.wire_bytes is not None else {}),
            **({"shared_bytes": int(self.shared_bytes)} if self.shared_bytes else {})})
        self.checkpoint_seconds = time.monotonic() - began
        self._next_checkpoint = self.elapsed() + (self.cfg.checkpoint_every or math.inf)

    def checkpoint_due(self) -> bool:
        """--checkpoint-every has passed since the last save (a caller that gathers state
        for it first, then calls ``checkpoint``)."""
        return self.elapsed() >= self._next_checkpoint

    def checkpoint_if_due(self, samples: int, epochs_done: int) -> None:
        if self.checkpoint_due():
            self.checkpoint(samples, epochs_done)

    def show(self, samples: int, rate: float, force: bool = False, note: str = "") -> None:
        """Progress; ``note``: one more part of it (e.g. what stragglers waited)."""
        if self.lr is not None:
            note = " | ".join(filter(None, [f"lr {self.lr:.4g}", note]))
        self.progress.note(note)
        self.progress.update(self.t(), samples, rate, force=force)

    def conclude(self, samples: int, epochs_done: int, outcome: Outcome,
                 rate: Optional[float] = None, **extra) -> RunResult:
        """End a run: final evaluation and checkpoint (nothing lost, even after a failure
        or Ctrl-C), summary.json; then re-raise the failure, if any."""
        try:  # the model trained nothing since the last evaluation: it stands, not run twice
            result = (self.last_eval if samples == self._eval_samples else
                      self.evaluate(samples))
        except CallbackError as exc:  # the run is saved all the same, then this is raised
            result = self.last_eval
            if outcome.error is None:
                outcome.failed(exc)
        if rate is None:  # no steady rate (ended before every process ran): the overall one
            rate = (samples - self.samples_offset) / max(self.elapsed(), 1e-9)
        self.show(samples, rate, force=True)  # the last line, however short the run
        self.checkpoint(samples, epochs_done)
        error = outcome.error
        summary = self.finish(samples, outcome.stopped_by, outcome.status,
                              error=str(error) if error else None, **extra)
        if error is not None:
            raise error
        log.info("final test %s %s", self.metric.name,
                 self.metric.format(result[self.metric.name]))
        return RunResult(str(self.run.path), summary)

    def finish(self, samples: int, stopped_by: str, status: str = "ok",
               error: Optional[str] = None, **extra) -> dict:
        """Write the stop event and summary.json; close the metrics log."""
        self.metrics.write("stop", self.t(), samples, reason=stopped_by, status=status)
        self.progress.close()
        self.metrics.close()
        summary = summarize(list(self.run.events()), mode=self.mode, task=self.task.name,
                            target=self.cfg.target, metric=self.metric, stopped_by=stopped_by,
                            status=status, error=error, run_dir=str(self.run.path), **extra)
        self.run.write_summary(summary)
        self.sinks.end(summary)
        if status == "ok":  # a sink failing at the end fails a run that went well
            self.sinks.raise_failure()
        return summary
