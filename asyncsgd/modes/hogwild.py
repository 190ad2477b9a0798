"""Hogwild!: N processes update one model in shared memory, without locks.

    asyncsgd hogwild --task mnist1d-cnn --procs 8
    asyncsgd hogwild --task sparse-logreg --procs 2 --lock     # locked baseline

After pytorch/examples' mnist_hogwild, with its gaps closed: disjoint data per worker, a
thread budget per process, run tokens past the cores, and an owned, stoppable run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config import HogwildConfig
from ..core.pacing import Pacer, Pacing, other_seconds, pace_event, pace_note
from ..core import coverage
from ..core.schedule import Schedule, schedule
from ..core.tasks import Task, partition_indices, task_of
from ..errors import ConfigError, WorkerError
from ..run.sendable import check_sendable
from ..run.pipe_semaphore import PipeSemaphore
from ..run.process_group import WorkerGroup, available_cores, context, threads_per_process
from ..run.recorder import Outcome, RunResult, check_target
from .hogwild_dispatch import DynamicRows, RowLedger, StaticRows
from .hogwild_state import RNG_SAVED, HogwildState, set_worker_rngs, unpack, worker_rngs
from .gradients import accumulate, clipper
from .optim import SGD
from .precision import Precision, check_amp
from .resume import StatefulRecorder, warn_model_only
from .token_ring import TokenRing

log = logging.getLogger(__name__)

# Columns of the shared per-worker counters (one row per worker, written only by it).
# (POSITION and RNG_SAVED, columns 5 and 6, are the training state's: hogwild_state.)
SAMPLES, STEPS, EPOCHS, READY, DONE = range(5)
CLIPPED = 7  # steps whose gradient --clip-grad-norm rescaled
COLUMNS = 8
# Columns of the shared per-worker sums: training loss, its steps, and (core.pacing)
# seconds computing and seconds waited on purpose.
LOSS_SUM, LOSS_STEPS, COMPUTED, WAITED, SPAN = range(5)
POLL_SECONDS = 0.25
# Until every worker is training: startup_seconds was up to a whole POLL_SECONDS late
READY_POLL_SECONDS = 0.01
TRAIN_EVENT_SECONDS = 1.0
STOP_GRACE = 10.0  # seconds for training workers to see the stop flag and exit


@dataclass
class WorkerSettings:
    """What a worker needs besides the shared objects; plain values, cheap to send."""

    procs: int
    threads: int
    seed: int
    lr: float
    momentum: float
    weight_decay: float
    batch_size: int
    epochs: int
    device: str
    quantum: float
    pacing: Pacing
    schedule: Schedule
    steps_before: int  # steps of all processes in the sessions before a --resume
    amp: str = "off"
    clip_grad_norm: Optional[float] = None
    accumulate: int = 1


def _worker(rank: int, s: WorkerSettings, task: Task, model: torch.nn.Module, lock,
            ring_sems: Optional[tuple], control: torch.Tensor, counters: torch.Tensor,
            losses: torch.Tensor, shared_state: tuple, ledger: RowLedger,
            pending: list) -> None:
    rngs, buffers = shared_state
    count = counters.numpy()[rank]  # views of shared memory: plain stores, no tensor op per step
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed + rank)
    device = torch.device(s.device)
    if count[RNG_SAVED]:  # resumed: this worker's generators continue where they stopped
        set_worker_rngs(rngs[rank], device)
    opt = SGD(model.parameters(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)
    precision = Precision(s.amp, device.type)
    clip = clipper(s.clip_grad_norm)
    if buffers:
        opt.keep_buffers_in(buffers)
    loss_acc = losses.numpy()[rank]
    all_steps = counters.numpy()[:, STEPS]  # every process's: the schedule's one count
    pacer = Pacer(s.pacing, rank, s.seed, torch.cuda.synchronize if device.type == "cuda"
                  else None)
    stop = control.numpy()
    ring = TokenRing(rank, *ring_sems, counters.numpy()[:, DONE], stop, s.quantum) \
        if ring_sems else None
    if ledger.dynamic:
        # a step claims its --accumulate micro-batches' rows at once: positions and claims
        # stay whole steps, so a checkpoint never falls inside one
        batches = DynamicRows(ledger, rank, s.epochs, s.batch_size * s.accumulate, pending,
                              count)
        log.info("worker %d: %d thread(s), batches claimed on demand%s%s", rank, s.threads,
                 f", {len(pending)} handed again first" if pending else "",
                 ", run token ring" if ring else "")
    else:
        part = partition_indices(len(task.train), s.procs, rank, s.seed)
        batches = StaticRows(part, s.seed, rank, s.epochs, s.batch_size * s.accumulate, count)
        log.info("worker %d: %d thread(s), %d rows, epochs %d..%d%s%s", rank, s.threads,
                 len(part), batches.epoch + 1, s.epochs,
                 f" from row {batches.start}" if batches.start else "",
                 ", run token ring" if ring else "")
    # From here the saved generator is this worker's no more: one killed past this point
    # is seeded anew on resume; one killed while starting keeps it.
    count[RNG_SAVED] = 0
    count[READY] = 1
    holding = ring.acquire() if ring else True
    try:
        while not stop[0] and holding:  # checked before a claim: a claimed batch is trained
            rows = batches.next()
            if rows is None:
                return
            pacer.begin()
            opt.zero_grad()
            loss = accumulate(rows, s.accumulate, lambda part: _loss(task, model, part, device,
                                                                     precision),
                              precision.backward)
            pacer.end()  # a straggler waits here: its gradient lands late
            loss_acc[COMPUTED], loss_acc[WAITED] = pacer.computed, pacer.waited
            loss_acc[SPAN] = pacer.span
            opt.lr = s.schedule(s.steps_before + int(all_steps.sum()))
            if clip is not None:
                precision.unscale(opt)
                count[CLIPPED] += bool(clip.clipped_by(clip(model.parameters())))
            if lock is None:
                precision.step(opt)
            else:
                with lock:
                    precision.step(opt)
            ledger.trained(rank, rows)
            loss_acc[LOSS_SUM] += loss.item()
            loss_acc[LOSS_STEPS] += 1
            count[SAMPLES] += len(rows)
            count[STEPS] += 1
            batches.done(rows)
            if ring:
                holding = ring.tick()
    finally:
        rngs[rank] = worker_rngs(device)
        count[RNG_SAVED] = 1
        if ring:
            ring.leave(holding)


def _loss(task: Task, model: torch.nn.Module, rows: torch.Tensor, device: torch.device,
          precision: Precision) -> torch.Tensor:
    """The mean loss on ``rows`` (one micro-batch), under autocast."""
    inputs, targets = task.train.rows(rows)
    if device.type != "cpu":
        inputs = tuple(t.to(device, non_blocking=True) for t in inputs)
        targets = targets.to(device, non_blocking=True)
    with precision.autocast():
        return task.loss_fn(model(*inputs), targets)


def _check_config(cfg: HogwildConfig, model: torch.nn.Module) -> None:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch "
                          "(torch.cuda.is_available() is False); use --device cpu")
    check_amp(cfg.amp, cfg.device)
    if cfg.momentum and any(getattr(m, "sparse", False) for m in model.modules()):
        log.info("momentum with sparse gradients densifies each process's momentum buffer")


def train(cfg: HogwildConfig, task: Optional[Task] = None,
          argv: Optional[list] = None) -> RunResult:
    """Run Hogwild as configured; returns the run directory and its summary.

    The model is moved into shared memory before the workers are spawned, so all of them
    update the same storage; each worker runs cores // procs torch threads, seeds with
    seed + rank and trains on its own disjoint partition, reshuffled every epoch (the
    PyTorch example gives every process the whole data set). Only the parameters are
    shared; ``--lock`` takes one shared lock around every update. This process evaluates
    the shared model every ``--eval-every`` seconds while the workers go on, and stops
    them all on a stop condition, an error, Ctrl-C or SIGTERM."""
    procs = cfg.procs or available_cores()
    if procs < 1:
        raise ConfigError(f"--procs must be at least 1 (got {procs})")
    pacing = Pacing.parse(cfg.slowdown, cfg.delay)
    pacing.check_ranks(procs, "--procs")
    run = StatefulRecorder.open_run(cfg)
    with run.removed_on_error():
        task = task or task_of(cfg)
        check_sendable(task, "Hogwild workers")
        check_target(cfg, task)
        model = task.build_model(cfg.seed)
        _check_config(cfg, model)
    lr = cfg.lr or task.lr
    batch_size = cfg.batch_size or task.batch_size
    total = len(task.train) * cfg.epochs
    recorder = StatefulRecorder(cfg, task, model, run, total_samples=total, argv=argv)
    model.to(cfg.device)
    model.share_memory()
    task.share_memory_()

    threads = threads_per_process(procs, cfg.threads)
    torch.set_num_threads(threads)  # the parent evaluates beside the workers: don't steal cores
    settings = WorkerSettings(
        procs=procs, threads=threads, seed=cfg.seed, lr=lr, momentum=cfg.momentum,
        weight_decay=cfg.weight_decay, batch_size=batch_size, epochs=cfg.epochs,
        device=cfg.device, quantum=cfg.quantum_ms / 1000, pacing=pacing,
        schedule=Schedule(lr), steps_before=0, amp=cfg.amp,
        clip_grad_norm=cfg.clip_grad_norm, accumulate=cfg.accumulate)
    counters = torch.zeros(procs, COLUMNS, dtype=torch.int64).share_memory_()
    state = _shared_state(cfg, task, model, recorder, procs, counters)
    ledger, pending = _ledger(cfg, task, recorder, procs, state)
    settings.steps_before, settings.schedule, lr_in_force = _schedule(
        cfg, task, recorder, procs, lr, batch_size * cfg.accumulate, counters)
    control = torch.zeros(1, dtype=torch.int64).share_memory_()
    counters[:, EPOCHS] = torch.tensor([unpack(int(p))[0] for p in state.positions])
    losses = torch.zeros(procs, SPAN + 1, dtype=torch.float64).share_memory_()
    # multiprocessing's Lock, a futex, is far cheaper a step than a pipe semaphore
    # (experiments/README.md, "Locks and semaphores"), though its name stays in /dev/shm
    # should a SIGKILL take the whole process group, resource tracker included
    lock = context(cfg.start_method, preload=[__name__]).Lock() if cfg.lock else None
    ring_sems = _ring_semaphores(cfg, procs, threads)
    group = WorkerGroup(_worker, procs, name="worker", start_method=cfg.start_method, args=[
        (settings, task, model, lock,
         ring_sems and (ring_sems[rank], ring_sems[(rank + 1) % procs]),  # its own, the next's
         control, counters, losses, state.for_worker(rank), ledger, pending[rank::procs])
        for rank in range(procs)])
    log.info("hogwild: %d processes x %d thread(s), task %s, lr %g, batch %d%s%s", procs,
             threads, task.name, lr, batch_size, ", locked updates" if cfg.lock else "",
             f", {len(TokenRing.first_holders(procs, available_cores()))} run tokens"
             if ring_sems else "")
    if pacing.active:
        log.info("hogwild: stragglers: %s", pacing.describe())
    return _supervise(cfg, recorder, group, control, counters, losses, ledger, lr_in_force,
                      extra={"procs": procs, "threads": threads, "lock": cfg.lock, "lr": lr,
                             "batch_size": batch_size, "accumulate": cfg.accumulate,
                             "amp": cfg.amp, "token_ring": bool(ring_sems),
                             "pacing": pacing.to_dict(), "data_dispatch": {
                                 "kind": cfg.data_dispatch,
                                 # resumed rows of claims a stopped run left untrained
                                 "rehanded_samples": sum(e - s for _, s, e in pending)}})


def _shared_state(cfg: HogwildConfig, task: Task, model: torch.nn.Module,
                  recorder: StatefulRecorder, procs: int, counters: torch.Tensor) -> HogwildState:
    """The workers' shared training state, loaded from a full checkpoint when resuming; the
    recorder's checkpoints then hold it."""
    state = HogwildState(procs, list(model.parameters()), cfg.momentum, recorder.epochs_done,
                         counters, torch.device(cfg.device))
    if recorder.resumed is not None:
        rows = [len(partition_indices(len(task.train), procs, rank, cfg.seed))
                for rank in range(procs)]
        problem = state.restore(recorder.resumed, rows)
        if problem:
            raise recorder.bad_state(problem)
    elif cfg.resume:
        warn_model_only(recorder.run.checkpoint, ["each process's momentum buffer"]
                        if cfg.momentum else [], recorder.epochs_done)
    recorder.state_fn = state.state
    return state


