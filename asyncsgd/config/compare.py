"""Settings of the commands that run or read many runs: compare and plot."""

from __future__ import annotations

from typing import Optional

import click

from .knobs import knob, settings
from .ps import SHARDS
from .shared import (BATCH_SIZE, DATA, EPOCHS, EVAL_EVERY, LR, OUT, PACING, PROGRESS, SEED,
                     TARGET, TASK, TENSORBOARD)
from .training import PROCS

# The modes 'asyncsgd compare' runs by default, in this order.
COMPARE_MODES = "single,hogwild,ps-async,ps-ssp,ps-sync,ddp"

CompareConfig = settings(
    "CompareConfig", "compare", "Settings of ``asyncsgd compare``: every mode on the same "
    "task, seeds and budget.", TASK,
    knob("modes", str, COMPARE_MODES,
         "Comma-separated modes to run, in this order: single, hogwild, ps-async, ps-ssp "
         "(bounded staleness 2; ps-ssp:K for another bound), ps-sync, ps-backup (sync rounds "
         "that do not wait for 1 worker; ps-backup:B for B), ddp. Communicating less: "
         "diloco:H (workers --local-steps H, sync rounds through Nesterov lr 0.7, momentum "
         "0.9; H 8 by default), async-diloco:H (the same, async, delayed Nesterov), ddp+fp16, "
         "ddp+bf16, ddp+powersgd[:RANK] (PyTorch's comm hooks) and ddp-local:H (post-local "
         "SGD); --lr is then the workers' inner lr. Any parameter-server mode +bf16 or +fp16 "
         "(pushes and pulls cast), +int8 or +topk:RATIO (compressed pushes with error "
         "feedback): ps-async+int8, diloco:8+bf16.", metavar="MODE,..."),
    PROCS,
    knob("budget", float, 60.0,
         "Seconds each run gets (its --max-seconds; start-up counts, as a user waits for it "
         "too).", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS"),
    TARGET,
    knob("stop_at_target", bool, False,
         "End each run once it reaches --target instead of using the whole budget (faster; "
         "final scores are then about the target)."),
    knob("tune", str, "none",
         "none: every mode trains with --lr. lr: before the runs, train each mode once per "
         "candidate lr (--lr or the task's, x0.5, x1, x2 and x4; synchronous modes also x "
         "--procs, linear scaling) for --tune-budget seconds, stopping at --target, and run "
         "each mode with the candidate that reached the target soonest (needs a target). "
         "E.g. --tune lr --target 0.85.", type=click.Choice(["none", "lr"])),
    knob("tune_budget", Optional[float], None,
         "Seconds each --tune lr candidate gets (start-up included), e.g. 20; all of them "
         "take about modes x candidates x this.", type=click.FloatRange(min=0, min_open=True),
         metavar="SECONDS", show="a quarter of --budget, at least 10 s, at most --budget"),
    knob("repeats", int, 1,
         "Runs of every mode; repeat r uses seed + r for every mode. The report shows each "
         "figure's median and spread (min–max) over repeats, the plots a median curve in a "
         "min–max band, and the verdict names a winner only where the spreads separate; "
         "e.g. 3.", type=click.IntRange(min=1)),
    SEED, DATA, BATCH_SIZE, LR, EPOCHS, EVAL_EVERY,
    PACING,  # ranks of every parallel mode; single is rank 0
    knob("link", Optional[str], None,
         "Run the ps-* modes' server and each worker, and each ddp rank, on a host of its own "
         "(a network namespace; needs root) whose link to one switch is limited to RATE each "
         "way (tbf): e.g. 100mbit, 1gbit, 500kbit. single and hogwild stay unshaped on one "
         "host. See also 'asyncsgd hosts up'.", metavar="RATE",
         show="none: every process on this host"),
    SHARDS,
    knob("ddp_backend", str, "auto", "torch.distributed backend of the ddp mode.",
         type=click.Choice(["auto", "nccl", "gloo"])),
    knob("mode_args", tuple, (),
         "Extra flags for one mode's command, e.g. 'hogwild=--lock' or 'ps-async=--optimizer "
         "adam'; 'worker=...' goes to every parameter-server worker. May be given several "
         "times.", metavar="MODE=FLAGS", multiple=True),
    knob("grace", float, 60.0,
         "Seconds a run may take beyond --budget to start up and finish before it is stopped "
         "and marked failed.", type=click.FloatRange(min=1), metavar="SECONDS"),
    OUT, TENSORBOARD, PROGRESS,
    module=__name__)

PlotConfig = settings(
    "PlotConfig", "plot", "Settings of ``asyncsgd plot``.", OUT, TARGET,
    knob("allow_mixed", bool, False,
         "Tabulate runs of different tasks together: a task column, speed-ups and verdict "
         "within each task (refused without it)."),
    module=__name__)
