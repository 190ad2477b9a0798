"""The synchronous SGD loop of ``asyncsgd single`` and of every ``asyncsgd ddp`` rank.

One process (single) or every rank of a DDP group runs ``train_process``:
build the model, let rank 0 open the Recorder (run directory, resume), agree
on the starting epoch, wrap the model (DDP or nothing), then step through this
process's data and stop when the epochs are done or when the ranks agree to
stop.

How the ranks agree without lock-step on every step: every few steps each
rank adds a small vector to one all-reduce (sum): rank 0 puts in its stop
decision (--max-seconds, --target after an evaluation it has just
run) and how many steps to go until the next check; every rank puts in
whether it was interrupted and its summed training loss. All ranks therefore
see the same decision at the same step and stop together, with no rank left
waiting in a collective. Rank 0 sizes the interval so that checks come about
every ``CHECK_SECONDS`` whatever the step time: an all-reduce per step would
cost more than the step itself for small models (a gloo all-reduce of a few
numbers takes ~1-3 ms on two cores here). Rank 0 evaluates, checkpoints and
writes metrics only at checks, while the others wait in that all-reduce.

Data: each process trains on ``partition_indices(n, world, rank, seed)``,
the same split Hogwild and the parameter-server workers use, reshuffled each
epoch. The shorter partitions repeat their first rows up to the longest (as
DistributedSampler pads), because DDP needs every rank to take the same number
of steps: a rank with one step more would wait forever for the others.

Checkpoints are full (``modes.resume``): the update rule's state (equal on every
rank: they apply the same averaged gradients), the position in the data (equal on
every rank: they step together) and each rank's random generators, gathered in
one extra all-reduce when rank 0 saves. Ranks stop only at checks, between steps
(Ctrl-C and SIGTERM set a flag, in ``single`` too), so what is saved is one
consistent state and a resumed run takes exactly the steps the stopped one would have.
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

from ..config import SingleConfig, parse_comm_hook
from ..core.pacing import Pacer, Pacing, other_seconds, pace_event, pace_note
from ..core.tasks import Task, epoch_order, partition_indices
from ..errors import ConfigError, WorkerError
from ..run.recorder import Outcome, RunResult
from ..run.checkpoint import rng_state, set_rng_state
from ..run.rundir import RunDir
from ..run.signals import signals_as_flag
from .optim import SGD, Adam, Delayed
from .precision import Precision, check_amp
from .resume import StatefulRecorder, warn_model_only

log = logging.getLogger(__name__)

CHECK_SECONDS = 0.2  # how often the ranks agree whether to stop; bounds the stop latency
MAX_STEPS_BETWEEN_CHECKS = 100_000
TRAIN_EVENT_SECONDS = 1.0
STOP_REASONS = {1: "max_seconds", 2: "target"}
MAX_SECONDS, TARGET = 1, 2
# Slots of the vector the ranks sum at every check; then each rank's seconds computing,
# waited on purpose and since its first step (core.pacing), in PACED slots per rank from
# FIRST_RANK_SLOT.
CODE, PACE, INTERRUPTS, LOSS_SUM, LOSS_STEPS, SAVE, FIRST_RANK_SLOT = range(7)
PACED = 3

Agree = Callable[[torch.Tensor], torch.Tensor]


def padded_partition(n: int, parts: int, index: int, seed: int) -> torch.Tensor:
    """Rows of process ``index``: its partition, padded with its own first rows to the
    length of the longest partition so that every process takes the same number of steps."""
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
    checkpoints, records and decides when to stop."""

    def __init__(self, cfg: SingleConfig, task: Task, net: nn.Module, precision: Precision,
                 part: torch.Tensor, device: torch.device, *, rank: int, world: int,
                 start: tuple, recorder: Optional[StatefulRecorder], agree: Agree,
                 interrupted: Callable[[], bool]):
        self.cfg, self.task, self.net, self.precision = cfg, task, net, precision
        self.part, self.device, self.rank, self.world = part, device, rank, world
        self.recorder, self.agree, self.interrupted = recorder, agree, interrupted
        self.batch_size = cfg.batch_size or task.batch_size
        self.opt = make_optimizer(cfg, task, net.parameters())
        self.epochs_done = start[0]
        self.position = start  # (epoch, rows of its order done): where the next step starts
        self.rngs: Optional[list] = None  # rank 0: every rank's generators at the last gather
        self.resumed_rng: Optional[dict] = None  # set just before the first step
        self.steps = 0
        self.local_samples = 0
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
        self.averager = None  # ddp --local-steps: averages the ranks' parameters periodically
        self.traffic: Optional[AllReduceTraffic] = None  # DDP: what it hands to all-reduce
        # Whether steps are timed: DDP's are only when paced (a hook in its reducer)
        self.timed = True
        if hasattr(net, "register_comm_hook"):  # DDP: the wait goes before the all-reduce
            self._pace_after_backward = None
            self.timed = self.pacing.active
            hook = comm_hook(cfg.comm_hook)
            if cfg.local_steps > 1:
                hook, self.averager = post_local_sgd(cfg.local_steps, cfg.local_warmup)
            self.traffic = AllReduceTraffic(net, world, cfg.comm_hook, hook[0], cfg.local_steps,
                                            cfg.local_warmup)
            if self.timed:
                net.register_comm_hook((self.pacer, *hook), _paced_hook)
            elif hook[1] is not None:
                net.register_comm_hook(*hook)
        if self.pacing.active and recorder is not None:
            log.info("stragglers: %s", self.pacing.describe())
        self.ranks_paced = [0.0] * (PACED * world)  # rank 0: the agreed per-rank seconds
        self._paced_seen = [0.0, 0.0]  # rank 0: summed (computed, waited) at the last event

    def samples(self) -> int:
        """Samples trained on by all ranks, across resumes (equal on every rank by padding)."""
        offset = self.recorder.samples_offset if self.recorder else 0
        return offset + self.world * self.local_samples

    def run(self) -> str:
        """Train until the epochs are done or the ranks agree to stop; what stopped it."""
        stopped_by = self._train()
        self.rngs = self._gather_rngs()  # every rank stopped at the same step: the final save
        return stopped_by

    def _train(self) -> str:
        until_check = 1
        first_epoch, skip = self.position
        if self.resumed_rng is not None:  # after the evaluation at the start, as it was saved
            set_rng_state(self.resumed_rng, self.device)
        for epoch in range(first_epoch, self.cfg.epochs):
            order = epoch_order(self.part, self.cfg.seed, self.rank, epoch)
            for start in range(skip if epoch == first_epoch else 0, len(order),
                               self.batch_size):
                self._step(order[start:start + self.batch_size])
                self.position = (epoch, min(start + self.batch_size, len(order)))
                until_check -= 1
                if until_check == 0:
                    stopped_by, until_check = self._check(epoch)
                    if stopped_by:
                        return stopped_by
            self.epochs_done = epoch + 1
            self.position = (epoch + 1, 0)
        self._check(self.epochs_done - 1)  # every rank gets here at the same step: the last losses
        return "epochs"

    def _gather_rngs(self) -> list:
        """Every rank's random generators, on rank 0 (an all-reduce of each rank's torch
        state in its own slot; numpy's and Python's of rank 0 only)."""
        mine = rng_state(self.device)
        if self.world == 1:
            return [mine]
        flat = torch.cat([mine["torch"]] + ([mine["cuda"]] if "cuda" in mine else []))
        n = flat.numel()
        vector = torch.zeros(self.world * n, dtype=torch.float64)
        vector[self.rank * n:(self.rank + 1) * n] = flat.double()
        summed = self.agree(vector.to(self.device)).cpu().to(torch.uint8)
        cut = mine["torch"].numel()
        rngs = []
        for r in range(self.world):
            row = summed[r * n:(r + 1) * n]
            rngs.append(mine if r == self.rank else
                        {"torch": row[:cut].clone(), **({"cuda": row[cut:].clone()}
                                                        if "cuda" in mine else {})})
        return rngs

    def state(self) -> dict:
        """Rank 0: the training state for a full checkpoint (``modes.resume``)."""
        rngs = self.rngs or [rng_state(self.device)] + [None] * (self.world - 1)
        epoch, row = self.position
        scaler = self.precision.scaler
        return {"optimizer": self.opt.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "processes": [{"epoch": epoch, "row": row, "rng": rng} for rng in rngs]}

    def _step(self, index: torch.Tensor) -> None:
        self.pacer.begin()
        inputs, targets = self.task.train.rows(index)
        if self.device.type != "cpu":
            inputs = tuple(t.to(self.device, non_blocking=True) for t in inputs)
            targets = targets.to(self.device, non_blocking=True)
        with self.precision.autocast():
            loss = self.task.loss_fn(self.net(*inputs), targets)
        self.opt.zero_grad()
        self.precision.backward_and_step(loss, self.opt, between=self._pace_after_backward)
        if self.averager is not None:  # what PostLocalSGDOptimizer.step does after the step
            self.averager.average_parameters(self.net.parameters())
        self._loss_sum += loss.detach()  # no .item() per step: it would wait for the GPU
        self._loss_steps += 1
        self.local_samples += len(targets)
        self.steps += 1

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
            self.rngs = self._gather_rngs()
        if self.recorder is not None and agreed[SAVE]:
            self.recorder.checkpoint(self.samples(), self.epochs_done)
        # a later save (after a failure) must not pair these generators with a newer position
        self.rngs = None
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
        if self.traffic is None:
            return {}
        share = self.traffic.bytes(self.steps) // self.world
        return {"worker_bytes": {f"rank-{r}": {"sent": share, "received": share}
                                 for r in range(self.world)}}

    def note_traffic(self) -> None:
        """Rank 0: the bytes DDP's all-reduces moved so far, for the next evaluation."""
        if self.traffic is not None and self.recorder is not None:
            self.recorder.wire_bytes = self.recorder.bytes_offset + self.traffic.bytes(self.steps)

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
                      **(pace_event(*((now - seen) / self.world  # per rank
                                      for now, seen in zip(paced, self._paced_seen)))
                         if self.timed else {}))
            self._paced_seen = paced
            self._pending = [0.0, 0]
            self._next_train_event = rec.elapsed() + TRAIN_EVENT_SECONDS
        rec.show(samples, self.steady_rate() or 0.0,
                 note=pace_note(*self._summed()) if self.timed else "")

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


