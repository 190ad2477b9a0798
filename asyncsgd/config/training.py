"""Settings of the modes that run the SGD loop on this host: hogwild, single and ddp."""

from __future__ import annotations

from typing import Optional

import click

from .knobs import knob, settings
from .shared import AMP, BALANCE, DATA_DISPATCH, LOCAL_STEPS, RECORD_DIGESTS, TrainConfig
from .values import CheckedText, parse_comm_hook


def default_start_method() -> str:
    """forkserver where the platform has it (Linux, macOS), else spawn. Never fork: the
    training parent runs threads (progress, evaluation) that a fork would copy mid-step."""
    import multiprocessing
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


PROCS = knob(
    "procs", Optional[int], None, "Training processes sharing one model.",
    type=click.IntRange(min=1), show="CPU cores", per_command={
        "ddp": dict(help="Processes (ranks) to spawn on this host, one per GPU with --device "
                    "cuda. Under torchrun, WORLD_SIZE decides and this must be left out or "
                    "match it.", show="GPUs with --device cuda, else CPU cores"),
        "compare": "Processes (Hogwild, DDP) or parameter-server workers of every parallel "
                   "mode; each gets CPU cores // procs torch threads. 'single' runs one "
                   "process with as many threads as each of these (one of them alone)."})
# Forkserver starts workers much sooner than spawn (experiments/README.md, "Start-up and
# exit").
START_METHOD = knob(
    "start_method", str, default_start_method(),
    "How worker processes start: forkserver (one fresh server imports torch once and forks "
    "each worker; the default where the platform has it) or spawn (a fresh interpreter "
    "each, importing torch again).", type=click.Choice(["spawn", "forkserver"]))

HogwildConfig = settings(
    "HogwildConfig", "hogwild", "Settings of ``asyncsgd hogwild``.", PROCS, START_METHOD,
    knob("lock", bool, False, "Take one shared lock around every update: the locked baseline "
         "that shows what lock-free Hogwild buys."),
    knob("share_cores", str, "auto",
         "How more processes than cores share them: 'ring' passes one run token per core "
         "round-robin every --quantum-ms, so processes don't thrash; 'os' leaves it to the "
         "kernel scheduler; 'auto' uses the ring when processes outnumber cores.",
         type=click.Choice(["auto", "ring", "os"])),
    knob("quantum_ms", float, 250.0,
         "Milliseconds a process computes before passing its run token on (ring only). Each "
         "switch costs: short quanta lose throughput.", type=click.FloatRange(min=1)),
    DATA_DISPATCH, AMP,
    extends=TrainConfig, module=__name__)

SingleConfig = settings(
    "SingleConfig", "single", "Settings of ``asyncsgd single``: plain SGD in one process, the "
    "reference baseline.",
    AMP,
    knob("optimizer", str, "sgd",
         "Update rule: sgd (with --momentum) or adam (betas 0.9/0.999, eps 1e-8: the "
         "parameter server's adam rule). Pick the lr for it: adam wants ~1e-3.",
         type=click.Choice(["sgd", "adam"])),
    knob("simulate_staleness", int, 0,
         "single only: apply each gradient this many steps after it was computed, as if that "
         "many other workers' updates came between a worker's pull and its push (Dai et al. "
         "2019): statistical efficiency under staleness, apart from throughput. The first "
         "STEPS steps apply nothing and the last STEPS gradients are never applied; the "
         "checkpoint holds the queue, so --resume applies the gradients in flight.",
         type=click.IntRange(min=0), metavar="STEPS"),
    RECORD_DIGESTS,
    extends=TrainConfig, module=__name__)

DDPConfig = settings(
    "DDPConfig", "ddp", "Settings of ``asyncsgd ddp``: synchronous data-parallel SGD "
    "(DistributedDataParallel).", PROCS, START_METHOD,
    knob("backend", str, "auto",
         "Collective backend: nccl (CUDA tensors, one process per GPU) or gloo (CPU). auto "
         "picks nccl with --device cuda when there are at least as many GPUs as processes on "
         "this host, else gloo.", type=click.Choice(["auto", "nccl", "gloo"])),
    knob("comm_hook", str, "allreduce",
         "How DDP's gradient all-reduce travels, with PyTorch's own communication hooks: "
         "allreduce (float32), fp16 (fp16_compress_hook: half the bytes), bf16 "
         "(bf16_compress_hook; NCCL only) or powersgd[:RANK] (PowerSGD, rank-RANK "
         "approximations of each matrix, with error feedback; rank 1 by default).",
         type=CheckedText("HOOK", parse_comm_hook),
         metavar="allreduce|fp16|bf16|powersgd[:RANK]"),
    LOCAL_STEPS, BALANCE,
    knob("local_warmup", int, 0,
         "Steps of ordinary DDP before --local-steps begins (post-local SGD's warm-up).",
         type=click.IntRange(min=0)),
    knob("dist_timeout", float, 300.0,
         "Seconds a rank waits in a collective (or to join the group) before it gives up "
         "with an error, so a hung rank cannot hang the others forever. Must exceed the "
         "longest pause of rank 0 (evaluation, checkpoint).", type=click.FloatRange(min=1)),
    extends=SingleConfig, module=__name__)
