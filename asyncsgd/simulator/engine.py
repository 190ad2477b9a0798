"""The virtual clock: real gradients and the real update rules, in simulated time.

One process plays every worker. Each gradient is computed for real, on the real model and
the worker's own batches, from the parameters that worker pulled; the parameter server is
the real ``ShardState`` (its consistency, rules and backup workers). Only time is
simulated: steps, transfers and applies take what the ``Costs`` say, and the order of
events, so the staleness each gradient meets, follows from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from asyncsgd.servers.rules import make_rule
from asyncsgd.servers.shard import ShardConfig, ShardState

from ..config import ServerConfig
from ..config.modes import ModeSpec
from ..core.pacing import Pacing
from ..core.signature import PS_PARTITION_SEED
from ..core.tasks import Task, epoch_order, partition_indices
from ..errors import ConfigError, WorkerError
from ..run.recorder import Outcome, Recorder, RunResult
from ..run.rundir import CONFIG, RunDir, _write_json
from ..wire.layout import Layout
from ..wire.protocol import BYE, ERROR, PARAMS, PULL, PUSH, Code, Key, Message, Segment
from ..wire.stats import percentile
from .costs import Costs
from .events import Scheduler

log = logging.getLogger(__name__)

SIMULATED = ("single, hogwild, ps-async, ps-ssp[:K], ps-sync, ps-backup[:B], ddp, diloco[:H] "
             "and async-diloco[:H]")
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


@dataclass
class _Settings:
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


def local_steps(spec: ModeSpec) -> int:
    flags = list(spec.worker_flags)
    return int(flags[flags.index("--local-steps") + 1]) if "--local-steps" in flags else 1


def check_spec(spec: ModeSpec, setup: VirtualSetup) -> None:
    """Refuse what the virtual clock does not model, naming what it does."""
    plain_ddp = spec.command == "ddp" and not spec.flags
    if "+" in spec.name or not (plain_ddp or spec.command in ("single", "hogwild", "ps-server")):
        raise ConfigError(f"the virtual clock does not model {spec.name}; it simulates "
                          f"{SIMULATED}")
    if setup.shards != 1:
        raise ConfigError("the virtual clock simulates one shard; drop --shards")
    if spec.command != "ps-server" and (setup.leave or setup.join):
        raise ConfigError(f"--leave/--join: workers leave and join parameter-server modes "
                          f"only, not {spec.name}")
    if setup.workers < 1:
        raise ConfigError(f"--workers {setup.workers}: at least 1")


class _Worker:
    """One simulated worker: its data, its pace, and where it is in its epochs."""

    def __init__(self, rank: int, part: torch.Tensor, factor: float, seed: int, epochs: int,
                 batch: int):
        self.rank, self.part, self.factor, self.seed = rank, part, factor, seed
        self.name = f"sim-r{rank}"
        self.epochs, self.batch = epochs, batch
        self.epoch, self.pos, self.order = 0, 0, epoch_order(part, seed, rank, 0)
        self.seq, self.gone, self.done = 0, False, False

    def next_batch(self) -> Optional[torch.Tensor]:
        """The next batch's indices, as the real worker takes them; None after its epochs."""
        if self.pos >= len(self.order):
            self.epoch += 1
            if self.epoch >= self.epochs or not len(self.order):
                return None
            self.order, self.pos = epoch_order(self.part, self.seed, self.rank, self.epoch), 0
        index = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return index