def comm_hook(spec: str) -> tuple:
    """``(state, hook)`` of --comm-hook: PyTorch's own DDP communication hooks, so that a
    comparison runs what a PyTorch user would; ``(None, None)``: DDP's built-in all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    kind, rank = parse_comm_hook(spec)
    if kind == "fp16":
        return None, default_hooks.fp16_compress_hook
    if kind == "bf16":
        return None, default_hooks.bf16_compress_hook
    if kind == "powersgd":
        # start_powerSGD_iter 2, not 1,000: runs here are short, and PowerSGD must start
        # after at least one plain step (its error feedback needs one)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=2)
        return state, (_one_bucket_at_a_time if _gloo() else powerSGD_hook.powerSGD_hook)
    return None, None


def _gloo() -> bool:
    import torch.distributed as dist
    return dist.is_initialized() and dist.get_backend() == "gloo"


def _one_bucket_at_a_time(state, bucket):  # no annotations: DDP checks them as objects
    """PowerSGD on Gloo, each bucket's collectives done before the next bucket's begin.

    PowerSGD chains its all-reduces (uncompressed tensors, then P, then Q) in future
    callbacks; with two buckets (DDP's first holds 1 MiB: mnist1d-mlp:width=512 has two)
    the chains interleave in a different order on each rank, and Gloo, which matches
    collectives by order, failed: 'Received data size doesn't match expected size. 264 vs
    256', rank 0 already in the next all-reduce. NCCL orders them on its stream."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    fut = powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def post_local_sgd(period: int, warmup: int) -> tuple:
    """``((state, hook), averager)`` of ddp --local-steps: PyTorch's post-local SGD.

    Its hook all-reduces gradients for ``warmup`` steps, then not at all (no subgroup
    all-reduce: ranks train alone); the averager all-reduces the parameters every
    ``period`` steps after the warm-up. PyTorch's PostLocalSGDOptimizer is the optimizer's
    step then this averager; it wraps a torch.optim.Optimizer, which this loop's optimizer
    is not (modes.optim says why), so the loop calls the averager itself."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState, post_localSGD_hook)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                              post_local_gradient_allreduce=False)
    return (state, post_localSGD_hook), PeriodicModelAverager(period=period,
                                                              warmup_steps=warmup)


class AllReduceTraffic:
    """The bytes a DDP job's gradient all-reduces put on the network, from what DDP hands
    its communication hook each step (all the gradients: every parameter here is used):
    the gradients' bytes with the default hook, 2 bytes a value with fp16/bf16, PowerSGD's
    own count of what it sent once it compresses (``total_numel_after_compression``),
    post-local SGD's warm-up steps and then a copy of the parameters at each averaging.
    Gloo's and NCCL's all-reduce is a ring: each of W ranks sends and receives 2(W-1)/W of
    that payload, so the network carries 2(W-1) times it. Computed, not counted: a run
    over shaped links (compare --link) has the kernel's count beside it. DDP also
    broadcasts the model's buffers from rank 0 before each step (``broadcast_buffers``:
    the LM task's causal mask, context^2 values): W-1 copies. Left out: the agreement
    all-reduces (a few float64 per check)."""

    def __init__(self, net, world: int, hook: str, hook_state, local_steps: int,
                 local_warmup: int):
        params = [p for p in net.parameters() if p.requires_grad]
        self.values = sum(p.numel() for p in params)
        self.itemsize = params[0].element_size() if params else 4
        self.buffers = sum(b.numel() * b.element_size() for b in net.buffers()) \
            if getattr(net, "broadcast_buffers", False) else 0
        self.world, self.kind = world, parse_comm_hook(hook)[0]
        self.state, self.local_steps, self.warmup = hook_state, local_steps, local_warmup

    def payload(self, steps: int) -> int:
        """Bytes one rank handed to all-reduce in its first ``steps`` steps."""
        full = self.values * self.itemsize
        if self.local_steps > 1:  # post-local SGD: PeriodicModelAverager's schedule
            averagings = len(range(self.warmup, steps, self.local_steps))
            return min(steps, self.warmup) * full + averagings * full
        if self.kind in ("fp16", "bf16"):
            return steps * self.values * 2
        if self.kind == "powersgd":
            plain = min(steps, self.state.start_powerSGD_iter)
            return plain * full + int(self.state.total_numel_after_compression) * self.itemsize
        return steps * full

    def bytes(self, steps: int) -> int:
        """Bytes on the network, every rank's together: a ring's 2(W-1) x the payload, and
        W-1 copies of the buffers a step."""
        return (self.world - 1) * (2 * self.payload(steps) + steps * self.buffers)


def _paced_hook(state, bucket):  # no annotations: DDP checks them as objects
    """DDP's all-reduce (or --comm-hook's), after this rank's pace: a straggler's gradients
    reach the others late. The last bucket is handed over once every gradient of the step
    is computed. ``state``: (pacer, the hook's own state, the hook or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    pacer, inner_state, inner = state
    if bucket.is_last():
        pacer.end()
    return (inner or allreduce_hook)(inner_state, bucket)


def _raising(who: str, rank: int, fn: Callable[[], str]) -> str:
    """``fn()``, any exception turned into a WorkerError carrying its traceback, so the run is
    concluded (saved, summary written) before the error is re-raised."""
    try:
        return fn()
    except Exception as exc:
        raise WorkerError(rank, f"{who} raised an exception; its traceback:\n"
                                f"{traceback.format_exc().rstrip()}") from exc


def train_process(cfg: SingleConfig, task: Task, *, device: torch.device, rank: int = 0,
                  world: int = 1, run: Optional[RunDir] = None,
                  wrap: Callable[[nn.Module], nn.Module] = lambda m: m, agree: Agree = alone,
                  flag_signals: bool = False, stop_requested: Callable[[], bool] = lambda: False,
                  started_at: Optional[float] = None, argv: Optional[list] = None,
                  name: str = "training", extra: Optional[dict] = None) -> Optional[RunResult]:
    """Run one process of a synchronous run; rank 0 (given ``run``) returns the RunResult.

    ``agree`` sums a small tensor over all ranks (an all-reduce; nothing for one
    process). ``flag_signals``: SIGINT/SIGTERM ask every rank to stop at the next
    check (DDP) instead of raising KeyboardInterrupt at once (single).
    ``stop_requested`` lets a launching parent ask the same. ``name`` says who
    failed in an error ("rank 1").
    """
    torch.manual_seed(cfg.seed + rank)
    model = task.build_model(cfg.seed)
    if cfg.optimizer == "adam" and any(getattr(m, "sparse", False) for m in model.modules()):
        raise ConfigError(f"--optimizer adam takes dense gradients; task {task.name}'s "
                          "model has sparse ones: use --optimizer sgd")
    part = padded_partition(len(task.train), world, rank, cfg.seed)
    recorder = None
    if run is not None:
        recorder = StatefulRecorder(cfg, task, model, run,
                                    total_samples=len(part) * world * cfg.epochs, argv=argv,
                                    started_at=started_at)
    model.to(device)
    # what rank 0 resumes (epoch, row, whether it has a training state), told to every rank
    start = torch.zeros(3, dtype=torch.float64)
    if recorder is not None:
        start[:] = torch.tensor(_resumed_start(recorder, len(part), world), dtype=torch.float64)
    start = agree(start.to(device)).cpu().tolist()
    net = wrap(model)  # DDP's constructor copies rank 0's (maybe resumed) parameters everywhere
    precision = Precision(cfg.amp, device.type)
    interrupted = [False]
    loop = SyncLoop(cfg, task, net, precision, part, device, rank=rank, world=world,
                    start=(int(start[0]), int(start[1])), recorder=recorder, agree=agree,
                    interrupted=lambda: interrupted[0] or stop_requested())
    if start[2]:
        _restore_state(loop, recorder.resumed if recorder else None, recorder, agree)
    elif recorder is not None and cfg.resume:
        warn_model_only(recorder.run.checkpoint, _fresh_state(cfg), int(start[0]))
    if recorder is not None:
        recorder.state_fn = loop.state
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
                             **precision.state(), procs=world, lr=loop.opt.lr,
                             batch_size=loop.batch_size, global_batch_size=loop.batch_size * world,
                             pacing=loop.pace(), optimizer=cfg.optimizer, steps=loop.steps,
                             **loop.rank_bytes(), **_staleness(loop.opt), **(extra or {}))


