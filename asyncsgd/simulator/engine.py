"""The virtual clock's engine: the event loop, the workers' data and pace, and what every
mode shares (real gradients, evaluations into a run directory on virtual time)."""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import parse_local_steps
from ..config.modes import DYNAMIC, ModeSpec
from ..core import coverage
from ..core.pacing import Pacing
from ..core.signature import PS_PARTITION_SEED
from ..core.tasks import Task, epoch_order, partition_indices
from ..errors import ConfigError
from ..modes.gradients import accumulate, clipper
from ..run.recorder import Recorder
from ..wire.layout import Layout
from .costs import Costs
from .events import Scheduler


SIMULATED = ("single, hogwild, ps-async, ps-dc-asgd, ps-ssp[:K], ps-sync, "
             "ps-backup[:B|:auto], ps-sync+balance, ps-backup[:B]+balance, "
             "ddp, ddp+balance, diloco[:H|:auto[:H]] and async-diloco[:H|:auto[:H]] (a "
             "parameter-server mode also +dynamic)")
BALANCED = ("--balance", "batch")  # ddp+balance's flags
FLOAT_BYTES = 4


@dataclass(frozen=True)
class VirtualSetup:
    """One simulated run: how many workers, which seed, what things cost, when it stops."""

    workers: int
    seed: int
    costs: Costs
    lr: Optional[float] = None  # None: the task's (diloco: the workers' inner lr)
    target: Optional[float] = None
    max_seconds: float = 0  # the virtual budget; 0: none
    epochs: int = 1
    eval_every: float = 1.0  # virtual seconds
    batch_size: Optional[int] = None
    stop_at_target: bool = False
    shards: int = 1
    leave: tuple = ()  # (virtual t, rank): that worker leaves
    join: tuple = ()  # (virtual t,): a new worker joins
    record_digests: bool = False  # parameter-server modes: digests.jsonl in the run directory
    lr_schedule: str = "constant"  # --lr-schedule, over each mode's updates (core.schedule)
    warmup: str = "0"
    clip_grad_norm: Optional[float] = None  # each gradient's total 2-norm bound
    accumulate: int = 1  # micro-batches a gradient is the mean of


@dataclass
class RunSettings:
    """What the Recorder reads of a run's settings, and config.json's ``config``."""

    mode: str
    target: Optional[float]
    max_seconds: float
    eval_every: float
    progress: str
    record: dict
    resume: Optional[str] = None
    tensorboard: bool = False
    checkpoint_every: float = 0.0

    def to_dict(self) -> dict:
        return self.record


class VirtualRecorder(Recorder):
    """A Recorder whose clock is the simulation's: ``now`` virtual seconds."""

    def __init__(self, *args, **kw):
        self.now = 0.0
        super().__init__(*args, **kw)

    def _start_clock(self, started_at: Optional[float]) -> tuple:
        return "virtual", 0.0

    def elapsed(self) -> float:
        return self.now


def local_steps(spec: ModeSpec):
    """The mode's --local-steps: H (an int), or DyLU's ``auto:H`` (its text)."""
    flags = list(spec.worker_flags)
    if "--local-steps" not in flags:
        return 1
    auto, steps = parse_local_steps(flags[flags.index("--local-steps") + 1])
    return f"auto:{steps}" if auto else steps


def wire_suffix(spec: ModeSpec) -> bool:
    """Whether the mode name carries a suffix with no cost model here (+int8, +fp16, a comm
    hook...): +balance and +dynamic change no traffic, so they are modelled."""
    balanced = spec.name.endswith("+balance") and spec.command in ("ddp", "ps-server")
    dynamic = spec.command == "ps-server" and spec.name.endswith(DYNAMIC)
    base = spec.name[:-len(DYNAMIC)] if dynamic else spec.name
    return "+" in base and not balanced


def check_spec(spec: ModeSpec, setup: VirtualSetup) -> None:
    """Refuse what the virtual clock does not model, naming what it does."""
    plain_ddp = spec.command == "ddp" and spec.flags in ((), BALANCED)
    if wire_suffix(spec) or not (plain_ddp or spec.command in (
            "single", "hogwild", "ps-server")):
        raise ConfigError(f"the virtual clock does not model {spec.name}; it simulates "
                          f"{SIMULATED}")
    if setup.shards != 1:
        raise ConfigError("the virtual clock simulates one shard; drop --shards")
    if spec.command != "ps-server" and (setup.leave or setup.join):
        raise ConfigError(f"--leave/--join: workers leave and join parameter-server modes "
                          f"only, not {spec.name}")
    if setup.workers < 1:
        raise ConfigError(f"--workers {setup.workers}: at least 1")
    if setup.accumulate > 1 and "--balance" in spec.flags:
        raise ConfigError(f"--accumulate with {spec.name}: balancing sizes each worker's whole "
                          "step to its speed; drop one of them")


