"""The synchronous SGD loop of ``asyncsgd single`` and of every ``asyncsgd ddp`` rank.

Each process steps through its own padded partition; every few steps the ranks sum one
small vector (an all-reduce) and so agree, at the same step, whether to stop, between steps.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..config import SingleConfig
from ..config.shared import min_batch
from ..core.pacing import Pacer, Pacing, other_seconds, pace_event, pace_note
from ..core import coverage
from ..core.schedule import schedule
from ..core.tasks import Task, epoch_order, partition_indices
from ..errors import CallbackError, ConfigError, WorkerError
from ..run.digests import DIGESTS, DigestLog
from ..run.recorder import Outcome, RunResult
from ..run.rundir import RunDir
from ..run.signals import signals_as_flag
from .optim import SGD, Adam, Delayed
from .balancing import BatchBalance
from .gradients import accumulate, clipper
from .precision import Precision, check_amp
from .resume import (Agree, StatefulRecorder, SyncState, fresh_state, resumed_start,
                     warn_model_only)

log = logging.getLogger(__name__)

# How often the ranks agree whether to stop; bounds the stop latency. Not every step: for a
# small model the all-reduce costs more than the step (experiments/README.md, "The
# synchronous modes").
CHECK_SECONDS = 0.2
MAX_STEPS_BETWEEN_CHECKS = 100_000
TRAIN_EVENT_SECONDS = 1.0
STOP_REASONS = {1: "max_seconds", 2: "target"}
MAX_SECONDS, TARGET = 1, 2
# Slots of the vector the ranks sum at every check; then each rank's seconds computing,
# waited on purpose and since its first step (core.pacing), in PACED slots per rank from
# FIRST_RANK_SLOT.
CODE, PACE, INTERRUPTS, LOSS_SUM, LOSS_STEPS, SAVE, FIRST_RANK_SLOT = range(7)
PACED = 3


def padded_partition(n: int, parts: int, index: int, seed: int) -> torch.Tensor:
    """Rows of process ``index``: its partition (the split Hogwild and the PS workers use),
    padded with its own first rows to the longest, as DistributedSampler pads: a DDP rank
    with one step more than the others would wait forever in their all-reduce."""
    part = partition_indices(n, parts, index, seed)
    longest = -(-n // parts)
    if len(part) < longest:
        part = torch.cat([part, part[:longest - len(part)]])
    return part


def check_settings(cfg: SingleConfig) -> None:
    """Settings that cannot work on this machine: one clear error before any slow work."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch "
                          "(torch.cuda.is_available() is False); use --device cpu")
    check_amp(cfg.amp, cfg.device)
    if cfg.simulate_staleness:
        if cfg.mode != "single":
            raise ConfigError(f"--simulate-staleness is for single (one process); {cfg.mode} is "
                              "synchronous, so its gradients are never stale: leave the flag out")
        if cfg.amp == "fp16":
            raise ConfigError("--simulate-staleness with --amp fp16: the gradient scaler "
                              "would skip steps by the current gradient, not the one applied; "
                              "use --amp bf16 or off")
    if cfg.accumulate > 1 and getattr(cfg, "balance", "none") == "batch":
        raise ConfigError("--accumulate with --balance batch: the balance sizes each rank's "
                          "whole step to its speed; drop one of them")
    if cfg.optimizer == "adam" and cfg.momentum:
        raise ConfigError("--momentum is sgd's; adam has its own (betas 0.9/0.999): drop "
                          "--momentum or use --optimizer sgd")


def make_optimizer(cfg: SingleConfig, task: Task, params):
    """The update rule of --optimizer, applying gradients --simulate-staleness steps late."""
    lr = cfg.lr or task.lr
    if cfg.optimizer == "adam":
        opt = Adam(params, lr=lr, weight_decay=cfg.weight_decay)
    else:
        opt = SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return Delayed(opt, cfg.simulate_staleness) if cfg.simulate_staleness else opt


def alone(vector: torch.Tensor) -> torch.Tensor:
    """The agreement of a single process: nothing to add."""
    return vector


