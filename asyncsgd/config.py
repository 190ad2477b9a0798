"""Run settings as dataclasses; the CLI's options are generated from them.

Each field is a *knob*: its default, its help text and, where useful, the
click type that validates it. ``click_options(HogwildConfig)`` turns the
fields into ``--kebab-case`` options, so a setting is documented exactly once
and ``--help`` always shows every option with its default.

Read top to bottom: ``knob`` (how a setting is declared), the settings of each
command, then the helpers that turn them into click options and back.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import click

from .core.pacing import parse_delay, parse_slowdown
from .errors import ConfigError

# Microseconds a worker polls for a reply, and a shard for its next message, before
# sleeping (asyncsgd.wire.busy_poll): a 20 KB round trip took 0.215 ms instead of 0.228.
BUSY_POLL_US = 400
MAX_BUSY_POLL_US = 10_000  # well below a heartbeat and a shard's 0.1 s tick


def knob(default: Any, help: str, *, type: Any = None, show: Optional[str] = None,
         metavar: Optional[str] = None, identity: bool = False, multiple: bool = False,
         aliases: tuple = ()) -> Any:
    """A dataclass field documented for the CLI.

    ``show`` is what --help prints as the default when the value itself would
    say nothing (e.g. ``None`` meaning "the task's default"). ``identity``
    marks settings that define *what* is trained (task, data): a resumed run
    must keep them. ``multiple`` makes an option that may be given several
    times; its value is a tuple. ``aliases``: older flags that still work.
    """
    meta = {"help": help, "type": type, "show": show, "metavar": metavar,
            "identity": identity, "multiple": multiple, "aliases": aliases}
    return field(default=default, metadata=meta)


def _start_method() -> Any:
    """The knob of the modes that start processes of their own (hogwild, ddp; not single)."""
    return knob(
        default_start_method(), "How worker processes start: forkserver (one fresh server "
        "imports torch once and forks each worker; the default where the platform has it) or "
        "spawn (a fresh interpreter each, importing torch again). 8 Hogwild processes were "
        "training 1.2-1.5 s after the command on 2 idle cores with forkserver, 5.6-10 s with "
        "spawn.", type=click.Choice(["spawn", "forkserver"]))


def default_start_method() -> str:
    """forkserver where the platform has it (Linux, macOS), else spawn. Never fork: the
    training parent runs threads (progress, evaluation) that a fork would copy mid-step."""
    import multiprocessing
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


class _CheckedText(click.ParamType):
    """A value such as --slowdown's or --comm-hook's: checked when parsed, kept as the text
    given."""

    def __init__(self, name: str, parse: Any):
        self.name, self._parse = name, parse

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return None
        try:
            self._parse(str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


class _ShardCount(click.ParamType):
    """--shards: ``auto`` or a whole number of at least 1."""

    name = "auto|N"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        text = str(value).strip()
        if text.isascii() and text.isdecimal() and int(text) >= 1:
            return int(text)
        self.fail(f"{value!r} is neither auto nor a whole number of at least 1", param, ctx)


_SHARD_COUNT = _ShardCount()


def _slowdown() -> Any:
    """The straggler knobs of every mode that trains (core.pacing says how they work)."""
    return knob(
        None, "Make ranks stragglers: RANK:FACTOR[,...]; e.g. 1:4 has rank 1 wait 3x its "
        "step's compute time after each step, so it takes 4x as long.",
        type=_CheckedText("RANK:FACTOR", parse_slowdown), metavar="RANK:FACTOR", show="none")


def _delay() -> Any:
    return knob(
        None, "Random per-step delays: KIND:MEAN[@RANKS], KIND exp or const, MEAN in ms or "
        "s; e.g. exp:20ms (every rank), exp:0.5s@1,2. Seeded by --seed and rank.",
        type=_CheckedText("KIND:MEAN", parse_delay), metavar="KIND:MEAN[@RANKS]", show="none")


def parse_comm_hook(text: str) -> tuple:
    """``(kind, rank)`` of a --comm-hook value; a ConfigError naming the valid ones."""
    kind, _, rank = text.partition(":")
    if kind in ("allreduce", "fp16", "bf16") and not rank:
        return kind, 0
    if kind == "powersgd" and (not rank or (rank.isdigit() and int(rank) >= 1)):
        return kind, int(rank or 1)
    raise ConfigError(f"--comm-hook {text!r}: use allreduce, fp16, bf16 or powersgd[:RANK] "
                      "with RANK >= 1")


def parse_compress(text: str) -> tuple:
    """``(kind, ratio)`` of a --compress value: ("none", 0), ("int8", 0), ("topk", R)."""
    kind, _, ratio = text.partition(":")
    if kind in ("none", "int8") and not ratio:
        return kind, 0.0
    if kind == "topk":
        try:
            value = float(ratio)
        except ValueError:
            value = float("nan")
        if 0 < value <= 0.5:
            return kind, value
    raise ConfigError(f"--compress {text!r}: use none, int8 or topk:RATIO with 0 < RATIO <= 0.5 "
                      "(e.g. topk:0.01 sends the largest 1%; above half, an index and a value "
                      "per value kept cost more than float32 itself)")


@dataclass
class RunConfig:
    """Settings of every run that evaluates a model and writes a run directory."""

    task: str = knob(
        "mnist1d-cnn",
        "Task to train: a built-in name (list them with 'asyncsgd tasks') or "
        "'package.module:function' returning an asyncsgd.Task.",
        metavar="NAME|MODULE:FUNC", identity=True)
    samples: Optional[int] = knob(
        None, "Samples to generate for generated tasks (mnist1d: 80% train, 20% test).",
        type=click.IntRange(min=10), show="task's default (mnist1d: 5000)",
        identity=True)
    data_dir: Optional[str] = knob(
        None, "Directory with MNIST / Fashion-MNIST IDX files (for the mnist-* tasks). "
        "Nothing is ever downloaded.", metavar="DIR", identity=True)
    cache_dir: Optional[str] = knob(
        None, "Where generated data sets are cached.", metavar="DIR",
        show="$ASYNCSGD_CACHE or ~/.cache/asyncsgd")
    max_seconds: Optional[float] = knob(
        None, "Stop this many seconds after the command started (its start-up counts: it "
        "is time you wait too); from Python, after the run started.",
        type=click.FloatRange(min=0, min_open=True), show="no limit")
    target: Optional[float] = knob(
        None, "Stop once the test metric reaches this, in the task's metric and direction "
        "('asyncsgd tasks'): accuracy as a fraction (0.9), lm's perplexity (2.0) from above.",
        type=float, metavar="VALUE", show="none", aliases=("--target-accuracy",))
    eval_every: float = knob(
        2.0, "Seconds between evaluations of the model on the test set.",
        type=click.FloatRange(min=0.05))
    seed: int = knob(0, "Random seed of the model's initial weights, the data order and torch.")
    device: str = knob(
        "cpu", "Where the model lives and trains: cpu, or cuda (a GPU).",
        type=click.Choice(["cpu", "cuda"]))
    threads: int = knob(
        0, "Torch threads; 0 means the cores not busy with other work (the cores less the "
        "1-minute load average, at least 1).", type=click.IntRange(min=0))
    out: Optional[str] = knob(
        None, "Run directory to write (config.json, metrics.jsonl, summary.json, "
        "checkpoint.pt).", metavar="DIR", show="runs/<time>-<mode>")
    resume: Optional[str] = knob(
        None, "Continue the run in this run directory from its checkpoint.",
        metavar="RUN_DIR", show="none")
    checkpoint_every: float = knob(
        60.0, "Seconds between checkpoints during training (0: only at the end).",
        type=click.FloatRange(min=0))
    tensorboard: bool = knob(
        False, "Also write TensorBoard event files into the run directory.")
    progress: str = knob(
        "auto", "Progress display: a bar on a terminal and log lines otherwise (auto), "
        "or force bar, log or off.", type=click.Choice(["auto", "bar", "log", "off"]))

    mode = "run"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TrainConfig(RunConfig):
    """Settings of the modes that run the SGD loop themselves (Hogwild, single, DDP)."""

    batch_size: Optional[int] = knob(
        None, "Samples per step in each process.", type=click.IntRange(min=1),
        show="task's default")
    lr: Optional[float] = knob(
        None, "SGD learning rate (of every process).", type=click.FloatRange(min=0, min_open=True),
        show="task's default")
    momentum: float = knob(
        0.0, "SGD momentum (adam has its own: give it none). 0: plain SGD, the update every "
        "mode makes by default (the parameter server's default rule too), so that modes "
        "compare alike.", type=click.FloatRange(0, 1, max_open=True))
    weight_decay: float = knob(0.0, "L2 weight decay.", type=click.FloatRange(min=0))
    epochs: int = knob(20, "Passes over the training data.", type=click.IntRange(min=1))
    slowdown: Optional[str] = _slowdown()
    delay: Optional[str] = _delay()
    mode = "train"


@dataclass
class HogwildConfig(TrainConfig):
    """Settings of ``asyncsgd hogwild``."""

    procs: Optional[int] = knob(
        None, "Training processes sharing one model.", type=click.IntRange(min=1),
        show="CPU cores")
    start_method: str = _start_method()
    lock: bool = knob(
        False, "Take one shared lock around every update: the locked baseline "
        "that shows what lock-free Hogwild buys.")
    share_cores: str = knob(
        "auto", "How more processes than cores share them: 'ring' passes one run token per "
        "core round-robin every --quantum-ms, so processes don't thrash; 'os' leaves it to "
        "the kernel scheduler; 'auto' uses the ring when processes outnumber cores.",
        type=click.Choice(["auto", "ring", "os"]))
    quantum_ms: float = knob(
        250.0, "Milliseconds a process computes before passing its run token on (ring only). "
        "Each switch costs here: 10 ms quanta lose ~20%, 250 ms none.",
        type=click.FloatRange(min=1))
    eval_every: float = knob(
        2.0, "Seconds between evaluations of the shared model on the test set; the parent "
        "evaluates beside training, without pausing the processes.",
        type=click.FloatRange(min=0.05))
    seed: int = knob(
        0, "Random seed: the model's initial weights and the data partition; process r "
        "seeds torch with seed + r, and its data order follows from seed and r.")
    device: str = knob(
        "cpu", "Where the shared model lives and trains: cpu, or cuda to share it on one "
        "GPU (every process updates it there).", type=click.Choice(["cpu", "cuda"]))
    threads: int = knob(
        0, "Torch threads per process; 0 means CPU cores // --procs (at least 1): N "
        "processes each running a thread per core thrash.", type=click.IntRange(min=0))
    momentum: float = knob(
        0.0, "SGD momentum; each process keeps its own momentum buffer (only the "
        "parameters are shared). 0: plain SGD, the update every mode makes by default, so "
        "that modes compare alike.", type=click.FloatRange(0, 1, max_open=True))
    epochs: int = knob(
        20, "Passes over the training data: each process passes over its own partition.",
        type=click.IntRange(min=1))

    mode = "hogwild"


@dataclass
class SingleConfig(TrainConfig):
    """Settings of ``asyncsgd single``: plain SGD in one process, the reference baseline."""

    amp: str = knob(
        "off", "Mixed precision: bf16 or fp16 autocast (fp16 adds a gradient scaler). "
        "fp16 needs --device cuda; bf16 also runs on CPUs (fast only where they have "
        "bf16 instructions).", type=click.Choice(["off", "bf16", "fp16"]))
    optimizer: str = knob(
        "sgd", "Update rule: sgd (with --momentum) or adam (betas 0.9/0.999, eps 1e-8: the "
        "parameter server's adam rule). Pick the lr for it: adam wants ~1e-3.",
        type=click.Choice(["sgd", "adam"]))
    simulate_staleness: int = knob(
        0, "single only: apply each gradient this many steps after it was computed, as if "
        "that many other workers' updates came between a worker's pull and its push (Dai et "
        "al. 2019): statistical efficiency under staleness, apart from throughput. The "
        "first STEPS steps apply nothing and the last STEPS gradients are never applied; "
        "the checkpoint holds the queue, so --resume applies the gradients in flight.",
        type=click.IntRange(min=0), metavar="STEPS")
    eval_every: float = knob(
        2.0, "Seconds between evaluations on the test set, taken between steps (training "
        "waits for them).", type=click.FloatRange(min=0.05))

    mode = "single"


@dataclass
class DDPConfig(SingleConfig):
    """Settings of ``asyncsgd ddp``: synchronous data-parallel SGD (DistributedDataParallel)."""

    procs: Optional[int] = knob(
        None, "Processes (ranks) to spawn on this host, one per GPU with --device cuda. "
        "Under torchrun, WORLD_SIZE decides and this must be left out or match it.",
        type=click.IntRange(min=1), show="GPUs with --device cuda, else CPU cores")
    start_method: str = _start_method()
    backend: str = knob(
        "auto", "Collective backend: nccl (CUDA tensors, one process per GPU) or gloo (CPU). "
        "auto picks nccl with --device cuda when there are at least as many GPUs as "
        "processes on this host, else gloo.", type=click.Choice(["auto", "nccl", "gloo"]))
    comm_hook: str = knob(
        "allreduce", "How DDP's gradient all-reduce travels, with PyTorch's own communication "
        "hooks: allreduce (float32), fp16 (fp16_compress_hook: half the bytes), bf16 "
        "(bf16_compress_hook; NCCL only) or powersgd[:RANK] (PowerSGD, rank-RANK "
        "approximations of each matrix, with error feedback; rank 1 by default).",
        type=_CheckedText("HOOK", lambda text: parse_comm_hook(text)),
        metavar="allreduce|fp16|bf16|powersgd[:RANK]")
    local_steps: int = knob(
        1, "Post-local SGD with PyTorch's own pieces (post_localSGD_hook and the periodic "
        "model averager that PostLocalSGDOptimizer runs): after --local-warmup steps of "
        "ordinary DDP, ranks stop all-reducing gradients, train alone and average their "
        "parameters every this many steps. 1: plain DDP.", type=click.IntRange(min=1))
    local_warmup: int = knob(
        0, "Steps of ordinary DDP before --local-steps begins (post-local SGD's warm-up).",
        type=click.IntRange(min=0))
    dist_timeout: float = knob(
        300.0, "Seconds a rank waits in a collective (or to join the group) before it "
        "gives up with an error, so a hung rank cannot hang the others forever. Must "
        "exceed the longest pause of rank 0 (evaluation, checkpoint).",
        type=click.FloatRange(min=1))
    eval_every: float = knob(
        2.0, "Seconds between evaluations on the test set: rank 0 evaluates between steps "
        "and the other ranks wait for it at the next all-reduce.",
        type=click.FloatRange(min=0.05))
    seed: int = knob(
        0, "Random seed: the model's initial weights (the same on every rank) and the data "
        "partition; rank r seeds torch with seed + r, and its data order follows from seed "
        "and r.")
    device: str = knob(
        "cpu", "Where each rank's model lives and trains: cpu, or cuda (one GPU per rank).",
        type=click.Choice(["cpu", "cuda"]))
    threads: int = knob(
        0, "Torch threads per rank; 0 means CPU cores // the ranks on this host (at least 1).",
        type=click.IntRange(min=0))
    epochs: int = knob(
        20, "Passes over the training data: each rank passes over its own partition.",
        type=click.IntRange(min=1))

    mode = "ddp"


@dataclass
class ServerConfig(RunConfig):
    """Settings of ``asyncsgd ps-server``."""

    bind: str = knob(
        "tcp://0.0.0.0:5555", "Address workers connect to. Shards listen on free ports of "
        "the same host and are announced in the handshake.", metavar="tcp://HOST:PORT")
    shards: Union[int, str] = knob(
        "auto", "Shard processes; the parameters are split evenly by bytes. Each adds a "
        "request per step and pays only from ~5 MB a shard (experiments/ps_throughput.py). "
        "auto: one per 5 MB of float32 parameters, at most cores // --workers (1 for every "
        "model under 10 MB); a resumed run keeps its count.", type=_SHARD_COUNT,
        metavar="auto|N")
    checkpoint_every: float = knob(
        60.0, "Seconds between checkpoints during training; the server and its shards also "
        "save one as they start serving, and one at the end (0: only those).",
        type=click.FloatRange(min=0))
    optimizer: str = knob(
        "sgd", "Update rule each shard applies to its slice. For workers' --local-steps "
        "pseudo-gradients: nesterov (DiLoCo's outer optimizer with --consistency sync: "
        "--lr 0.7 --momentum 0.9) or delayed-nesterov (asynchronous Local SGD, Liu et al. "
        "2024: momentum applied every --nesterov-period pushes).",
        type=click.Choice(["sgd", "momentum", "adagrad", "adam", "nesterov",
                           "delayed-nesterov"]))
    lr: Optional[float] = knob(
        None, "Learning rate of the shards' update rule.",
        type=click.FloatRange(min=0, min_open=True), show="task's default")
    momentum: float = knob(
        0.9, "Momentum of --optimizer momentum, nesterov and delayed-nesterov (sgd, adagrad "
        "and adam ignore it). 0.9, the "
        "usual value, since choosing that rule asks for momentum; the default rule, sgd, is "
        "plain SGD, as the other modes' default --momentum 0 is.",
        type=click.FloatRange(0, 1, max_open=True))
    nesterov_period: int = knob(
        0, "delayed-nesterov: pushes per momentum step (each push moves the parameters by "
        "lr / period at once); 0 means --workers, as Liu et al. chose.",
        type=click.IntRange(min=0))
    weight_decay: float = knob(0.0, "L2 weight decay of the update rule.",
                               type=click.FloatRange(min=0))
    consistency: str = knob(
        "async", "async (apply every push on arrival), ssp:K (no worker more than K clocks "
        "ahead of the slowest live one) or sync (mean of one push per live worker).",
        metavar="async|ssp:K|sync")
    workers: int = knob(1, "Workers expected: ssp and sync wait for this many before starting.",
                        type=click.IntRange(min=1))
    sync_reduce: str = knob("mean", "How sync combines a round's pushes.",
                            type=click.Choice(["mean", "sum"]))
    backup_workers: int = knob(
        0, "sync: apply each round once all live workers but this many have pushed (Chen et "
        "al. 2016); a push that comes after its round is stale, counted, never applied. "
        "Each shard takes the first pushes to reach it, as TensorFlow's SyncReplicas did.",
        type=click.IntRange(min=0))
    staleness_lr: bool = knob(
        False, "Divide the learning rate by a push's staleness (Zhang et al. 2016).")
    dc_asgd: Optional[float] = knob(
        None, "Delay-compensated ASGD (Zheng et al. 2017) with this lambda, e.g. 0.04.",
        type=click.FloatRange(min=0), show="off")
    heartbeat_timeout: float = knob(
        10.0, "Seconds of silence after which a worker is dropped from ssp/sync barriers.",
        type=click.FloatRange(min=0.1))
    max_grad_norm: Optional[float] = knob(
        None, "Reject pushes whose gradient norm (per shard) exceeds this.",
        type=click.FloatRange(min=0, min_open=True), show="no bound")
    allow_nonfinite: bool = knob(
        False, "Apply gradients holding NaN or Inf (rejected by default).")
    exit_when_done: bool = knob(
        True, "Stop once every worker that joined has left (said bye or went silent).")
    curve_secret: Optional[str] = knob(
        None, "The server's secret key (server.key_secret from 'asyncsgd keygen DIR'): turns "
        "on CURVE authentication and encryption for the front and every shard. Needs "
        "--allowed-clients.", metavar="FILE", show="off: plain TCP")
    allowed_clients: Optional[str] = knob(
        None, "Directory of the workers' public keys (*.key, e.g. DIR/allowed_clients from "
        "'asyncsgd keygen DIR'); with CURVE only these workers get in.", metavar="DIR",
        show="none")
    shard_restarts: int = knob(
        3, "Restart a crashed shard from its last checkpoint up to this many times: workers "
        "reconnect on their own, and the updates applied since that checkpoint are lost and "
        "counted (lost_updates). 0: a crashed shard ends the run.", type=click.IntRange(min=0))
    eval_every: float = knob(
        2.0, "Seconds between evaluations of the current parameters on the test set; the "
        "shards keep serving meanwhile.", type=click.FloatRange(min=0.05))
    seed: int = knob(
        0, "Random seed of the model's initial weights, which the shards start from, and of "
        "the data of a task function that takes a seed (give its workers the same --seed). "
        "Workers split the training data with seed 0 whatever this seed, and order their "
        "batches with their own --seed.")
    device: str = knob(
        "cpu", "The server keeps the parameters in CPU memory and evaluates there: only cpu. "
        "Compute gradients on GPUs with 'asyncsgd worker --device cuda'.",
        type=click.Choice(["cpu", "cuda"]))
    threads: int = knob(
        0, "Torch threads of each shard process and of the evaluation; 0 means CPU cores // "
        "(--shards + 1) for each shard (at least 1) and 1 for the evaluation.",
        type=click.IntRange(min=0))
    busy_poll_us: int = knob(
        BUSY_POLL_US, "Each shard polls for its next message for up to this many "
        "microseconds before sleeping, while messages come that often, are no larger than "
        "256 KiB and no other thread wants its core (a woken process waited ~25 us for a "
        "core here). 0: always sleep.",
        type=click.IntRange(0, MAX_BUSY_POLL_US))

    mode = "ps"


@dataclass
class WorkerConfig:
    """Settings of ``asyncsgd worker``."""

    server: str = knob("tcp://127.0.0.1:5555", "The server's address.",
                       metavar="tcp://HOST:PORT")
    task: str = knob("mnist1d-cnn", "Task; must match the server's model.",
                     metavar="NAME|MODULE:FUNC")
    samples: Optional[int] = knob(None, "Samples of generated tasks (as on the server).",
                                  type=click.IntRange(min=10), show="task's default")
    data_dir: Optional[str] = knob(None, "Directory with MNIST IDX files (mnist-* tasks).",
                                   metavar="DIR")
    cache_dir: Optional[str] = knob(None, "Where generated data sets are cached.",
                                    metavar="DIR", show="$ASYNCSGD_CACHE or ~/.cache/asyncsgd")
    rank: Optional[int] = knob(
        None, "This worker's index; its data partition follows from rank and world.",
        type=click.IntRange(min=0), show="$RANK or $SLURM_PROCID or 0")
    world: Optional[int] = knob(
        None, "Number of workers sharing the data.", type=click.IntRange(min=1),
        show="$WORLD_SIZE or $SLURM_NTASKS or 1")
    epochs: int = knob(20, "Passes over this worker's partition.", type=click.IntRange(min=1))
    batch_size: Optional[int] = knob(None, "Samples per gradient.", type=click.IntRange(min=1),
                                     show="task's default")
    push_every: int = knob(
        1, "Local steps per push (Downpour's n_push): between pushes the worker applies "
        "plain SGD locally with --local-lr and pushes the summed gradients, so scale the "
        "server's --lr down by about this factor. --local-steps pushes the change of the "
        "parameters instead.",
        type=click.IntRange(min=1))
    local_steps: int = knob(
        1, "Local SGD / DiLoCo: train this many steps (H) with --inner-optimizer from the "
        "pulled parameters, then push the pseudo-gradient, pulled minus local parameters, "
        "for the server's rule to apply (DiLoCo: the server's --optimizer nesterov --lr 0.7 "
        "with --consistency sync; async: asynchronous Local SGD). The inner optimizer keeps "
        "its state across rounds. 1: push every gradient.", type=click.IntRange(min=1))
    inner_optimizer: str = knob(
        "sgd", "The optimizer of --local-steps: sgd, momentum (0.9) or adamw (DiLoCo's: "
        "e.g. --local-lr 0.001 --inner-weight-decay 0.1).",
        type=click.Choice(["sgd", "momentum", "adamw"]))
    inner_weight_decay: float = knob(
        0.0, "Weight decay of --inner-optimizer (adamw: decoupled, as torch.optim.AdamW).",
        type=click.FloatRange(min=0))
    local_lr: Optional[float] = knob(
        None, "Learning rate of local steps: --push-every's plain SGD, or --local-steps' "
        "--inner-optimizer.", type=click.FloatRange(min=0, min_open=True),
        show="task's default")
    max_seconds: Optional[float] = knob(None, "Stop this many seconds after the command "
                                        "started (its start-up counts).",
                                        type=click.FloatRange(min=0, min_open=True),
                                        show="no limit")
    seed: int = knob(
        0, "Seed of this worker's data order (each epoch's shuffle of its partition) and of "
        "its --delay draws; a task function that takes a seed builds its data with it, so "
        "give such a task the server's --seed. The partition always uses seed 0, whatever "
        "the seeds, so workers given different seeds still split the data disjointly.")
    slowdown: Optional[str] = _slowdown()
    delay: Optional[str] = _delay()
    device: str = knob(
        "cpu", "Where the gradients are computed: cpu, or cuda (a GPU of this host). With "
        "cuda the model lives on the GPU, each pull is copied onto it and each gradient "
        "off it; the bytes to and from the server go through host memory as with cpu.",
        type=click.Choice(["cpu", "cuda"]))
    threads: int = knob(
        0, "Torch threads; 0 means CPU cores // the server's processes on this host (its "
        "workers, --local-workers, and its shards when the server runs here too), at least "
        "1. Several workers on one host each starting one thread per core slowed every "
        "step 16x in the README's setup.", type=click.IntRange(min=0))
    local_workers: int = knob(
        0, "Workers on this host, for the default --threads; 0 means $LOCAL_WORLD_SIZE or "
        "$SLURM_NTASKS_PER_NODE, else all --world workers when the server runs on this "
        "host (its address is local), else 1.", type=click.IntRange(min=0))
    heartbeat: float = knob(1.0, "Seconds between heartbeats while waiting on the server.",
                            type=click.FloatRange(min=0.05))
    busy_poll_us: int = knob(
        BUSY_POLL_US, "With a one-shard server, wait for a shard's reply by polling for up to "
        "this many microseconds before sleeping, while replies come that fast, are no "
        "larger than 256 KiB and no other thread wants the core: a 20 KB push+pull took "
        "0.215 ms instead of 0.228 ms here. 0: always sleep.",
        type=click.IntRange(0, MAX_BUSY_POLL_US))
    server_timeout: float = knob(
        60.0, "Give up with an error after the server has been unreachable this long.",
        type=click.FloatRange(min=0.1))
    transport: str = knob(
        "auto", "How tensors travel: auto puts them in shared memory when the server runs on "
        "this host (its address is one of this host's, in this network namespace) and sends "
        "them over TCP otherwise; shared insists on shared memory (an error if it cannot be "
        "had); tcp always uses TCP. Shared memory made a 10 MB push+pull 2x faster here.",
        type=click.Choice(["auto", "shared", "tcp"]))
    push_dtype: str = knob(
        "float32", "How gradients travel: float32, or cast to bf16 or fp16 (half the bytes; "
        "the server widens them and keeps float32).",
        type=click.Choice(["float32", "bf16", "fp16"]))
    pull_dtype: str = knob(
        "float32", "How the parameters come back: float32, bf16 or fp16 (half the bytes; "
        "this worker computes from the rounded copy).",
        type=click.Choice(["float32", "bf16", "fp16"]))
    compress: str = knob(
        "none", "Compress pushes with error feedback (what a push leaves out is added to "
        "the next): int8 (a float32 scale per 256 values: 3.9x fewer bytes) or topk:RATIO "
        "(the RATIO share of values largest in magnitude, as index and value: topk:0.01 "
        "sends 50x fewer bytes). Not with --push-dtype. Compressed pushes and pulls go "
        "over TCP, also on this host.",
        type=_CheckedText("none|int8|topk:RATIO", parse_compress), metavar="none|int8|topk:RATIO")
    progress: str = knob("auto", "Progress display (auto, bar, log, off).",
                         type=click.Choice(["auto", "bar", "log", "off"]))
    curve_server_key: Optional[str] = knob(
        None, "The server's public key (server.key from 'asyncsgd keygen DIR'): connect with "
        "CURVE authentication and encryption. Needs --curve-secret.", metavar="FILE",
        show="off: plain TCP")
    curve_secret: Optional[str] = knob(
        None, "This worker's secret key (DIR/clients/NAME.key_secret from 'asyncsgd keygen').",
        metavar="FILE", show="none")

    mode = "worker"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ps-job: its own settings, then every ps-server setting and the worker settings the server
# has not, each declared once above. Left out: what the launcher decides (the worker's
# --server, --rank, --world; the server's --workers) and CURVE (the rendezvous store that
# carries the server's address is unauthenticated: run a job on a trusted network, or start
# ps-server and worker with CURVE keys yourself).
_JOB_OWN = {
    "servers": (int, knob(
        1, "Ranks that serve: rank 0 runs the server (its front and its --shards shard "
        "processes); every other rank is a worker. Only 1: the shards of one server run on "
        "its host.", type=click.IntRange(1, 1))),
    "advertise": ("Optional[str]", knob(
        None, "Host or IP the workers reach the server at. By default the address of this "
        "host's interface that routes to the rendezvous host ($MASTER_ADDR).",
        metavar="HOST", show="the interface towards $MASTER_ADDR")),
}
_JOB_LEFT_OUT = {"server", "rank", "world", "workers", "curve_secret", "allowed_clients",
                 "curve_server_key"}
_JOB_HELP = {  # settings both roles take, where the server's own help would mislead
    "bind": dict(default="tcp://0.0.0.0:0", help="Where the server listens: port 0 takes a "
                 "free port, which reaches the workers through the rendezvous store."),
    "device": dict(default="cpu", help="Where the workers compute gradients: cpu or cuda. "
                   "The server keeps the parameters in CPU memory whatever this is."),
    "threads": dict(default=0, help="Torch threads of each shard and of each worker; 0 means "
                    "CPU cores shared among the processes on each host (at least 1)."),
    "max_seconds": dict(default=None, help="Stop this many seconds after the command "
                        "started, server and workers alike."),
    "busy_poll_us": dict(default=BUSY_POLL_US, help="Shards poll for their next message, "
                         "and workers of a one-shard server for their replies, for up to this "
                         "many microseconds before sleeping, while messages come that often, "
                         "are no larger than 256 KiB and no other thread wants the core. 0: "
                         "always sleep."),
}


def derived_config(name: str, mode: str, doc: str, own: dict, sources: tuple,
                   left_out: set, changed: dict, module: str = __name__):
    """A settings dataclass made of others: its ``own`` fields (name -> (type, knob)),
    then each field of ``sources`` not yet taken and not ``left_out``, with what
    ``changed`` says for it (name -> {type, default, help, show}) over the source's.
    ``module`` is where it is defined, as pickle looks it up."""
    fields = [(own_name, kind, spec) for own_name, (kind, spec) in own.items()]
    seen = set(own)
    for cls in sources:
        for f in dataclasses.fields(cls):
            if f.name in seen or f.name in left_out:
                continue
            seen.add(f.name)
            change = changed.get(f.name, {})
            meta = {**f.metadata, **{k: change[k] for k in ("help", "show") if k in change}}
            fields.append((f.name, change.get("type", f.type),
                           field(default=change.get("default", f.default), metadata=meta)))
    made = dataclasses.make_dataclass(
        name, fields, namespace={"mode": mode, "__doc__": doc,
                                 "to_dict": lambda self: dataclasses.asdict(self)})
    made.__module__ = module
    return made


JobConfig = derived_config(
    "JobConfig", "ps-job", "Settings of ``asyncsgd ps-job``: a whole parameter-server job "
    "under torchrun: one server rank, the rest workers.", _JOB_OWN,
    (ServerConfig, WorkerConfig), _JOB_LEFT_OUT, _JOB_HELP)


# The modes 'asyncsgd compare' runs by default, in this order.
COMPARE_MODES = "single,hogwild,ps-async,ps-ssp,ps-sync,ddp"


@dataclass
class CompareConfig:
    """Settings of ``asyncsgd compare``: every mode on the same task, seeds and budget."""

    task: str = knob(
        "mnist1d-cnn", "Task every mode trains: a built-in name (see 'asyncsgd tasks') or "
        "'package.module:function' returning an asyncsgd.Task.", metavar="NAME|MODULE:FUNC")
    modes: str = knob(
        COMPARE_MODES, "Comma-separated modes to run, in this order: single, hogwild, ps-async, "
        "ps-ssp (bounded staleness 2; ps-ssp:K for another bound), ps-sync, ps-backup (sync "
        "rounds that do not wait for 1 worker; ps-backup:B for B), ddp. Communicating less: "
        "diloco:H (workers --local-steps H, sync rounds through Nesterov lr 0.7, momentum "
        "0.9; H 8 by default), async-diloco:H (the same, async, delayed Nesterov), "
        "ddp+fp16, ddp+bf16, ddp+powersgd[:RANK] (PyTorch's comm hooks) and ddp-local:H "
        "(post-local SGD); --lr is then the workers' inner lr. Any parameter-server mode "
        "+bf16 or +fp16 (pushes and pulls cast), +int8 or +topk:RATIO (compressed pushes "
        "with error feedback): ps-async+int8, diloco:8+bf16.",
        metavar="MODE,...")
    procs: Optional[int] = knob(
        None, "Processes (Hogwild, DDP) or parameter-server workers of every parallel mode; "
        "each gets CPU cores // procs torch threads. 'single' runs one process with as "
        "many threads as each of these (one of them alone).",
        type=click.IntRange(min=1), show="CPU cores")
    budget: float = knob(
        60.0, "Seconds each run gets (its --max-seconds; start-up counts, as a user waits "
        "for it too).", type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS")
    target: Optional[float] = knob(
        None, "Test metric whose first crossing the report times, in the task's metric (0.9 "
        "for 90% accuracy; a perplexity for lm); runs go on to the end of the budget unless "
        "--stop-at-target.", type=float, metavar="VALUE", aliases=("--target-accuracy",),
        show="the task's own (lm: perplexity 2.0), else none")
    stop_at_target: bool = knob(
        False, "End each run once it reaches --target instead of using the whole "
        "budget (faster; final scores are then about the target).")
    repeats: int = knob(
        1, "Runs of every mode; repeat r uses seed + r for every mode. The report shows "
        "mean ± standard deviation over repeats.", type=click.IntRange(min=1))
    seed: int = knob(0, "Seed of the first repeat: model initialisation and data order.")
    samples: Optional[int] = knob(
        None, "Samples to generate for generated tasks (mnist1d: 80% train, 20% test).",
        type=click.IntRange(min=10), show="task's default (mnist1d: 5000)")
    data_dir: Optional[str] = knob(
        None, "Directory with MNIST / Fashion-MNIST IDX files (for the mnist-* tasks).",
        metavar="DIR")
    cache_dir: Optional[str] = knob(
        None, "Where generated data sets are cached.", metavar="DIR",
        show="$ASYNCSGD_CACHE or ~/.cache/asyncsgd")
    batch_size: Optional[int] = knob(
        None, "Samples per step in each process or worker, single's one process included "
        "(ddp then averages one such batch per rank into each update).",
        type=click.IntRange(min=1), show="task's default")
    lr: Optional[float] = knob(
        None, "Learning rate of plain SGD in every mode (the parameter server applies it "
        "with its 'sgd' rule).", type=click.FloatRange(min=0, min_open=True),
        show="task's default")
    epochs: Optional[int] = knob(
        None, "Passes over the training data after which a run ends early.",
        type=click.IntRange(min=1), show="no limit: the budget ends every run")
    eval_every: float = knob(
        1.0, "Seconds between test-set evaluations in every run (the resolution of the "
        "time to target).", type=click.FloatRange(min=0.05))
    slowdown: Optional[str] = _slowdown()  # ranks of every parallel mode; single is rank 0
    delay: Optional[str] = _delay()
    link: Optional[str] = knob(
        None, "Run the ps-* modes' server and each worker, and each ddp rank, on a host of "
        "its own (a network namespace; needs root) whose link to one switch is limited to "
        "RATE each way (tbf): e.g. 100mbit, 1gbit, 500kbit. single and hogwild stay "
        "unshaped on one host. See also 'asyncsgd hosts up'.", metavar="RATE",
        show="none: every process on this host")
    shards: Union[int, str] = knob(
        "auto", "Parameter-server shard processes in the ps-* modes (auto: as ps-server "
        "chooses them).", type=_SHARD_COUNT, metavar="auto|N")
    ddp_backend: str = knob("auto", "torch.distributed backend of the ddp mode.",
                            type=click.Choice(["auto", "nccl", "gloo"]))
    mode_args: tuple = knob(
        (), "Extra flags for one mode's command, e.g. 'hogwild=--lock' or "
        "'ps-async=--optimizer adam'; 'worker=...' goes to every parameter-server worker. "
        "May be given several times.", metavar="MODE=FLAGS", multiple=True)
    grace: float = knob(
        60.0, "Seconds a run may take beyond --budget to start up and finish before it is "
        "stopped and marked failed.", type=click.FloatRange(min=1), metavar="SECONDS")
    out: Optional[str] = knob(
        None, "Directory for the report, the plots and every run's directory.",
        metavar="DIR", show="runs/<time>-compare")
    tensorboard: bool = knob(
        False, "Every run also writes TensorBoard event files, into its run directory "
        "(OUT/<mode>-r<k>/tensorboard: test metric and loss vs samples and vs whole seconds "
        "since its launch, training loss per worker); view them all together with "
        "'tensorboard --logdir OUT' (needs the tensorboard package).")
    progress: str = knob(
        "auto", "Progress display: a live line on a terminal and log lines otherwise (auto), "
        "or force bar, log or off; each shows the run's time since its launch, its ETA (its "
        "budget, or --epochs at its pace, whichever ends first) and the comparison's.",
        type=click.Choice(["auto", "bar", "log", "off"]))

    mode = "compare"


@dataclass
class PlotConfig:
    """Settings of ``asyncsgd plot``."""

    out: str = knob("plots", "Directory for the PNGs and report.md.", metavar="DIR")
    target: Optional[float] = knob(
        None, "Draw this test metric (0.9 for 90% accuracy) and time each run's first "
        "crossing of it.", type=float, metavar="VALUE", show="none", aliases=("--target-accuracy",))
    allow_mixed: bool = knob(
        False, "Tabulate runs of different tasks together: a task column, speed-ups and "
        "verdict within each task (refused without it).")


# settings renamed since run directories were first written: old name -> new
RENAMED = {"target_accuracy": "target"}


def config_from_dict(cls, data: dict):
    """Build ``cls`` from a dict, naming unknown keys instead of failing obscurely."""
    data = {RENAMED.get(k, k): v for k, v in data.items()}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"known: {', '.join(sorted(names))}")
    return cls(**data)


def make_config(cls, config: Any = None, given: Optional[dict] = None):
    """``cls`` from ``config`` (an instance of exactly ``cls``; None: the defaults) with the
    settings ``given`` over it, every value checked as its CLI option checks it: what the
    Python API takes (``asyncsgd.hogwild(procs=0)`` fails as ``--procs 0`` does)."""
    if config is not None and type(config) is not cls:
        raise ConfigError(f"expected a {cls.__name__}, got a {type(config).__name__}; pass a "
                          f"{cls.__name__} or its settings as keyword arguments")
    given = dict(given or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"known: {', '.join(sorted(fields))}")
    cfg = dataclasses.replace(config, **given) if config is not None else cls(**given)
    checked = {name: _checked(f, getattr(cfg, name)) for name, f in fields.items()}
    return dataclasses.replace(cfg, **checked)


def _checked(f: dataclasses.Field, value: Any) -> Any:
    """``value`` of field ``f`` converted and checked by its option's click type."""
    if value is None or f.type in (bool, "bool"):
        return value
    if f.metadata.get("multiple"):
        return (value,) if isinstance(value, str) else tuple(value)
    kind = _click_type(f)
    if kind is None:
        return os.fspath(value) if isinstance(value, os.PathLike) else value
    try:
        return click.types.convert_type(kind).convert(value, None, None)
    except click.BadParameter as exc:
        raise ConfigError(f"{f.name}={value!r}: {exc.message}") from None


def _click_type(f: dataclasses.Field) -> Any:
    """The click type of field ``f``'s option; None where click takes the text as it is."""
    if f.metadata.get("type") is not None:
        return f.metadata["type"]
    return {int: int, "int": int, float: float, "float": float}.get(f.type)


def identity_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("identity")]


def click_options(cls):
    """Decorator adding one click option per field of the dataclass ``cls``."""

    def decorate(func):
        for f in reversed(dataclasses.fields(cls)):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            kwargs = dict(help=meta.get("help", ""), show_default=True,
                          default=f.default)
            if f.type in (bool, "bool"):
                if f.default:  # a flag that is on by default needs a way to turn it off
                    flag = f"{flag}/--no-{flag[2:]}"
                kwargs["is_flag"] = True
            elif _click_type(f) is not None:
                kwargs["type"] = _click_type(f)
            if meta.get("show"):
                kwargs["show_default"] = meta["show"]
            elif f.default is None:
                kwargs["show_default"] = "none"
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            if meta.get("multiple"):
                kwargs["multiple"] = True
            func = click.option(flag, *meta.get("aliases", ()), f.name, **kwargs)(func)
        return func

    return decorate
