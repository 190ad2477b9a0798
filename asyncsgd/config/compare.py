"""Settings of the commands that run or read many runs: compare and plot."""

from __future__ import annotations

from typing import Optional

import click

from .knobs import knob, settings
from .modes import DC_ASGD
from .ps import SHARDS
from .shared import (ACCUMULATE, BATCH_SIZE, CLIP_GRAD_NORM, DATA, EPOCHS, EVAL_EVERY, LOG_TO,
                     LR, LR_SCHEDULE, OUT, PACING, PROGRESS, SEED, TARGET, TASK, TENSORBOARD,
                     WARMUP)
from .training import PROCS

# The modes 'asyncsgd compare' runs by default, in this order.
COMPARE_MODES = "single,hogwild,ps-async,ps-ssp,ps-sync,ddp"

# The modes 'asyncsgd simulate' runs by default: what the virtual clock is for, synchronous
# against asynchronous at a scale this machine cannot run for real.
SIMULATE_MODES = "ps-async,ps-sync,ps-backup,ddp"

# Rounds of --tune lr's refinement after its grid, each trying at most two lrs (the
# leader's x2 and /2): three doublings cross most of the grid's widest gap at 64 workers
# (a synchronous mode's x4 to x64).
REFINE_ROUNDS = 3

# Settings of every command that runs many modes (compare, simulate), each declared once.
MODES = knob(
    "modes", str, COMPARE_MODES,
    "Comma-separated modes to run, in this order: single, hogwild, ps-async, ps-dc-asgd "
    f"(async, delay-compensated, lambda {DC_ASGD[1]}), ps-ssp "
    "(bounded staleness 2; ps-ssp:K for another bound), ps-sync, ps-backup (sync rounds "
    "that do not wait for 1 worker; ps-backup:B for B, ps-backup:auto for rounds that close "
    "at an adaptive deadline, as --backup-workers auto), ddp. Communicating less: "
    "diloco:H (workers --local-steps H, sync rounds through Nesterov lr 0.7, momentum "
    "0.9; H 8 by default), async-diloco:H (the same, async, delayed Nesterov), "
    "diloco:auto[:H] and async-diloco:auto[:H] (each worker's H sized to its speed, the "
    "fastest's H: --local-steps auto:H, DyLU), ddp+fp16, "
    "ddp+bf16, ddp+powersgd[:RANK] (PyTorch's comm hooks) and ddp-local:H (post-local "
    "SGD); --lr is then the workers' inner lr. Any parameter-server mode +bf16 or +fp16 "
    "(pushes and pulls cast), +int8 or +topk:RATIO (compressed pushes with error "
    "feedback): ps-async+int8, diloco:8+bf16.", metavar="MODE,...", per_command={
        "simulate": dict(default=SIMULATE_MODES, help=(
            "Comma-separated modes to simulate, in this order, named as compare names them: "
            "ps-async, ps-dc-asgd, ps-ssp[:K], ps-sync, ps-backup[:B] (sync rounds that do "
            "not wait for the last B workers; ps-backup:auto: at an adaptive deadline), ddp, "
            "diloco[:H|:auto[:H]], async-diloco[:H|:auto[:H]] (auto: DyLU, each worker's H "
            "sized to its speed), hogwild, single; e.g. "
            "ps-async,ps-sync,ps-backup:4,ddp. A mode the simulator does not model is "
            "refused before anything runs."))})
BUDGET = knob(
    "budget", float, 60.0,
    "Seconds each run gets (its --max-seconds; start-up counts, as a user waits for it "
    "too).", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS", per_command={
        "simulate": dict(default=600.0, help=(
            "Virtual seconds each run may last (of simulated time, not of this machine's; "
            "a run also ends at --target with --stop-at-target, or after --epochs). What a "
            "run costs here is its real gradients: workers x steps."))})
STOP_AT_TARGET = knob(
    "stop_at_target", bool, False,
    "End each run once it reaches --target instead of using the whole budget (faster; "
    "final scores are then about the target).", per_command={
        "simulate": dict(default=True, help=(
            "End each run once it reaches --target (when there is one). On by default here: "
            "simulated time is cheap but each simulated step computes a real gradient, so a "
            "run past its target costs minutes for nothing. --no-stop-at-target runs the "
            "whole --budget."))})