class _Engine(ABC):
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
        slow = _slow_ranks(setup.workers, self.costs.slow_share, setup.seed)
        batch = setup.batch_size or task.batch_size
        self.workers = []
        for rank in range(world):
            factor = dict(self.costs.slowdown).get(
                rank, self.costs.slow_factor if rank in slow else 1.0)
            part = partition_indices(len(task.train), world, rank, PS_PARTITION_SEED)
            self.workers.append(_Worker(rank, part, factor, setup.seed, setup.epochs, batch))
        # cumulative samples trained on, and the sum and count of step losses; the train
        # event of each evaluation reports the mean loss since the one before
        self.samples, self.loss_sum, self.loss_steps = 0, 0.0, 0
        self._reported = (0.0, 0)
        self.bytes = 0
        self.work = 0  # events pending besides evaluations: none left, nothing can happen
        self.stopped_by: Optional[str] = None
        self.trace: Optional[list] = None  # a test's list: (what, virtual t, rank) as it happens

    # ---- what every mode shares ------------------------------------------------------

    def at(self, t: float, *what) -> None:
        self.work += 1
        self.sched.at(t, *what)

    def step_time(self, worker: _Worker) -> float:
        seconds = self.costs.step.draw(self.rng) * worker.factor
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
        inputs, targets = self.task.train.rows(index)
        loss = self.task.loss_fn(self.model(*inputs), targets)
        loss.backward()
        return self.grads.clone(), loss.item(), len(targets)

    def trained(self, samples: int, loss: float, steps: int = 1) -> None:
        self.samples += samples
        self.loss_sum, self.loss_steps = self.loss_sum + loss * steps, self.loss_steps + steps

    @abstractmethod
    def params(self) -> torch.Tensor:
        """The parameters an evaluation scores (the server's, or the shared ones)."""

    @abstractmethod
    def start(self) -> None:
        """Set the first events."""

    def evaluate(self, t: float) -> None:
        with torch.no_grad():
            self.flat.copy_(self.params())
        self.rec.now = t
        loss, steps = self.loss_sum - self._reported[0], self.loss_steps - self._reported[1]
        if steps:
            self.rec.train(self.samples, 0, loss / steps, steps, self.epoch())
            self._reported = (self.loss_sum, self.loss_steps)
        self.rec.wire_bytes = self.bytes
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


def _slow_ranks(workers: int, share: float, seed: int) -> set:
    """The ``share`` of ranks that are slow, chosen by the seed (apart from step times)."""
    count = round(share * workers)
    return set(random.Random(f"slow-{seed}").sample(range(workers), count)) if count else set()


class _Alone(_Engine):
    """single and hogwild: workers step the shared parameters, read at each step's start
    and written at its end (Hogwild's races as interleaved applies); no link, no server."""

    def __init__(self, *args):
        super().__init__(*args)
        self.shared = self.flat.detach().clone()
        self.rule = make_rule("sgd", len(self.shared), self.lr)
        self.steps = 0

    def params(self) -> torch.Tensor:
        return self.shared

    def start(self) -> None:
        for w in self.workers[:self.setup.workers]:
            self.on_begin(0.0, w)

    def on_begin(self, t: float, w: _Worker) -> None:
        index = w.next_batch()
        if index is None:
            return
        grad, loss, n = self.gradient(self.shared, index)
        self.at(t + self.step_time(w), "apply", w, grad, loss, n)

    def on_apply(self, t: float, w: _Worker, grad: torch.Tensor, loss: float, n: int) -> None:
        self.rule.apply(self.shared, [(0, grad)])
        self.steps += 1
        self.trained(n, loss)
        self.on_begin(t, w)

    def summary(self) -> dict:
        return {"updates": self.steps}