class SimWorker:
    """One simulated worker: its data, its pace, and where it is in its epochs."""

    def __init__(self, rank: int, part: torch.Tensor, factor: float, seed: int, epochs: int,
                 batch: int):
        self.rank, self.part, self.factor, self.seed = rank, part, factor, seed
        self.name = f"sim-r{rank}"
        self.epochs, self.batch = epochs, batch
        self.epoch, self.pos, self.order = 0, 0, epoch_order(part, seed, rank, 0)
        self.seq, self.gone, self.done = 0, False, False
        self.taken = 0  # samples of its partition it has computed on
        self.plan: Optional[list] = None  # --data-dispatch dynamic: the rows shard 0 handed

    def follow(self, plan: list) -> None:
        """Dynamic dispatch: train ``plan``'s rows next (from shard 0's reply)."""
        self.plan = plan

    def next_batch(self) -> Optional[torch.Tensor]:
        """The next batch's indices, as the real worker takes them; None after its epochs."""
        if self.plan is not None:
            index = torch.cat(self.plan)[:self.batch] if self.plan else self.part[:0]
            self.plan = _after(self.plan, len(index))
            return index if len(index) else None
        if self.pos >= len(self.order):
            self.epoch += 1
            if self.epoch >= self.epochs or not len(self.order):
                return None
            self.order, self.pos = epoch_order(self.part, self.seed, self.rank, self.epoch), 0
        index = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        self.taken += len(index)
        return index


