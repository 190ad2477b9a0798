"""``asyncsgd worker``: pulls parameters, computes gradients on its partition, pushes them.

    asyncsgd worker --server tcp://HOST:5555 --task mnist1d-cnn --rank 0 --world 2

The model's parameters and gradients are views of two flat buffers (``wire.layout``), so a
pull writes straight into the model and a push gathers nothing: no step allocates a
parameter-sized tensor.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from asyncsgd.config import DEFAULT_EPOCHS, NO_EPOCH_LIMIT, WorkerConfig, parse_local_steps
from asyncsgd.core.balance import global_order, global_slice
from asyncsgd.core.dispatch import epoch_rows
from asyncsgd.core.pacing import Pacer, Pacing, pace_note
from asyncsgd.core.signature import PS_PARTITION_SEED, data_signature
from asyncsgd.core.tasks import epoch_order, partition_indices, task_of
from asyncsgd.errors import ConfigError
from asyncsgd.modes.gradients import accumulate, clipper
from asyncsgd.modes.optim import SGD
from asyncsgd.modes.precision import Precision, check_amp
from asyncsgd.run.lifetime import command_started_at
from asyncsgd.run.namespaces import in_staged_host
from asyncsgd.run.process_group import available_cores
from asyncsgd.run.progress import Progress
from asyncsgd.run.signals import sigterm_as_interrupt
from asyncsgd.wire.compression import Compressor
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.memory import keep_freed_memory
from asyncsgd.wire.protocol import Key
from asyncsgd.wire.security import ClientKeys
from asyncsgd.wire.transport import is_local, parse_endpoint

from .client import PSClient, ServerFinished, ServerUnavailable
from .meta_tables import build_without_tables
from .tables import BatchTables, LocalRows, check_ids

log = logging.getLogger(__name__)
# --data-dispatch dynamic: seconds between asks for rows while others still hold the last
DATA_WAIT = 0.1


@dataclass
class WorkerResult:
    worker: str
    steps: int
    pushes: int
    samples: int
    seconds: float
    stats: dict


def rank_and_world(cfg: WorkerConfig, env: Optional[dict] = None) -> tuple:
    """From flags, else torchrun's RANK/WORLD_SIZE, else Slurm's SLURM_PROCID/SLURM_NTASKS."""
    env = os.environ if env is None else env

    def from_env(*names) -> Optional[int]:
        for name in names:
            if env.get(name, "").strip():
                try:
                    return int(env[name])
                except ValueError:
                    raise ConfigError(f"${name}={env[name]!r} is not an integer") from None
        return None

    rank = cfg.rank if cfg.rank is not None else from_env("RANK", "SLURM_PROCID")
    world = cfg.world if cfg.world is not None else from_env("WORLD_SIZE", "SLURM_NTASKS")
    rank, world = rank or 0, world or 1
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside 0..{world - 1} (world {world}); "
                          "set --rank and --world consistently")
    return rank, world


def _launcher_local_workers() -> int:
    """Workers on this host as torchrun or Slurm says; 0 when neither does."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "").split("(")[0]
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 0


def local_processes(cfg: WorkerConfig, world: int, server_local: bool, shards: int,
                    staged: bool = False) -> tuple:
    """(workers, shards) of the server's on this host: what shares its cores. Started by
    hand beside a local server, all --world workers are likely here; so they are on a host
    ``staged`` in a network namespace (``asyncsgd hosts up``), where the server's address is
    not this namespace's but every staged host shares this machine's cores."""
    together = server_local or staged
    workers = cfg.local_workers or _launcher_local_workers() or (world if together else 1)
    return workers, shards if together else 0


def set_threads(cfg: WorkerConfig, world: int, server_local: bool, shards: int) -> int:
    """Torch threads of this worker: --threads, or cores // the server's processes here.

    A thread per core each is many times slower (experiments/README.md, "Worker threads")."""
    workers, local_shards = local_processes(cfg, world, server_local, shards, in_staged_host())
    cores = available_cores()
    fair = max(1, cores // (workers + local_shards))
    threads = cfg.threads or fair
    if threads > fair:  # more workers than cores, one thread each, is the least it can do
        log.warning("%d torch thread(s) x %d worker(s) on this host exceed its %d core(s)%s: "
                    "steps slow down many-fold; use --threads %d (or --local-workers N if "
                    "fewer workers run here)", threads, workers, cores,
                    f" (and {local_shards} shard(s) run here)" if local_shards else "", fair)
    torch.set_num_threads(threads)
    log.info("worker: %d torch thread(s); %d worker(s) and %d shard(s) on this host, %d core(s)",
             threads, workers, local_shards, cores)
    return threads


def run_worker(cfg: WorkerConfig, seen: Optional[list] = None,
               on_exit: Optional[Callable[[list], None]] = None) -> WorkerResult:
    """Train until the epochs end, the budget is spent or the server ends training.

    A launcher that restarts workers (``asyncsgd.jobs``) hands over what the previous
    incarnation saw: ``on_exit(versions)`` gets the shard versions this worker last saw
    when it ends (also when stopped), and ``seen`` gives them to the next incarnation, so
    a shard restored from an older checkpoint counts the updates it lost, as it does for a
    worker that outlives a server restart."""
    parse_endpoint(cfg.server, "--server")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    rank, world = rank_and_world(cfg)
    if cfg.compress.kind != "none" and cfg.push_dtype != "float32":
        raise ConfigError(f"--compress {cfg.compress} and --push-dtype {cfg.push_dtype}: choose "
                          "one (int8 and top-k values have formats of their own)")
    if cfg.transport == "shared" and (cfg.compress != "none" or cfg.push_dtype != "float32"
                                      or cfg.pull_dtype != "float32"):
        raise ConfigError("--transport shared moves float32 through memory: compressed "
                          "pushes or pulls (--compress, --push-dtype, --pull-dtype) need "
                          "--transport tcp or auto")
    check_amp(cfg.amp, cfg.device)
    if cfg.accumulate > 1 and cfg.push_every > 1:
        raise ConfigError(f"--accumulate {cfg.accumulate} and --push-every {cfg.push_every}: "
                          "choose one (--accumulate pushes the mean gradient of K micro-batches, "
                          "--push-every the sum of N gradients with local steps between)")
    auto, steps = parse_local_steps(cfg.local_steps)
    if (auto or steps > 1) and cfg.push_every > 1:
        raise ConfigError(f"--local-steps {cfg.local_steps} and --push-every {cfg.push_every}: "
                          "choose one (--local-steps pushes the change of the parameters, "
                          "--push-every the sum of the gradients)")
    pacing = Pacing.parse(cfg.slowdown, cfg.delay)
    pacing.check_ranks(world, "--world")
    keys = ClientKeys.load(cfg.curve_server_key, cfg.curve_secret)
    keep_freed_memory()
    # Built as the server builds it (the same --seed reaches a task function that takes
    # one); the hello's data signature lets the server refuse a worker whose data differ.
    task = task_of(cfg)
    model = build_without_tables(task, cfg.embeddings)  # the tables, never used: on meta
    layout = Layout.of(model, task.served_tables(model, cfg.embeddings))
    tables = None
    if layout.tables:
        check_tables(cfg, auto or steps > 1)
        tables = BatchTables(model, layout)  # frees the tables: the worker holds batches' rows
    client = PSClient(cfg.server, f"{socket.gethostname()}-r{rank}", layout.signature(),
                      rank=rank, world=world, heartbeat=cfg.heartbeat,
                      server_timeout=cfg.server_timeout, curve=keys, transport=cfg.transport,
                      data=data_signature(task, cfg.task, cfg.seed, PS_PARTITION_SEED),
                      compressor=Compressor(cfg.compress.kind, cfg.compress.ratio, cfg.push_dtype),
                      pull_dtype=cfg.pull_dtype, busy_poll_us=cfg.busy_poll_us,
                      audit_dir=cfg.audit_dir)
    if seen and len(seen) == len(client.versions):
        client.versions = [int(v) for v in seen]
    set_threads(cfg, world, is_local(client.host), len(client.shards))
    part = partition_indices(len(task.train), world, rank, PS_PARTITION_SEED)
    loop = _Loop(cfg, task, model, layout, client, part, rank, pacing, tables)
    if pacing.active:
        log.info("worker %d: stragglers: %s", rank, pacing.describe())
    try:
        with sigterm_as_interrupt():
            return loop.run()
    except ServerFinished:
        log.info("the server ended training")
        return loop.result(ended_by_server=True)
    except ServerUnavailable:
        raise  # no one left to tell
    except BaseException:
        # Stopped (Ctrl-C, SIGTERM) or failed (a reply it refused, an error of its own): say
        # goodbye, so that barriers drop this worker now rather than after the server's
        # heartbeat timeout, and a stopping shard does not wait 8 s to tell it the run is
        # over. Best effort: what ended it is what is reported.
        with sigterm_as_interrupt(), contextlib.suppress(Exception):
            client.bye(interrupted=True)
        raise
    finally:
        loop.progress.close()
        if on_exit is not None:
            on_exit(list(client.versions))
        client.close()


def check_tables(cfg: WorkerConfig, local_steps: bool) -> None:
    """Refuse, in one line each, what a worker cannot do with tables served row by row."""
    fix = "or serve the tables whole with --embeddings dense (server and workers)"
    if cfg.push_every > 1:
        raise ConfigError("--push-every sums gradients over local steps on parameters this "
                          "worker holds, but it holds only each batch's rows of the task's "
                          f"embedding tables: use --local-steps H instead, {fix}")
    if local_steps and (cfg.inner_optimizer != "sgd" or cfg.inner_weight_decay):
        raise ConfigError(f"--local-steps with tables served by row steps the rows it pulled "
                          f"with plain SGD, which keeps no state per row: use --inner-optimizer "
                          f"sgd without --inner-weight-decay (given {cfg.inner_optimizer}, "
                          f"{cfg.inner_weight_decay}), {fix}")
    if cfg.amp == "fp16":
        raise ConfigError(f"--amp fp16 scales gradients the tables' rows are pushed without "
                          f"(their local weights change every step): use --amp bf16, {fix}")
    if cfg.transport == "shared":
        raise ConfigError("--transport shared: the tables' rows travel in frames, not in a "
                          f"shared area; use --transport tcp or auto, {fix}")


class _Loop:
    """The training loop of one worker and its counters."""

    def __init__(self, cfg: WorkerConfig, task, model, layout: Layout, client: PSClient,
                 part: torch.Tensor, rank: int, pacing: Pacing,
                 tables: Optional[BatchTables] = None):
        self.cfg, self.task, self.model, self.layout, self.client = cfg, task, model, layout, client
        self.part, self.rank = part, rank
        # Tables served row by row: each step computes on the rows of its batch, pulled with
        # the previous push (``ahead``: the next batch's rows index, ids and rows) or, when
        # the next batch is not known then (--balance batch, --data-dispatch dynamic), by a
        # pull of their own before the step
        self.tables = tables
        self.ahead: Optional[tuple] = None
        self._upcoming: Optional[Callable[[], Optional[torch.Tensor]]] = None
        # With --local-steps: the rows of the next H batches' ids (``_window``), pulled with
        # the push before them and stepped in place here until the next push
        self._window: Optional[Callable[[int], Optional[torch.Tensor]]] = None
        self.local_rows: Optional[LocalRows] = None
        self.device = torch.device(cfg.device)
        self.pacer = Pacer(pacing, rank, cfg.seed,
                           torch.cuda.synchronize if self.device.type == "cuda" else None)
        # The flat buffers the client pushes from and pulls into. On a GPU the model's
        # parameters and gradients are views of one flat buffer each there, and these are
        # pinned: a step moves each across with one copy at the bus's full speed (see
        # experiments/gpu_copies.py) instead of one pageable copy per tensor.
        on_gpu = self.device.type == "cuda"
        self.flat_params = torch.zeros(layout.total, pin_memory=on_gpu)
        self.flat_grads = torch.zeros(layout.total, pin_memory=on_gpu)
        model.to(self.device)
        self.gpu_params = self.gpu_grads = None
        if on_gpu:
            self.gpu_params = torch.zeros(layout.total, device=self.device)
            self.gpu_grads = torch.zeros(layout.total, device=self.device)
            layout.bind(model, self.gpu_params, self.gpu_grads)
        else:
            layout.bind(model, self.flat_params, self.flat_grads)
        self.accum = torch.zeros(layout.total) if cfg.push_every > 1 else None
        self.local_lr = cfg.local_lr or task.lr
        # --local-steps H, or auto:H (DyLU): then H is what shard 0 last set, from its next
        # push on; until shard 0 has measured this worker, the fastest's H
        self.auto, self.fastest = parse_local_steps(cfg.local_steps)
        self.H = self.fastest
        self.local_done = 0  # local steps since the last push
        # --local-steps: the inner optimizer steps the flat parameters themselves, and
        # ``anchor`` keeps the pulled ones (the pseudo-gradient is computed into it)
        self.inner = (inner_optimizer(cfg.inner_optimizer, self.flat_params, self.flat_grads,
                                      self.local_lr, cfg.inner_weight_decay)
                      if self.auto or self.H > 1 else None)
        self.anchor = torch.zeros(layout.total) if self.inner is not None else None
        self.batch_size = cfg.batch_size or task.batch_size
        self.step_rows = self.batch_size * cfg.accumulate  # --accumulate's micro-batches
        self.precision = Precision(cfg.amp, self.device.type)
        # fp16's scaler unscales an optimizer's gradients: this one is never stepped (ours,
        # not torch.optim's, whose first use costs a process seconds importing torch._dynamo)
        self.unscaler = (SGD(model.parameters(), lr=1.0)
                         if self.precision.scaler is not None else None)
        self.clip = clipper(cfg.clip_grad_norm)
        self.overflows = 0  # fp16 steps dropped, their gradients not finite
        self.steps = self.pushes = self.samples = 0
        # Where it is in its batches (across epochs). Under sync it follows the rounds: a
        # server restored from an older checkpoint sends it back to the batch of the round
        # it resumes at, so the run repeats the uninterrupted one (``_follow_rounds``).
        self.position = 0
        self.joined_at: Optional[int] = None  # the round of its first pull
        self.loss_sum, self.loss_steps, self.unpushed = 0.0, 0, 0
        self.computed = 0.0  # seconds the steps since the last push took (the audit's goodput)
        self.reported = (0, 0)  # the client's bytes sent and received at the last push
        self.started = time.monotonic()
        # --max-seconds from the command's start (run.lifetime), as a Recorder counts it;
        # the progress clock runs from here, so its budget began that much earlier
        self._budget_from = command_started_at() or self.started
        self.epochs = cfg.epochs  # None: the server's, told in its welcome (``run``)
        self.progress = Progress(f"worker {rank}", self._samples_in_epochs(), cfg.progress,
                                 seconds=cfg.max_seconds,
                                 since=self._budget_from - self.started)

    def _samples_in_epochs(self) -> Optional[int]:
        """The progress's total: this worker's epochs of rows (None: no limit, or unknown
        until the server's welcome)."""
        limited = self.epochs is not None and self.epochs < NO_EPOCH_LIMIT
        return len(self.part) * self.epochs if limited else None

    def run(self) -> WorkerResult:
        self.client.push_pull(None, self.flat_params)
        if self.epochs is None:
            self.epochs = int(self.client.info.get(Key.EPOCHS) or DEFAULT_EPOCHS)
            self.progress.total = self._samples_in_epochs()
        self._pulled()
        if self.client.batch is not None:
            return self._run_balanced()
        if self.client.plan is not None:
            return self._run_dispatched()
        per_epoch = -(-len(self.part) // self.step_rows)
        self._order = (None, None)  # the batches of epoch ``ordered``: (ordered, order)
        last = per_epoch * self.epochs

        def window(start: int) -> Optional[torch.Tensor]:
            """The rows of the batches a push at ``start`` covers: one, or H with local
            steps (fewer at the end); None past the last."""
            batches = [self._batch_at(p, per_epoch)
                       for p in range(start, min(last, start + max(1, self.H)))]
            return torch.cat(batches) if batches else None

        # the next batches, known before this one is pushed: their rows come with the push
        self._window = window
        self._upcoming = lambda: window(self.position)
        while self.position < last:
            if self.out_of_time():
                return self._finish()
            index = self._batch_at(self.position, per_epoch)
            self.position += 1
            self._step(index)
        return self._finish()

    def _batch_at(self, position: int, per_epoch: int) -> torch.Tensor:
        """The rows of the batch at ``position`` (epoch by epoch, each in its own order)."""
        epoch, batch = divmod(position, per_epoch)
        if self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.part, self.cfg.seed, self.rank, epoch))
        return self._order[1][batch * self.step_rows:(batch + 1) * self.step_rows]

    def _run_balanced(self) -> WorkerResult:
        """--balance batch on the server: each step's rows are this worker's slice of the
        global batch of the round it pulled (shard 0's version), cut from one permutation
        of all training rows per epoch that every worker draws alike."""
        if self.auto or self.H > 1 or self.cfg.push_every > 1:
            raise ConfigError("the server balances batches (--balance batch): each push is one "
                              "batch's gradient, so drop --local-steps and --push-every")
        rows = len(self.task.train)
        order, ordered = None, None
        while True:
            size, offset, total = self.client.batch
            epoch, start, end = global_slice(self.client.versions[0], rows, total, offset, size)
            if epoch >= self.epochs:
                return self._finish()
            if ordered != epoch:
                order, ordered = global_order(rows, epoch), epoch
            if self.out_of_time():
                return self._finish()
            self._step(order[start:end])

    def _run_dispatched(self) -> WorkerResult:
        """The server's --data-dispatch dynamic: train the rows shard 0 hands out, in its
        order, until it hands none (or this worker's --epochs are done)."""
        self._orders: dict = {}
        waits = str(self.client.info.get(Key.CONSISTENCY, "")) != "sync"
        while not self.out_of_time():
            index = self._handed()
            if index is not None:
                self._step(index)
                continue
            if self.unpushed:  # what it trained since its last push is not yet counted
                self._push()
            elif self.client.plan[2] or not waits:
                break
            else:  # others still hold rows: a worker that dies hands its rest to this one
                time.sleep(DATA_WAIT)
                self.client.push_pull(None, self.flat_params)
                self._pulled()
        return self._finish()

    def _handed(self) -> Optional[torch.Tensor]:
        """The next batch off the plan shard 0 sent (it may span two chunks), taken off
        it; each reply replaces the plan with what shard 0 counts left."""
        seed, chunks, _ = self.client.plan
        rows, taken = [], 0
        for epoch, start, stop in chunks:
            if epoch >= self.epochs or taken >= self.step_rows:
                break
            take = min(stop - start, self.step_rows - taken)
            if (seed, epoch) not in self._orders:  # the chunks of at most two epochs are out
                self._orders = {k: v for k, v in self._orders.items() if k[1] >= epoch - 1}
                self._orders[(seed, epoch)] = epoch_rows(len(self.task.train), seed, epoch)
            rows.append(self._orders[(seed, epoch)][start:start + take])
            taken += take
        if not taken:
            return None
        rest, left = [], taken
        for epoch, start, stop in chunks:
            skip = min(left, stop - start)
            left -= skip
            if start + skip < stop:
                rest.append([epoch, start + skip, stop])
        self.client.plan = (seed, rest, False)
        return torch.cat(rows)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out_of_time(self) -> bool:
        limit = self.cfg.max_seconds
        return bool(limit) and time.monotonic() - self._budget_from >= limit

    def _step(self, index: torch.Tensor) -> None:
        began = time.perf_counter()
        self.pacer.begin()
        grads = self.flat_grads if self.gpu_grads is None else self.gpu_grads
        grads.zero_()
        if self.tables is not None:
            self._begin_tables(index)
        loss = accumulate(index, self.cfg.accumulate, self._loss, self.precision.backward)
        if self.tables is not None:
            self.tables.settle()  # dense row gradients: clipped with the others
        overflowed = self.precision.overflowed(self.unscaler, grads)
        if self.clip is not None and not overflowed:  # on the worker, before compression
            self.clip(self.model.parameters())
        if self.gpu_grads is not None:
            self.flat_grads.copy_(self.gpu_grads)  # waits for backward, as loss.item() would
        self.pacer.end()  # a straggler waits here: its gradient reaches the server late
        self.computed += time.perf_counter() - began
        self.steps += 1
        self.samples += len(index)
        if overflowed:  # fp16's scale was too high: nothing to push, a lower scale next
            self.overflows += 1
            return
        self.unpushed += len(index)
        value = loss.item()
        if math.isfinite(value):
            self.loss_sum, self.loss_steps = self.loss_sum + value, self.loss_steps + 1
        if self.inner is not None:
            self.inner.step()  # on flat_params, from flat_grads
            if self.local_rows is not None:
                self.local_rows.step(self.tables, self.local_lr)
            self.local_done += 1
            if self.local_done < self.H:
                self._load()
                return
        elif self.accum is not None:
            self.accum.add_(self.flat_grads)
            if self.steps % self.cfg.push_every:
                self.flat_params.add_(self.flat_grads, alpha=-self.local_lr)  # Downpour local step
                self._load()
                return
        self._push()

    def _ids_of(self, index: torch.Tensor) -> list:
        """Per table, the unique ids the rows ``index`` look up (from the inputs on the CPU
        when the model says which, else on its device for the probe's forward)."""
        inputs = self.task.train.rows(index)[0]
        if not callable(getattr(self.model, "embedding_inputs", None)):
            inputs = tuple(t.to(self.device) for t in inputs)
        ids = self.tables.ids_of(inputs)
        check_ids(ids, self.layout, self.client.hashed)
        return ids

    def _begin_tables(self, index: torch.Tensor) -> None:
        """The tables' local weights for the step on ``index``: its batch's rows, or with
        local steps the rows of the window it opens (or is in)."""
        if self.inner is None:
            self.tables.begin(*self._rows_for(index), self.device)
            return
        if self.local_rows is None:  # the first step since a push: a window opens
            if self._window is None:
                raise ConfigError("--local-steps with tables served by row pulls the rows of "
                                  "the next H batches at once, but --data-dispatch dynamic "
                                  "hands batches out one at a time: drop one of them")
            key = self._window(self.position - 1)
            if self.ahead is not None and len(key) < len(self.ahead[0]) and \
                    torch.equal(self.ahead[0][:len(key)], key):
                key = self.ahead[0]  # H fell at the push (DyLU): its rows cover this window
            self.local_rows = LocalRows(*self._rows_for(key), self.device)
            self.anchor.copy_(self.flat_params)  # a pull there brought new dense parameters
        self.tables.begin(self.local_rows.ids, self.local_rows.rows, self.device)

    def _rows_for(self, index: torch.Tensor) -> tuple:
        """(ids, rows) of the batch ``index``: those the previous push brought back, or
        pulled now (with the dense parameters) when it could not know this batch."""
        if self.ahead is not None and torch.equal(self.ahead[0], index):
            _, ids, rows = self.ahead
            self.ahead = None
            return ids, rows
        ids = self._ids_of(index)
        rows = self.client.push_pull(None, self.flat_params, want=ids)
        # the dense parameters into the model; not _pulled: under sync this pull is no new
        # round, and _follow_rounds would send the worker back to the batch it is on
        self._load()
        return ids, rows

    def _loss(self, index: torch.Tensor) -> torch.Tensor:
        """The mean loss on rows ``index`` (one micro-batch), under autocast."""
        inputs, targets = self.task.train.rows(index)
        inputs = tuple(t.to(self.device) for t in inputs)
        with self.precision.autocast():
            return self.task.loss_fn(self.model(*inputs), targets.to(self.device))

    def _push(self, ahead: bool = True) -> None:
        """Push what the steps since the last push made; ``ahead``: ask for the next
        batches' rows with it (not as the worker finishes: nothing would train on them)."""
        meta = {Key.LOSS: self.loss_sum / max(1, self.loss_steps), Key.SAMPLES: self.unpushed,
                Key.TRAFFIC: self._traffic(), Key.COMPUTE: self.computed}
        if self.auto:  # what shard 0 sizes this worker's H by (PROTOCOL.md, DyLU)
            meta.update({Key.AUTO_STEPS: self.fastest, Key.LOCAL_STEPS: max(1, self.local_done)})
        if self.anchor is not None:  # the pseudo-gradient: pulled minus local parameters
            grads = self.anchor.sub_(self.flat_params)
        else:
            grads = self.accum if self.accum is not None else self.flat_grads
        if self.tables is None:
            self.client.push_pull(grads, self.flat_params, meta, compute=self.computed)
        else:
            upcoming = self._upcoming() if ahead and self._upcoming is not None else None
            want = self._ids_of(upcoming) if upcoming is not None else None
            pushed = (self.tables.gradients() if self.local_rows is None
                      else self.local_rows.pseudo_gradients())
            self.local_rows = None
            rows = self.client.push_pull(grads, self.flat_params, meta, compute=self.computed,
                                         rows=pushed, want=want)
            self.ahead = (upcoming, want, rows) if want is not None else None
        self.computed, self.local_done = 0.0, 0
        if self.auto and self.client.local_steps:
            self.H = self.client.local_steps
        self._pulled()
        if self.accum is not None:
            self.accum.zero_()
        self.pushes += 1
        self.loss_sum, self.loss_steps, self.unpushed = 0.0, 0, 0
        self._show()

    def _show(self, force: bool = False) -> None:
        if not self.progress.due(force):  # called every push: no status built unless shown
            return
        elapsed = self.elapsed()
        note = pace_note(self.pacer.computed, self.pacer.waited, self.pacer.span)
        if self.client.batch is not None:  # the batch the server gives it (--balance batch)
            note = f"batch {self.client.batch[0]}" + (f", {note}" if note else "")
        if self.auto:
            note = "; ".join(filter(None, (f"local steps {self.H} (auto)", note)))
        if self.tables is not None and self.steps:
            stats = self.client.stats
            note = "; ".join(filter(None, (f"rows/step {stats['rows_pulled'] / self.steps:.0f} "
                                           f"pulled, {stats['rows_pushed'] / self.steps:.0f} "
                                           "pushed", note)))
        self.progress.note(note)
        self.progress.update(elapsed, self.samples, self.samples / max(1e-9, elapsed), force=force)

    def _traffic(self) -> list:
        """Bytes this worker sent and received since its previous push (its server counts
        them per worker: summary.json's ``bytes``)."""
        now = (self.client.stats["bytes_sent"], self.client.stats["bytes_received"])
        delta = [now[0] - self.reported[0], now[1] - self.reported[1]]
        self.reported = now
        return delta

    def _pulled(self) -> None:
        """New parameters came from the server: into the model, and the next round's anchor."""
        self._load()
        if self.anchor is not None:
            self.anchor.copy_(self.flat_params)
        self._follow_rounds()

    def _follow_rounds(self) -> None:
        """Under sync, a pulled round below this worker's own count means the server went
        back (restored from an older checkpoint; the push it computed on a lost round was
        acknowledged stale): train from that round's batch again. Otherwise the rounds never
        fall behind its count, so nothing changes."""
        if str(self.client.info.get(Key.CONSISTENCY, "")) != "sync":
            return
        version = min(self.client.versions)
        if self.joined_at is None:
            self.joined_at = version
        # (under auto, the steps of the rounds it goes back over are counted at its current H)
        per_push = max(self.H, self.cfg.push_every)
        position = max(0, version - self.joined_at) * per_push
        if position < self.position:
            log.warning("worker %d: the server is back at round %d; training again from the "
                        "batch of that round (step %d, was at %d)", self.rank, version,
                        position, self.position)
            self.position = position

    def _load(self) -> None:
        """On a GPU the model's parameters are views of ``gpu_params``: the pulled values
        go there (on the CPU they are views of flat_params already)."""
        if self.gpu_params is not None:
            self.gpu_params.copy_(self.flat_params)

    def _finish(self) -> WorkerResult:
        if self.unpushed:  # local steps since the last push (--push-every): don't lose them
            self._push(ahead=False)
        self._show(force=True)
        self.client.bye()
        return self.result()

    def result(self, ended_by_server: bool = False) -> WorkerResult:
        return WorkerResult(self.client.worker, self.steps, self.pushes, self.samples,
                            round(self.elapsed(), 3),
                            {**self.client.stats, "ended_by_server": ended_by_server,
                             **self.pacer.figures(), **self._precision_figures()})

    def _precision_figures(self) -> dict:
        """What --amp and --clip-grad-norm did, when asked for."""
        figures = {} if self.cfg.amp == "off" else {**self.precision.state(),
                                                     "overflowed_steps": self.overflows}
        if self.clip is not None:
            figures["clipping"] = self.clip.to_dict()
        return figures


def inner_optimizer(kind: str, flat_params: torch.Tensor, flat_grads: torch.Tensor, lr: float,
                    weight_decay: float):
    """The optimizer of --local-steps over the whole flat parameter vector (one tensor, its
    gradient the flat gradient buffer): sgd, momentum (0.9) or adamw, as torch.optim's."""
    from asyncsgd.modes.optim import SGD, AdamW
    flat = torch.nn.Parameter(flat_params)  # the same storage: steps move the model too
    flat.grad = flat_grads
    if kind == "adamw":
        return AdamW([flat], lr=lr, weight_decay=weight_decay)
    return SGD([flat], lr=lr, momentum=0.9 if kind == "momentum" else 0.0,
               weight_decay=weight_decay)