def _resumed_start(recorder: StatefulRecorder, rows: int, world: int) -> list:
    """Rank 0: [epoch, row, 1] from a full checkpoint of as many ranks; [epochs done, 0, 0]
    from a model-only one (or one of another world size, with a warning)."""
    state = recorder.resumed
    if state is None:
        return [recorder.epochs_done, 0, 0]
    procs = state["processes"]
    if len(procs) != world:
        log.warning("%s was saved by %d process(es), this run has %d: their data partitions "
                    "differ, so epoch %d restarts from its first row and the random generators "
                    "are seeded afresh", recorder.run.checkpoint, len(procs), world,
                    recorder.epochs_done + 1)
        for proc in procs:
            proc["rng"] = None
        return [recorder.epochs_done, 0, 1]
    epoch, row = procs[0]["epoch"], procs[0]["row"]
    if row > rows:
        raise recorder.bad_state(f"it resumes at row {row} of an epoch of {rows} rows")
    return [epoch, row, 1]


def _restore_state(loop: SyncLoop, state: Optional[dict], recorder: Optional[StatefulRecorder],
                   agree: Agree) -> None:
    """Every rank: the update rule, gradient scaler and random generators of a full
    checkpoint. Rank 0 (which read it) loads them, then sends them to the others through
    ``agree`` (a sum in which the others put zeros): exact, and no other collective."""
    if recorder is not None:
        try:
            _load_on_rank_0(loop, state)
        except (ValueError, TypeError, KeyError, RuntimeError, AttributeError) as exc:
            raise recorder.bad_state(str(exc).splitlines()[0]) from None
    if loop.world > 1:
        _share(loop, state, agree)