def _schedule(cfg: HogwildConfig, task: Task, recorder: StatefulRecorder, procs: int,
              lr: float, step_rows: int, counters: torch.Tensor) -> tuple:
    """(steps before this session, the lr rule, the lr in force now), driven by the steps
    of all processes together, a count the checkpoints hold."""
    rows = len(task.train)
    per_epoch = (-(-rows // step_rows) if cfg.data_dispatch == "dynamic" else
                 sum(-(-len(partition_indices(rows, procs, r, cfg.seed)) // step_rows)
                     for r in range(procs)))
    rule = schedule(lr, cfg.lr_schedule, cfg.warmup, steps=cfg.epochs * per_epoch,
                    samples_per_step=step_rows)
    before = int((recorder.resumed or {}).get("schedule_steps",
                                              recorder.samples_offset // step_rows))

    def steps() -> int:
        return before + int(counters[:, STEPS].sum())

    def lr_in_force() -> float:  # the latest step's (before any: the first's)
        return rule(max(before, steps() - 1))

    saved = recorder.state_fn  # the workers' and the rows' states
    recorder.state_fn = lambda: {**saved(), "schedule_steps": steps()}
    recorder.lr = lr_in_force()
    return before, rule, lr_in_force


def _ledger(cfg: HogwildConfig, task: Task, recorder: StatefulRecorder, procs: int,
            state: HogwildState) -> tuple:
    """The rows' shared ledger (its counts and dispatch from the resumed checkpoint), and
    the claims to hand out again first; checkpoints hold its state beside the workers'."""
    dynamic = cfg.data_dispatch == "dynamic"
    lock = context(cfg.start_method, preload=[__name__]).Lock() if dynamic else None
    ledger = RowLedger(len(task.train), procs, cfg.seed, dynamic, lock, recorder.epochs_done)
    saved = (recorder.resumed or {}).get("dispatch")
    if saved is not None and saved.get("kind") != cfg.data_dispatch:
        log.warning("the checkpoint's rows were dispatched %s, this run's are %s: epoch %d "
                    "starts from its first row", saved.get("kind"), cfg.data_dispatch,
                    recorder.epochs_done + 1)
    pending = ledger.restore(saved)
    workers = state.state
    recorder.state_fn = lambda: {**workers(), "dispatch": ledger.state()}
    return ledger, pending


def _ring_semaphores(cfg: HogwildConfig, procs: int, threads: int) -> Optional[list]:
    """One semaphore per worker for the token ring, or None when the ring is off.

    ``auto`` turns it on when CPU processes outnumber what the cores can run at once.
    """
    cores = available_cores()
    on = cfg.share_cores == "ring" or (
        cfg.share_cores == "auto" and cfg.device == "cpu" and procs * threads > cores)
    if not on or procs < 2:
        return None
    sems = [PipeSemaphore(0) for _ in range(procs)]
    for rank in TokenRing.first_holders(procs, max(1, cores // threads)):
        sems[rank].release()
    return sems


class _TrainEvents:
    """Turns the shared counters into per-worker train events and a recent samples/s."""

    def __init__(self, recorder: StatefulRecorder, counters: torch.Tensor, losses: torch.Tensor):
        self.recorder, self.counters, self.losses = recorder, counters, losses
        self.offset = recorder.samples_offset
        self.seen = losses.clone()
        self.window = [(recorder.elapsed(), self.offset)]
        self.ready_at: Optional[tuple] = None  # (elapsed, samples) once every worker runs

    def note_ready(self) -> None:
        if self.ready_at is None and bool(self.counters[:, READY].all()):
            self.ready_at = (self.recorder.elapsed(), self.samples())

    def throughput(self) -> dict:
        """Start-up time and samples/s from the moment every worker was running."""
        if self.ready_at is None:
            return {"startup_seconds": None, "steady_samples_per_second": None}
        t0, s0 = self.ready_at
        dt = self.recorder.elapsed() - t0
        rate = (self.samples() - s0) / dt if dt > 0 else None
        return {"startup_seconds": round(t0, 3),
                "steady_samples_per_second": round(rate, 1) if rate else None}

    def samples(self) -> int:
        return self.offset + int(self.counters[:, SAMPLES].sum())

    def rate(self) -> float:
        now, samples = self.recorder.elapsed(), self.samples()
        self.window = [w for w in self.window if now - w[0] <= 3.0] + [(now, samples)]
        t0, s0 = self.window[0]
        return (samples - s0) / (now - t0) if now > t0 else 0.0

    def emit(self) -> None:
        now = self.losses.clone()
        counts = self.counters.clone()
        samples = self.offset + int(counts[:, SAMPLES].sum())
        for rank in range(len(now)):
            delta = (now[rank] - self.seen[rank]).tolist()
            steps = int(delta[LOSS_STEPS])
            if steps > 0:
                self.recorder.train(samples, rank, delta[LOSS_SUM] / steps, steps,
                                    int(counts[rank, EPOCHS]),
                                    **pace_event(delta[COMPUTED], delta[WAITED]))
        self.seen = now

    def pace_note(self) -> str:
        """Where all workers' step time went, for the progress line."""
        return pace_note(*self.losses[:, [COMPUTED, WAITED, SPAN]].sum(0).tolist())

    def pace(self) -> list:
        """Per worker: steps, seconds computing, waited on purpose, and the rest."""
        return [{"steps": int(row[LOSS_STEPS]), "compute_seconds": round(row[COMPUTED], 3),
                 "waited_seconds": round(row[WAITED], 3),
                 "other_seconds": other_seconds(row[COMPUTED], row[WAITED], row[SPAN])}
                for row in self.losses.tolist()]


def _supervise(cfg: HogwildConfig, recorder: StatefulRecorder, group: WorkerGroup,
               control: torch.Tensor, counters: torch.Tensor, losses: torch.Tensor,
               ledger: RowLedger, lr_in_force: Callable[[], float],
               extra: dict) -> RunResult:
    def epochs_done() -> int:
        return ledger.epochs_done() if ledger.dynamic else int(counters[:, EPOCHS].min())

    events = _TrainEvents(recorder, counters, losses)
    outcome = Outcome("epochs")
    next_train_event = 0.0
    try:
        with outcome.watch():
            recorder.evaluate(events.samples())  # the starting point, before any update
            group.start()
            while True:
                finished = group.wait(POLL_SECONDS if events.ready_at else READY_POLL_SECONDS)
                group.check()
                events.note_ready()
                samples = events.samples()
                if recorder.elapsed() >= next_train_event:
                    events.emit()
                    next_train_event = recorder.elapsed() + TRAIN_EVENT_SECONDS
                recorder.lr = lr_in_force()
                if recorder.evaluate_if_due(samples) and recorder.target_reached():
                    outcome.stopped_by = "target"
                    break
                if recorder.out_of_time():
                    outcome.stopped_by = "max_seconds"
                    break
                if finished:
                    break
                recorder.checkpoint_if_due(samples, epochs_done())
                recorder.show(samples, events.rate(), note=events.pace_note())
    finally:
        control[0] = 1
        throughput = events.throughput()
        # A worker still starting (importing torch: 8 of them took over 10 s on 2 loaded
        # cores) holds nothing yet and is ended at once; one training stops at its next step.
        group.stop(grace=STOP_GRACE, starting=lambda rank: not counters[rank, READY])
    if outcome.error is None:
        try:
            group.check()
        except WorkerError as exc:  # failed while the others were stopping
            outcome.failed(exc)
    events.emit()
    samples = events.samples()
    recorder.lr = lr_in_force()
    extra["pacing"]["ranks"] = events.pace()
    extra["coverage"] = coverage.of_samples(ledger.counts)
    if cfg.clip_grad_norm:
        extra["clipping"] = {"max_norm": cfg.clip_grad_norm,
                             "steps": int(counters[:, STEPS].sum()),
                             "clipped_steps": int(counters[:, CLIPPED].sum())}
    return recorder.conclude(samples, epochs_done(), outcome,
                             rate=throughput["steady_samples_per_second"], **throughput, **extra)