class Engine(ABC):
    """The event loop of one run, and what every mode shares: gradients, pace, evaluations."""

    def __init__(self, task: Task, spec: ModeSpec, setup: VirtualSetup, rec: VirtualRecorder,
                 model: torch.nn.Module, layout: Layout, flat: torch.Tensor,
                 grads: torch.Tensor):
        self.task, self.spec, self.setup, self.rec = task, spec, setup, rec
        self.model, self.flat, self.grads = model, flat, grads
        self.costs = setup.costs
        self.nbytes = self.costs.gradient_bytes or FLOAT_BYTES * layout.total
        self.lr = setup.lr or task.lr
        self.sched = Scheduler()
        self.rng = random.Random(setup.seed)  # step times and delays, in event order
        self.pacing = Pacing.parse(None, self.costs.delay)
        world = setup.workers + len(setup.join)
        slow = slow_ranks(setup.workers, self.costs.slow_share, setup.seed)
        batch = setup.batch_size or task.batch_size
        speeds = worker_speeds(world, self.costs.speed_sigma, setup.seed)
        self.workers = []
        for rank in range(world):
            factor = speeds[rank] * dict(self.costs.slowdown).get(
                rank, self.costs.slow_factor if rank in slow else 1.0)
            part = partition_indices(len(task.train), world, rank, PS_PARTITION_SEED)
            self.workers.append(SimWorker(rank, part, factor, setup.seed, setup.epochs,
                                          batch * setup.accumulate))
        self.clip = clipper(setup.clip_grad_norm)
        # cumulative samples trained on, and the sum and count of step losses; the train
        # event of each evaluation reports the mean loss since the one before
        self.samples, self.loss_sum, self.loss_steps = 0, 0.0, 0
        # the times each row's gradient was computed (a step in flight at the stop included);
        # coverage reads it where the workers share one order of the rows (``global_rows``:
        # balanced batches, rows on demand)
        self.row_counts = torch.zeros(len(task.train), dtype=torch.int64)
        self.global_rows = False
        self._reported = (0.0, 0)
        self.bytes = 0
        self.work = 0  # events pending besides evaluations: none left, nothing can happen
        self.stopped_by: Optional[str] = None
        self.trace: Optional[list] = None  # a test's list: (what, virtual t, rank) as it happens

    # ---- what every mode shares ------------------------------------------------------

    def at(self, t: float, *what) -> None:
        self.work += 1
        self.sched.at(t, *what)

    def step_time(self, worker: SimWorker, samples: Optional[int] = None) -> float:
        """A step's seconds: drawn, times the worker's slowdown, plus its delay. ``samples``:
        a batch of that many instead of the worker's own, its compute scaled per sample."""
        # the profile timed one micro-batch: a step computes --accumulate of them
        seconds = self.costs.step.draw(self.rng) * worker.factor * self.setup.accumulate
        if samples is not None:
            seconds *= samples / worker.batch
        if self.pacing.delays(worker.rank):
            mean = self.pacing.delay_mean
            seconds += mean if self.pacing.delay_kind == "const" else self.rng.expovariate(
                1 / mean)
        return seconds

    def gradient(self, params: torch.Tensor, index: torch.Tensor) -> tuple:
        """(gradient, loss, samples) of the batch ``index`` at ``params``, computed for real."""
        with torch.no_grad():
            self.flat.copy_(params)
        self.grads.zero_()
        loss = accumulate(index, self.setup.accumulate, self._loss, torch.Tensor.backward)
        if self.clip is not None:
            self.clip(self.model.parameters())
        self.row_counts.index_add_(0, index, torch.ones_like(index))
        return self.grads.clone(), loss.item(), len(index)

    def _loss(self, index: torch.Tensor) -> torch.Tensor:
        inputs, targets = self.task.train.rows(index)
        return self.task.loss_fn(self.model(*inputs), targets)

    def trained(self, samples: int, loss: float, steps: int = 1) -> None:
        self.samples += samples
        self.loss_sum, self.loss_steps = self.loss_sum + loss * steps, self.loss_steps + steps

    @abstractmethod
    def params(self) -> torch.Tensor:
        """The parameters an evaluation scores (the server's, or the shared ones)."""

    @abstractmethod
    def start(self) -> None:
        """Set the first events."""

    @abstractmethod
    def lr_in_force(self) -> float:
        """The lr of the latest update (before any: the first's), for the eval records."""

    def evaluate(self, t: float) -> None:
        with torch.no_grad():
            self.flat.copy_(self.params())
        self.rec.now = t
        loss, steps = self.loss_sum - self._reported[0], self.loss_steps - self._reported[1]
        if steps:
            self.rec.train(self.samples, 0, loss / steps, steps, self.epoch())
            self._reported = (self.loss_sum, self.loss_steps)
        self.rec.wire_bytes = self.bytes
        self.rec.lr = self.lr_in_force()
        self.rec.evaluate(self.samples)
        self.rec.show(self.samples, self.samples / max(t, 1e-12))
        if self.setup.stop_at_target and self.rec.target_reached():
            self.stopped_by = "target"

    def epoch(self) -> int:
        return min(w.epoch for w in self.workers)

    def begin(self) -> None:
        """Set the first events: the workers', the evaluations', the budget's."""
        self.start()
        self.sched.at(0.0, "eval")
        if self.setup.max_seconds:
            self.sched.at(self.setup.max_seconds, "budget")

    def advance(self, until: float = math.inf) -> Optional[str]:
        """Play the events up to virtual time ``until``: what stopped the run (the target,
        the budget, the last step), or None while it goes on."""
        while self.stopped_by is None and len(self.sched) and self.sched.next_time() <= until:
            t, kind, *args = self.sched.pop()
            if kind == "eval":
                self.evaluate(t)
                if self.work:
                    self.sched.at(t + self.setup.eval_every, "eval")
                else:
                    self.stopped_by = "epochs"
            elif kind == "budget":
                self.stopped_by = "max_seconds"
            else:
                self.work -= 1
                getattr(self, "on_" + kind)(t, *args)
        if self.stopped_by is None and not len(self.sched):
            self.stopped_by = "epochs"
        return self.stopped_by

    def stop_at(self, t: float) -> None:
        """End the run at virtual time ``t`` (a tuning race another candidate won)."""
        self.sched.at(max(t, self.sched.now), "budget")

    def end(self) -> str:
        """The parameters where an evaluation reads them, and what stopped the run."""
        self.rec.now = self.sched.now
        with torch.no_grad():
            self.flat.copy_(self.params())
        return self.stopped_by or "epochs"

    def run(self) -> str:
        """Play events until the target, the budget or the last step: what stopped it."""
        self.begin()
        self.advance()
        return self.end()

    def summary(self) -> dict:
        return {}

    def coverage(self) -> dict:
        """How evenly the rows were trained (core.coverage): each row's count where the
        workers take rows from one global order, else their fixed partitions' shares."""
        if self.global_rows:
            return coverage.of_samples(self.row_counts)
        return coverage.of_partitions([w.taken for w in self.workers],
                                      [len(w.part) for w in self.workers])


def worker_speeds(workers: int, sigma: float, seed: int) -> list:
    """Each worker's step-time factor under --worker-speeds lognormal:SIGMA, drawn once by
    the seed (apart from step times and the slow ranks); all 1 when sigma is 0."""
    rng = random.Random(f"speeds-{seed}")
    return [rng.lognormvariate(0.0, sigma) if sigma else 1.0 for _ in range(workers)]


def _after(plan: list, rows: int) -> list:
    """``plan`` (row tensors, in order) without its first ``rows`` rows."""
    while plan and rows >= len(plan[0]):
        rows -= len(plan[0])
        plan = plan[1:]
    return [plan[0][rows:]] + plan[1:] if plan else []


def slow_ranks(workers: int, share: float, seed: int) -> set:
    """The ``share`` of ranks that are slow, chosen by the seed (apart from step times)."""
    count = round(share * workers)
    return set(random.Random(f"slow-{seed}").sample(range(workers), count)) if count else set()