class _DDP(_Engine):
    """ddp: lock-step rounds; each ends when the slowest rank computed its gradient and
    the ring all-reduce of the gradients is done, then every rank applies their mean."""

    def __init__(self, *args):
        super().__init__(*args)
        self.shared = self.flat.detach().clone()
        self.rule = make_rule("sgd", len(self.shared), self.lr)
        self.rounds = 0

    def params(self) -> torch.Tensor:
        return self.shared

    def start(self) -> None:
        self.on_round(0.0)

    def on_round(self, t: float) -> None:
        ranks = self.workers[:self.setup.workers]
        batches = [w.next_batch() for w in ranks]
        if any(b is None for b in batches):
            return  # a rank's epochs are over: so are everyone's (equal partitions)
        total, losses, samples, slowest = None, 0.0, 0, 0.0
        for w, index in zip(ranks, batches):
            grad, loss, n = self.gradient(self.shared, index)
            total = grad if total is None else total.add_(grad)
            losses, samples = losses + loss * n, samples + n
            slowest = max(slowest, self.step_time(w))
        total.div_(len(ranks))
        allreduce = self.costs.link.ring_allreduce(self.nbytes, len(ranks))
        self.at(t + slowest + allreduce, "applied", total, losses / samples, samples,
                len(ranks))

    def on_applied(self, t: float, mean: torch.Tensor, loss: float, samples: int,
                   ranks: int) -> None:
        if self.trace is not None:
            self.trace.append(("round", t, None))
        self.rule.apply(self.shared, [(0, mean)])
        self.rounds += 1
        n = self.setup.workers
        self.bytes += int(2 * (n - 1) * self.nbytes) if n > 1 else 0
        self.trained(samples, loss, ranks)
        self.on_round(t)

    def summary(self) -> dict:
        return {"updates": self.rounds}