class SyncLoop:
    """Steps through one process's data; rank 0 (the one with a Recorder) also evaluates,
    checkpoints, records and decides when to stop, at checks, between steps (Ctrl-C and
    SIGTERM set a flag), so that every rank stops at the same step and what is saved is one
    consistent state."""

    def __init__(self, cfg: SingleConfig, task: Task, net: nn.Module, precision: Precision,
                 part: torch.Tensor, device: torch.device, *, rank: int, world: int,
                 start: tuple, recorder: Optional[StatefulRecorder], agree: Agree,
                 interrupted: Callable[[], bool], comm=None,
                 balance: Optional[BatchBalance] = None):
        """``comm``: what the gradients of a group of processes go through, or None for one
        process. The loop calls ``comm.attach(net, pacer or None)`` here, ``after_step(params)``
        after each update and ``bytes(steps)`` for the summary (``modes.ddp_hooks.DDPComm``).
        ``balance``: --balance batch's slicing of a global batch (``modes.balancing``)."""
        self.cfg, self.task, self.net, self.precision = cfg, task, net, precision
        self.part, self.device, self.rank, self.world = part, device, rank, world
        self.recorder, self.agree, self.interrupted = recorder, agree, interrupted
        self.batch_size = cfg.batch_size or task.batch_size
        self.step_rows = self.batch_size * cfg.accumulate  # --accumulate's micro-batches
        self.clip = clipper(cfg.clip_grad_norm)
        self.opt = make_optimizer(cfg, task, net.parameters())
        self.epochs_done = start[0]
        self.state = SyncState(self.opt, precision.scaler, device, rank=rank, world=world,
                               agree=agree, start=start)
        self.steps = 0
        self.local_samples = 0
        self.balance = balance
        self.global_rows = 0  # --balance batch: rows every rank together trained this session
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._loss_steps = 0
        self._pending = [0.0, 0]  # rank 0: agreed loss sum and count not yet written
        self._next_train_event = 0.0
        self._pace_mark = (time.monotonic(), 0)
        self._pace = 1
        self.ready_at: Optional[tuple] = None  # rank 0: (elapsed, samples) at the first check
        self.pacing = Pacing.parse(cfg.slowdown, cfg.delay)
        self.pacing.check_ranks(world, "single" if world == 1 else "--procs (WORLD_SIZE)")
        self.pacer = Pacer(self.pacing, rank, cfg.seed,
                           torch.cuda.synchronize if device.type == "cuda" else None)
        self._pace_after_backward = self.pacer.end
        self.comm = comm
        # Whether steps are timed: a group's are only when paced or balanced (a hook in its
        # reducer); balancing needs the compute seconds, finished kernels included
        self.timed = True
        if comm is not None:  # the wait goes before the gradients are handed over
            self._pace_after_backward = None
            self.timed = self.pacing.active or balance is not None
            if balance is not None and device.type == "cuda":
                self.pacer.synchronize = torch.cuda.synchronize
            comm.attach(net, self.pacer if self.timed else None)
        if self.pacing.active and recorder is not None:
            log.info("stragglers: %s", self.pacing.describe())
        self.ranks_paced = [0.0] * (PACED * world)  # rank 0: the agreed per-rank seconds
        self.digests = (DigestLog(recorder.run.path / DIGESTS, "round")
                        if cfg.record_digests and recorder is not None else None)
        per_epoch = -(-self.epoch_rows // self.rows_per_step)
        self.schedule = schedule(
            cfg.lr or task.lr, cfg.lr_schedule, cfg.warmup, steps=cfg.epochs * per_epoch,
            samples_per_step=self.rows_per_step * (1 if balance is not None else world))
        if recorder is not None:  # the first evaluation's: the lr of the first step
            recorder.lr = self.schedule(self.step_index())
        self._paced_seen = [0.0, 0.0]  # rank 0: summed (computed, waited) at the last event

    def samples(self) -> int:
        """Samples trained on by all ranks, across resumes (equal on every rank by padding)."""
        offset = self.recorder.samples_offset if self.recorder else 0
        if self.balance is not None:
            return offset + self.global_rows
        return offset + self.world * self.local_samples

    def run(self) -> str:
        """Train until the epochs are done or the ranks agree to stop; what stopped it."""
        try:
            stopped_by = self._train()
        finally:
            if self.digests is not None:
                self.digests.close()
        self.state.gather_rngs()  # every rank stopped at the same step: the final save
        return stopped_by

    def _note_digest(self) -> None:
        """Rank 0, --record-digests: the parameters after the steps taken so far, counted
        from the run's start (a resumed run's too) by the position in the data."""
        if self.digests is not None:
            self.digests.note(self.step_index(), self.net.parameters())

    def step_index(self) -> int:
        """Steps taken since the run's start (a resumed run's too), from the position in the
        data, which checkpoints hold: the schedule's count, so --resume continues it."""
        epoch, row = self.state.position
        rows, step = self.epoch_rows, self.rows_per_step
        return epoch * -(-rows // step) + -(-row // step)

    @property
    def epoch_rows(self) -> int:
        """Rows of an epoch as the position counts them: this rank's partition, or, balanced,
        the global permutation's."""
        return self.balance.epoch_rows if self.balance is not None else len(self.part)

    @property
    def rows_per_step(self) -> int:
        return self.balance.global_batch if self.balance is not None else self.step_rows

    def _batches(self, epoch: int, first_row: int):
        """This process's (rows, epoch's rows done after the step, loss scale) of each step."""
        if self.balance is not None:
            yield from self.balance.steps(epoch, first_row)
            return
        order = epoch_order(self.part, self.cfg.seed, self.rank, epoch)
        for start in range(first_row, len(order), self.step_rows):
            yield order[start:start + self.step_rows], min(start + self.step_rows,
                                                           len(order)), None

    def _train(self) -> str:
        until_check = 1
        first_epoch, skip = self.state.position
        self.state.set_resumed_rng()
        self._note_digest()
        for epoch in range(first_epoch, self.cfg.epochs):
            for index, done, scale in self._batches(epoch, skip if epoch == first_epoch else 0):
                self._step(index, scale)
                self.global_rows += done - self.state.position[1]
                self.state.position = (epoch, done)
                self._note_digest()
                if self.balance is not None and self.balance.due(self.steps):
                    self._resize()
                until_check -= 1
                if until_check == 0:
                    stopped_by, until_check = self._check(epoch)
                    if stopped_by:
                        return stopped_by
            self.epochs_done = epoch + 1
            self.state.position = (epoch + 1, 0)
        self._check(self.epochs_done - 1)  # every rank gets here at the same step: the last losses
        return "epochs"

    def coverage(self) -> dict:
        """How many times each row was trained, from the position every rank shares: whole
        epochs of each rank's padded partition (its padding rows twice), then the rows of
        this epoch's order done (exact unless a resume repeated or changed the ranks).
        Balanced, the epochs of the global order (``BatchBalance.counts``)."""
        epoch, row = self.state.position
        if self.balance is not None:
            return coverage.of_samples(self.balance.counts(epoch, row))
        counts = torch.zeros(len(self.task.train), dtype=torch.int64)
        for rank in range(self.world):
            part = padded_partition(len(counts), self.world, rank, self.cfg.seed)
            counts.index_add_(0, part, torch.full_like(part, epoch))
            done = epoch_order(part, self.cfg.seed, rank, epoch)[:row]
            counts.index_add_(0, done, torch.ones_like(done))
        return coverage.of_samples(counts)

    def _step(self, index: torch.Tensor, scale: Optional[float] = None) -> None:
        """One step on rows ``index``; ``scale``: --balance batch's weight of this rank's mean
        loss, so that the ranks' averaged gradients are the global batch's mean."""
        self.pacer.begin()
        self.opt.zero_grad()
        self.opt.lr = self.schedule(self.step_index())
        if self.recorder is not None:
            self.recorder.lr = self.opt.lr
        loss = accumulate(index, self.cfg.accumulate, lambda part: self._loss(part, scale),
                          self.precision.backward,
                          getattr(self.net, "no_sync", contextlib.nullcontext))
        if self._pace_after_backward is not None:
            self._pace_after_backward()
        if self.clip is not None:  # under DDP the gradients are all-reduced by now
            self.precision.unscale(self.opt)
            self.clip(self.net.parameters())
        self.precision.step(self.opt)
        if self.comm is not None:
            self.comm.after_step(self.net.parameters())
        self._loss_sum += loss  # no .item() per step: it would wait for the GPU
        self._loss_steps += 1
        self.local_samples += len(index)
        self.steps += 1

    def _loss(self, index: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
        """The mean loss on rows ``index`` (one micro-batch), under autocast."""
        inputs, targets = self.task.train.rows(index)
        if self.device.type != "cpu":
            inputs = tuple(t.to(self.device, non_blocking=True) for t in inputs)
            targets = targets.to(self.device, non_blocking=True)
        with self.precision.autocast():
            loss = self.task.loss_fn(self.net(*inputs), targets)
            return loss * scale if scale is not None else loss

    def _resize(self) -> None:
        """All ranks, every --balance-every steps: each rank's samples a second of computing
        (a paced wait included) summed into one vector, and the batches sized from it."""
        mine = self.balance.my_speed(self.pacer.computed + self.pacer.waited,
                                     self.local_samples)
        speeds = self.agree(mine.to(self.device)).cpu().tolist()
        self.balance.resize(speeds, self.steps)
        if self.recorder is not None:
            self.recorder.metrics.write("balance", self.recorder.t(), self.samples(),
                                        step=self.steps, batches=self.balance.sizes,
                                        speeds=[round(v, 3) for v in speeds])

    def _check(self, epoch: int) -> tuple:
        """All ranks: agree on (reason to stop or None, steps until the next check)."""
        vector = torch.zeros(FIRST_RANK_SLOT + PACED * self.world, dtype=torch.float64)
        if self.recorder is not None:
            vector[CODE] = self._decide()
            vector[PACE] = self._next_pace()
            vector[SAVE] = float(self.recorder.checkpoint_due())
        vector[INTERRUPTS] = float(self.interrupted())
        vector[LOSS_SUM] = float(self._loss_sum)
        vector[LOSS_STEPS] = self._loss_steps
        mine = FIRST_RANK_SLOT + PACED * self.rank
        vector[mine:mine + PACED] = torch.tensor(
            [self.pacer.computed, self.pacer.waited, self.pacer.span], dtype=torch.float64)
        agreed = self.agree(vector.to(self.device)).cpu().tolist()
        self._loss_sum.zero_()
        self._loss_steps = 0
        self._pace_mark = (time.monotonic(), self.steps)
        if agreed[SAVE]:
            self.state.gather_rngs()
        if self.recorder is not None and agreed[SAVE]:
            self.recorder.checkpoint(self.samples(), self.epochs_done)
        # a later save (after a failure) must not pair these generators with a newer position
        self.state.rngs = None
        if self.recorder is not None:
            self.ranks_paced = agreed[FIRST_RANK_SLOT:]
            self._record(agreed[LOSS_SUM], int(agreed[LOSS_STEPS]), epoch)
        if agreed[INTERRUPTS]:
            return "interrupted", 0
        return STOP_REASONS.get(int(agreed[CODE])), int(agreed[PACE])

    def rank_bytes(self) -> dict:
        """summary.json's ``worker_bytes`` of a DDP run: each rank's share of a ring's
        traffic, as much sent as received (this session's; ``bytes`` holds a resumed
        run's earlier sessions too)."""
        if self.comm is None:
            return {}
        share = self.comm.bytes(self.steps) // self.world
        return {"worker_bytes": {f"rank-{r}": {"sent": share, "received": share}
                                 for r in range(self.world)}}

    def note_traffic(self) -> None:
        """Rank 0: the bytes DDP's all-reduces moved so far, for the next evaluation."""
        if self.comm is not None and self.recorder is not None:
            self.recorder.wire_bytes = self.recorder.bytes_offset + self.comm.bytes(self.steps)

    def _decide(self) -> int:
        """Rank 0: evaluate and checkpoint when due; whether to stop and why."""
        self.note_traffic()
        rec, samples = self.recorder, self.samples()
        if rec.evaluate_if_due(samples) and rec.target_reached():
            return TARGET
        if rec.out_of_time():
            return MAX_SECONDS
        return 0

    def _next_pace(self) -> int:
        """Rank 0: steps until the next check, so that checks come every CHECK_SECONDS.

        Measured over steps only (the last check's evaluation is excluded), and at
        most doubling per check so that one fast interval cannot postpone a stop.
        """
        t0, steps0 = self._pace_mark
        per_step = (time.monotonic() - t0) / max(1, self.steps - steps0)
        wanted = int(CHECK_SECONDS / per_step) if per_step > 0 else MAX_STEPS_BETWEEN_CHECKS
        self._pace = max(1, min(wanted, 2 * self._pace, MAX_STEPS_BETWEEN_CHECKS))
        return self._pace

    def _record(self, loss_sum: float, loss_steps: int, epoch: int, force: bool = False) -> None:
        rec, samples = self.recorder, self.samples()
        if self.ready_at is None:  # every rank has taken its first step
            self.ready_at = (rec.elapsed(), samples)
        self._pending[0] += loss_sum
        self._pending[1] += loss_steps
        if self._pending[1] and (force or rec.elapsed() >= self._next_train_event):
            # worker 0 stands for the whole group: one model, its loss averaged over ranks
            paced = self._summed()[:2]
            rec.train(samples, 0, self._pending[0] / self._pending[1],
                      steps=self._pending[1] // self.world, epoch=epoch, ranks=self.world,
                      **({"batches": self.balance.sizes} if self.balance is not None else {}),
                      **(pace_event(*((now - seen) / self.world  # per rank
                                      for now, seen in zip(paced, self._paced_seen)))
                         if self.timed else {}))
            self._paced_seen = paced
            self._pending = [0.0, 0]
            self._next_train_event = rec.elapsed() + TRAIN_EVENT_SECONDS
        note = pace_note(*self._summed()) if self.timed else ""
        if self.balance is not None:
            note = "; ".join(filter(None, [f"batches {self.balance.sizes}", note]))
        rec.show(samples, self.steady_rate() or 0.0, note=note)

    def _summed(self) -> list:
        """Rank 0: (computed, waited, span) seconds summed over the ranks."""
        return [sum(self.ranks_paced[k::PACED]) for k in range(PACED)]

    def steady_rate(self) -> Optional[float]:
        """Rank 0: samples/s since every rank was running (start-up excluded)."""
        if self.ready_at is None:
            return None
        t0, s0 = self.ready_at
        dt = self.recorder.elapsed() - t0
        return (self.samples() - s0) / dt if dt > 0 else None

    def pace(self) -> dict:
        """Rank 0: the stragglers asked for, and each rank's seconds computing, waiting on
        purpose, and the rest (all-reduces, waiting for the other ranks, updates)."""
        per_rank = zip(*(self.ranks_paced[k::PACED] for k in range(PACED)))
        return {**self.pacing.to_dict(), "ranks": [
            {"compute_seconds": round(c, 3), "waited_seconds": round(w, 3),
             "other_seconds": other_seconds(c, w, span)} for c, w, span in per_rank]
            if self.timed else None}

    def throughput(self) -> dict:
        rate = self.steady_rate()
        return {"startup_seconds": round(self.ready_at[0], 3) if self.ready_at else None,
                "steady_samples_per_second": round(rate, 1) if rate else None}


def _raising(who: str, rank: int, fn: Callable[[], str]) -> str:
    """``fn()``, any exception turned into a WorkerError carrying its traceback, so the run is
    concluded (saved, summary written) before the error is re-raised."""
    try:
        return fn()
    except CallbackError:
        raise  # a user's callback or a logger: its own error names it, no traceback wanted
    except Exception as exc:
        raise WorkerError(rank, f"{who} raised an exception; its traceback:\n"
                                f"{traceback.format_exc().rstrip()}") from exc


def train_process(cfg: SingleConfig, task: Task, *, device: torch.device, rank: int = 0,
                  world: int = 1, run: Optional[RunDir] = None,
                  wrap: Callable[[nn.Module], nn.Module] = lambda m: m, agree: Agree = alone,
                  flag_signals: bool = False, stop_requested: Callable[[], bool] = lambda: False,
                  started_at: Optional[float] = None, argv: Optional[list] = None,
                  name: str = "training", extra: Optional[dict] = None,
                  comm=None) -> Optional[RunResult]:
    """Run one process of a synchronous run; rank 0 (given ``run``) returns the RunResult.

    ``agree`` sums a small tensor over all ranks (an all-reduce; nothing for one
    process). ``flag_signals``: SIGINT/SIGTERM ask every rank to stop at the next
    check (DDP) instead of raising KeyboardInterrupt at once (single).
    ``stop_requested`` lets a launching parent ask the same. ``name`` says who
    failed in an error ("rank 1"). ``comm``: the group's gradient exchange (``SyncLoop``).
    """
    torch.manual_seed(cfg.seed + rank)
    model = task.build_model(cfg.seed)
    if cfg.optimizer == "adam" and any(getattr(m, "sparse", False) for m in model.modules()):
        raise ConfigError(f"--optimizer adam takes dense gradients; task {task.name}'s "
                          "model has sparse ones: use --optimizer sgd")
    part = padded_partition(len(task.train), world, rank, cfg.seed)
    balance = None
    if getattr(cfg, "balance", "none") == "batch":
        batch = cfg.batch_size or task.batch_size
        balance = BatchBalance(len(task.train), world, rank, batch,
                               min_batch(cfg.min_batch, batch), cfg.balance_every, cfg.seed)
    epoch_rows = balance.epoch_rows if balance is not None else len(part)
    recorder = None
    if run is not None:
        recorder = StatefulRecorder(
            cfg, task, model, run, argv=argv, started_at=started_at,
            total_samples=(epoch_rows if balance else epoch_rows * world) * cfg.epochs)
    model.to(device)
    # what rank 0 resumes (epoch, row, whether it has a training state), told to every rank
    start = torch.zeros(3, dtype=torch.float64)
    if recorder is not None:
        _check_balanced(recorder, balance is not None)
        start[:] = torch.tensor(resumed_start(recorder, epoch_rows, world), dtype=torch.float64)
    start = agree(start.to(device)).cpu().tolist()
    net = wrap(model)  # DDP's constructor copies rank 0's (maybe resumed) parameters everywhere
    precision = Precision(cfg.amp, device.type)
    interrupted = [False]
    loop = SyncLoop(cfg, task, net, precision, part, device, rank=rank, world=world,
                    start=(int(start[0]), int(start[1])), recorder=recorder, agree=agree,
                    interrupted=lambda: interrupted[0] or stop_requested(), comm=comm,
                    balance=balance)
    if start[2]:
        loop.state.restore(recorder.resumed if recorder else None, recorder)
    elif recorder is not None and cfg.resume:
        warn_model_only(recorder.run.checkpoint, fresh_state(cfg), int(start[0]))
    if recorder is not None:
        recorder.state_fn = (loop.state.to_dict if balance is None else
                             lambda: {**loop.state.to_dict(), "balanced": True})
    # signal handlers belong to the main thread: elsewhere (an API call from a thread)
    # Ctrl-C reaches the main thread, not this loop
    flag_signals = flag_signals and threading.current_thread() is threading.main_thread()
    signals = signals_as_flag(interrupted, second_raises=world == 1) if flag_signals \
        else contextlib.nullcontext()
    if recorder is None:
        with signals:
            loop.run()
        return None
    outcome = Outcome("epochs")
    with outcome.watch():
        with signals:
            recorder.evaluate(loop.samples())  # the starting point, before any update
            outcome.stopped_by = _raising(name, rank, loop.run)
            if outcome.stopped_by == "interrupted":
                outcome.status = "interrupted"
    throughput = loop.throughput()
    loop.note_traffic()
    return recorder.conclude(loop.samples(), loop.epochs_done, outcome,
                             rate=throughput["steady_samples_per_second"], **throughput,
                             **precision.state(), procs=world, lr=loop.schedule.lr,
                             batch_size=loop.batch_size, accumulate=cfg.accumulate,
                             global_batch_size=loop.step_rows * world,
                             **({"clipping": loop.clip.to_dict()} if loop.clip else {}),
                             pacing=loop.pace(), optimizer=cfg.optimizer, steps=loop.steps,
                             coverage=loop.coverage(),
                             **loop.rank_bytes(), **_staleness(loop.opt), **(extra or {}),
                             **({"balance": balance.to_dict()} if balance is not None else {}))


def _check_balanced(recorder: StatefulRecorder, balanced: bool) -> None:
    """A checkpoint's data position counts a balanced run's global rows, another's the
    rank's own: resuming across --balance would step from the wrong row."""
    state = recorder.resumed
    if state is not None and bool(state.get("balanced")) != balanced:
        raise recorder.bad_state("it was saved with --balance " +
                                 ("batch" if state.get("balanced") else "none"))


def _staleness(opt) -> dict:
    """summary.json: what --simulate-staleness did (nothing when it was off), counted since
    this process started: after a --resume, since the resume."""
    if not isinstance(opt, Delayed):
        return {}
    return {"simulated_staleness": opt.staleness, "updates_applied": opt.applied,
            "gradients_never_applied": len(opt.in_flight)}