REPEATS = knob(
    "repeats", int, 1,
    "Runs of every mode; repeat r uses seed + r for every mode. The report shows each "
    "figure's median and spread (min–max) over repeats, the plots a median curve in a "
    "min–max band, and the verdict names a winner only where the spreads separate; "
    "e.g. 3.", type=click.IntRange(min=1))
LINK = knob(
    "link", Optional[str], None,
    "Run the ps-* modes' server and each worker, and each ddp rank, on a host of its own "
    "(a network namespace; needs root) whose link to one switch is limited to RATE each "
    "way (tbf): e.g. 100mbit, 1gbit, 500kbit. single and hogwild stay unshaped on one "
    "host. See also 'asyncsgd hosts up'. With --clock virtual: the simulated links' rate "
    "instead (no namespace, no root).", metavar="RATE",
    show="none: every process on this host", per_command={
        "simulate": dict(show="the loopback's, measured (experiments/README.md)", help=(
            "Bandwidth of each simulated link, each way: 25gbit, 100mbit, 3GB/s. Every worker "
            "has its own link to one switch; the server's link is shared, so pushes queue "
            "on it. A transfer of B bytes takes --latency + B / RATE."))})
TUNE = knob(
    "tune", str, "none",
    "none: every mode trains with --lr. lr: before the runs, train each mode once per "
    "candidate lr (--lr or the task's, x0.5, x1, x2 and x4; synchronous modes also x "
    "--procs, asynchronous ones / --procs and / sqrt(--procs)) for --tune-budget seconds, "
    "stopping at --target, then, around a leader that reached it, its x2 and /2 where the "
    f"grid leaves a gap (up to {REFINE_ROUNDS} rounds), and run each mode with the "
    "candidate that reached the target soonest (needs a target). E.g. --tune lr "
    "--target 0.85.",
    type=click.Choice(["none", "lr"]), per_command={
        "simulate": (
            "none: every mode trains with --lr. lr: before the runs, simulate each mode once "
            "per candidate lr (--lr or the task's, x0.5, x1, x2 and x4; synchronous modes "
            "also x --workers, asynchronous ones / --workers and / sqrt(--workers)) for up to "
            "--tune-budget virtual seconds, stopping at --target, then, around a leader "
            "that reached it, its x2 and /2 where the grid leaves a gap (up to "
            f"{REFINE_ROUNDS} rounds), and run each "
            "mode with the candidate that reached the target soonest (needs a target). E.g. "
            "--tune lr --target 0.85.")})
TUNE_BUDGET = knob(
    "tune_budget", Optional[float], None,
    "Seconds each --tune lr candidate gets (start-up included), e.g. 20; all of them "
    "take about modes x candidates x this.", type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS", show="a quarter of --budget, at least 10 s, at most --budget",
    per_command={"simulate": dict(
        help="Virtual seconds each --tune lr candidate may last, e.g. 30.",
        show="a quarter of --budget")})
CLOCK = knob(
    "clock", str, "real",
    "real: every mode runs as processes on this machine and is timed by the wall clock. "
    "virtual: every mode runs in this process under the simulator ('asyncsgd simulate', "
    "docs/simulate.md), with --procs as its workers and the task's cost model measured "
    "here; times are then virtual seconds, and the flags that start or shape processes "
    "(--mode-args, --shards, --ddp-backend, --grace, --tensorboard) are refused.",
    type=click.Choice(["real", "virtual"]))

CompareConfig = settings(
    "CompareConfig", "compare", "Settings of ``asyncsgd compare``: every mode on the same "
    "task, seeds and budget.", TASK,
    MODES,
    PROCS,
    BUDGET,
    TARGET,
    STOP_AT_TARGET,
    TUNE, TUNE_BUDGET,
    REPEATS,
    SEED, DATA, BATCH_SIZE, LR, EPOCHS, EVAL_EVERY,
    PACING,  # ranks of every parallel mode; single is rank 0
    LINK,
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
    CLOCK, OUT, TENSORBOARD, PROGRESS, LOG_TO, LR_SCHEDULE, WARMUP, CLIP_GRAD_NORM, ACCUMULATE,
    module=__name__)

PlotConfig = settings(
    "PlotConfig", "plot", "Settings of ``asyncsgd plot``.", OUT, TARGET,
    knob("allow_mixed", bool, False,
         "Tabulate runs of different tasks together: a task column, speed-ups and verdict "
         "within each task (refused without it)."),
    module=__name__)