class _PS(_Engine):
    """The parameter-server modes: workers pull, step and push through the real
    ``ShardState``. The server's link is shared: pushes arrive one after another on it,
    and its replies leave one after another; it applies in arrival order."""

    def __init__(self, *args):
        super().__init__(*args)
        server = ServerConfig()
        flags = dict(zip(self.spec.flags[::2], self.spec.flags[1::2]))
        hyper = {"weight_decay": server.weight_decay}
        if self.spec.optimizer in ("momentum", "nesterov", "delayed-nesterov"):
            hyper["momentum"] = float(flags.get("--momentum", server.momentum))
        if self.spec.optimizer == "delayed-nesterov":
            hyper["period"] = self.setup.workers
        self.H = local_steps(self.spec)
        server_lr = float(flags["--lr"]) if "--lr" in flags else self.lr
        self.state = ShardState(ShardConfig(
            index=0, start=0, end=len(self.flat), rule=self.spec.optimizer, lr=server_lr,
            hyper=hyper, consistency=self.spec.consistency or "async",
            expected_workers=self.setup.workers, heartbeat_timeout=float("inf"),
            sync_reduce=server.sync_reduce, backup_workers=self.spec.backup_workers),
            self.flat.detach().clone())
        self.link = self.costs.link
        self.ingress = self.egress = self.server = 0.0  # when each is free again
        self.by_peer = {w.name.encode(): w for w in self.workers}

    def params(self) -> torch.Tensor:
        return self.state.params

    def start(self) -> None:
        for w in self.workers[:self.setup.workers]:
            self.send(0.0, w, Message(type=PULL, worker=w.name, incarnation=1, seq=0), 0)
        for t, rank in self.setup.leave:
            self.at(t, "leave", self.workers[rank])
        for k, (t,) in enumerate(self.setup.join):
            w = self.workers[self.setup.workers + k]
            self.at(t, "join", w)

    def send(self, t: float, w: _Worker, msg: Message, nbytes: int) -> None:
        """``msg`` leaves ``w`` at ``t``; it reaches the server once its bytes have come in
        on the server's link, after those of every push before it."""
        arrive = t + self.link.latency
        if nbytes:
            arrive = max(arrive, self.ingress) + nbytes / self.link.bandwidth
            self.ingress = arrive
            self.bytes += nbytes
        self.at(arrive, "arrive", w, msg, nbytes)

    def on_arrive(self, t: float, w: _Worker, msg: Message, nbytes: int) -> None:
        done = max(t, self.server) + nbytes * self.costs.apply_per_byte
        self.server = done
        self.at(done, "handle", w, msg)

    def on_handle(self, t: float, w: _Worker, msg: Message) -> None:
        if self.trace is not None and msg.type == PUSH:
            self.trace.append(("apply", t, w.rank, self.state.version - msg.clock))
        for peer, reply in self.state.handle(w.name.encode(), msg, t):
            if reply.type == ERROR and reply.meta.get("code") == Code.NON_FINITE:
                raise WorkerError(w.rank, (
                    f"diverged at {t:.4g} virtual s: worker {w.rank}'s gradient held NaN or "
                    f"Inf, which the server refuses, as a real one does (lr "
                    f"{self.lr:g} is too large for {self.setup.workers} workers here: try a "
                    "smaller --lr, or --tune lr)"))
            if reply.type == ERROR:  # anything else would be the simulator's own mistake
                raise RuntimeError(f"the shard refused a simulated {msg.type}: {reply.meta}")
            if reply.type != PARAMS:
                continue
            params = torch.cat([s.data.float() for s in sorted(reply.segments,
                                                                  key=lambda s: s.offset)])
            start = max(t, self.egress)
            self.egress = start + self.nbytes / self.link.bandwidth
            self.bytes += self.nbytes
            self.at(self.egress + self.link.latency, "pulled", self.by_peer[peer], params,
                    reply.meta[Key.VERSION])

    def on_pulled(self, t: float, w: _Worker, params: torch.Tensor, version: int) -> None:
        """New parameters reached ``w``: it computes its next push from them, for real."""
        if w.gone:
            return
        if self.trace is not None:
            self.trace.append(("pulled", t, w.rank))
        if self.H > 1:
            # --local-steps H: H inner SGD steps on its own copy, then the pseudo-gradient
            local, seconds, samples, losses, steps = params.clone(), 0.0, 0, 0.0, 0
            for _ in range(self.H):
                index = w.next_batch()
                if index is None:
                    break
                grad, loss, n = self.gradient(local, index)
                local.add_(grad, alpha=-self.lr)
                seconds, samples = seconds + self.step_time(w), samples + n
                losses, steps = losses + loss, steps + 1
            grad, loss = params.sub_(local), losses / max(1, steps)
        else:
            index = w.next_batch()
            samples = 0
            if index is not None:
                grad, loss, samples = self.gradient(params, index)
                seconds = self.step_time(w)
        del params
        if not samples:
            self.leave(t, w)
            return
        self.at(t + seconds, "push", w, grad, version, loss, samples)

    def on_push(self, t: float, w: _Worker, grad: torch.Tensor, version: int, loss: float,
                samples: int) -> None:
        if w.gone:
            return  # it left while computing: its step is lost
        w.seq += 1
        self.send(t, w, Message(type=PUSH, worker=w.name, incarnation=1, seq=w.seq,
                                clock=version, meta={Key.PULL: True, Key.SAMPLES: samples,
                                                     Key.LOSS: loss},
                                segments=[Segment(0, grad)]), self.nbytes)

    def leave(self, t: float, w: _Worker) -> None:
        if not w.gone:
            w.gone = True
            w.seq += 1
            self.send(t, w, Message(type=BYE, worker=w.name, incarnation=1, seq=w.seq), 0)

    def on_leave(self, t: float, w: _Worker) -> None:
        self.leave(t, w)

    def on_join(self, t: float, w: _Worker) -> None:
        self.send(t, w, Message(type=PULL, worker=w.name, incarnation=1, seq=0), 0)

    def evaluate(self, t: float) -> None:
        """Samples and loss as the shard counted them from the pushes it took (each push
        reports its mean loss), as a real server's evaluator reads them."""
        self.loss_sum, self.loss_steps, self.samples = (
            sum(v[i] for v in self.state.train.values()) + self.state.train_forgotten[i]
            for i in range(3))
        super().evaluate(t)

    def summary(self) -> dict:
        hist = list(self.state.staleness)
        return {"updates": self.state.counters["updates"], "staleness_hist": hist,
                "staleness_p50": percentile(hist, 0.5), "staleness_p99": percentile(hist, 0.99),
                "stale_pushes": self.state.counters["stale"],
                "consistency": str(self.state.cfg.consistency)}