def _load_on_rank_0(loop: SyncLoop, state: dict) -> None:
    saved, current = state.get("optimizer"), loop.opt.state_dict()
    if saved is not None:
        if (saved.get("kind"), saved.get("staleness")) != (current["kind"],
                                                           current.get("staleness")):
            log.warning("the checkpoint's update rule (%s) is not this run's (%s): it starts "
                        "afresh", _rule(saved), _rule(current))
        else:
            loop.opt.load_state_dict(saved)
    scaler = loop.precision.scaler
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rng = state["processes"][0].get("rng")
    if rng is not None:
        size = torch.get_rng_state().numel()
        for proc in state["processes"]:
            if proc.get("rng") is not None and proc["rng"]["torch"].numel() != size:
                raise ValueError(f"a saved torch generator state has "
                                 f"{proc['rng']['torch'].numel()} bytes, this torch's {size}")
        loop.resumed_rng = rng


def _rule(state: dict) -> str:
    staleness = state.get("staleness")
    kind = state.get("inner", {}).get("kind") if state.get("kind") == "delayed" else None
    return f"{kind} delayed {staleness} steps" if kind else str(state.get("kind"))


def _share(loop: SyncLoop, state: Optional[dict], agree: Agree) -> None:
    """DDP: rank 0's (just loaded) update rule, scaler and each rank's generator to the
    ranks they belong to."""
    opt, rank, device = loop.opt, loop.rank, loop.device
    params = opt.params
    head = torch.zeros(3 + len(params), dtype=torch.float64)
    scaler = loop.precision.scaler
    if rank == 0:
        head[0] = getattr(opt, "steps", 0)
        if scaler is not None:
            head[1], head[2] = scaler.get_scale(), scaler.state_dict()["_growth_tracker"]
        for i in opt.buffers:
            head[3 + i] = 1
    head = agree(head.to(device)).cpu().tolist()
    if isinstance(opt, Adam):
        opt.steps = int(head[0])
    if scaler is not None and head[1]:
        scaler.load_state_dict({**scaler.state_dict(), "scale": head[1],
                                "_growth_tracker": int(head[2])})
    for i, p in enumerate(params):
        if not head[3 + i]:
            continue
        mine = opt.buffers[i] if rank == 0 else None
        parts = (mine if isinstance(mine, tuple) else (mine,)) if rank == 0 else tuple(
            torch.zeros_like(p) for _ in range(2 if isinstance(opt, Adam) else 1))
        parts = tuple(agree(t) for t in parts)
        opt.buffers[i] = parts if isinstance(opt, Adam) else parts[0]
    # each rank's generators (torch's, and its GPU's on CUDA), in a row of its own
    mine = rng_state(device)
    n, cut = sum(t.numel() for k, t in mine.items() if k in RANK_RNGS), mine["torch"].numel()
    rows = torch.zeros(loop.world, n + 1, dtype=torch.float64)
    if rank == 0:
        for r, proc in enumerate(state["processes"]):
            saved = proc.get("rng")
            if saved is not None and all(k in saved for k in mine if k in RANK_RNGS):
                row = torch.cat([saved[k] for k in RANK_RNGS if k in mine])
                rows[r, :n], rows[r, n] = row.double(), 1
    rows = agree(rows.to(device)).cpu()
    if rank != 0 and rows[rank, n]:
        row = rows[rank, :n].to(torch.uint8)
        loop.resumed_rng = {"torch": row[:cut], **({"cuda": row[cut:]} if "cuda" in mine
                                                   else {})}


RANK_RNGS = ("torch", "cuda")  # the generators each DDP rank has its own of


def _fresh_state(cfg: SingleConfig) -> list:
    """What a model-only checkpoint leaves out of this run's update rule."""
    fresh = []
    if cfg.optimizer == "adam":
        fresh.append("adam's moments and step count (its bias correction starts over)")
    elif cfg.momentum:
        fresh.append("the momentum buffer")
    if cfg.simulate_staleness:
        fresh.append(f"the --simulate-staleness queue: the {cfg.simulate_staleness} gradients "
                     "in flight at the checkpoint are never applied, and the first "
                     f"{cfg.simulate_staleness} steps after resuming apply nothing, as at a start")
    return fresh


def _staleness(opt) -> dict:
    """summary.json: what --simulate-staleness did (nothing when it was off), counted since
    this process started: after a --resume, since the resume."""
    if not isinstance(opt, Delayed):
        return {}
    return {"simulated_staleness": opt.staleness, "updates_applied": opt.applied,
            "gradients_never_applied": len(opt.in_flight)}