def _engine_of(spec: ModeSpec) -> type:
    return {"single": _Alone, "hogwild": _Alone, "ddp": _DDP, "ps-server": _PS}[spec.command]


def _record(task: Task, spec: ModeSpec, setup: VirtualSetup) -> dict:
    costs = setup.costs
    return {"task": task.name, "mode_name": spec.name, "clock": "virtual",
            "workers": setup.workers, "seed": setup.seed, "lr": setup.lr or task.lr,
            "batch_size": setup.batch_size or task.batch_size, "epochs": setup.epochs,
            "eval_every": setup.eval_every, "max_seconds": setup.max_seconds,
            "target": setup.target, "stop_at_target": setup.stop_at_target,
            "consistency": spec.consistency, "backup_workers": spec.backup_workers,
            "optimizer": spec.optimizer, "local_steps": local_steps(spec),
            "leave": [list(x) for x in setup.leave], "join": [list(x) for x in setup.join],
            "costs": {**dataclasses.asdict(costs), "gradient_bytes": costs.gradient_bytes}}


def simulate_run(task: Task, spec: ModeSpec, setup: VirtualSetup, out: Optional[str] = None,
                 progress: str = "auto", argv: Optional[list] = None) -> RunResult:
    """Run ``spec`` on the virtual clock into a run directory (``out``, or runs/<time>-<mode>)
    written as real runs write theirs, with ``t`` in virtual seconds and clock "virtual"."""
    with one_thread():
        return finish(prepare(task, spec, setup, out, progress, argv))


@contextlib.contextmanager
def one_thread():
    """Torch on one thread while simulating: the same seed gives the same sums, bit for bit,
    and a small model's steps run faster than on two (experiments/README.md, "Worker
    threads")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prepare(task: Task, spec: ModeSpec, setup: VirtualSetup, out: Optional[str] = None,
            progress: str = "auto", argv: Optional[list] = None) -> _Engine:
    """The engine of one run, its run directory written and its first events not yet set."""
    check_spec(spec, setup)
    for _, rank in setup.leave:
        if not 0 <= rank < setup.workers:
            raise ConfigError(f"--leave names rank {rank}; ranks are 0..{setup.workers - 1}")
    if spec.command == "single":  # one process, however many workers the others have
        setup = dataclasses.replace(setup, workers=1)
    mode = "ps" if spec.command == "ps-server" else spec.command
    model = task.build_model(0)
    layout = Layout.of(model)
    flat, grads = torch.zeros(layout.total), torch.zeros(layout.total)
    layout.bind(model, flat, grads)  # copies the initial parameters in
    run = RunDir.create(out, mode)
    settings = _Settings(mode, setup.target, setup.max_seconds, setup.eval_every, progress,
                         _record(task, spec, setup))
    world = setup.workers + len(setup.join)
    total = len(task.train) // world * world * setup.epochs if setup.epochs < 10 ** 5 else None
    rec = VirtualRecorder(settings, task, model, run, total_samples=total, argv=argv)
    _write_json(run.path / CONFIG, {**run.read_config(), "clock": "virtual"})
    return _engine_of(spec)(task, spec, setup, rec, model, layout, flat, grads)


def finish(engine: _Engine, played: bool = False,
           error: Optional[WorkerError] = None) -> RunResult:
    """Play the run to its end (unless ``played``: a race did, and ``error`` is what
    failed it there) and write its summary; a failure is raised once it is written."""
    outcome = Outcome(stopped_by="epochs")
    if error is not None:
        engine.end()
        outcome.failed(error)
    else:
        with outcome.watch():
            outcome.stopped_by = engine.end() if played else engine.run()
    rec = engine.rec
    return rec.conclude(engine.samples, engine.epoch(), outcome,
                        rate=engine.samples / max(rec.now, 1e-12), clock="virtual",
                        workers=len(engine.workers), bytes=engine.bytes, **engine.summary())
