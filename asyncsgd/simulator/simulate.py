"""``asyncsgd simulate``: every mode × repeat on the virtual clock, one after another, and
their compare-style report.

The cost model is parsed once, as the command starts (the parts not given are the task's
profile); then each run goes through ``simulate_run`` into OUT/<mode>-r<k>/, and the
report is written even after Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from ..analysis.fairness import fairness_notes
from ..analysis.publish import publish
from ..analysis.tuning import choose, grid_of, outcome_of, refine, render_tuning
from ..analysis.report import Attempt, Goal
from ..config import NO_EPOCH_LIMIT, SimulateConfig
from ..config.modes import parse_modes
from ..config.simulate import check_ranks, parse_join, parse_leave, parse_slow_workers
from ..core.pacing import Pacing
from ..core.schedule import schedule
from ..core.tasks import load_task
from ..errors import AsyncSGDError, ConfigError
from ..run.rundir import RunDir, environment
from ..run.signals import sigterm_as_interrupt
from . import VirtualSetup, profile, simulate_run  # the engine, as the package re-exports it
from .cost_model import Given, cost_model, costs_record
from .race import race
from .run import finish, one_thread, prepare
from .costs import Costs
from .engine import wire_suffix

AUTO_EVAL_STEPS = 50  # --eval-every's default, in median step times


@dataclass
class SimulateResult:
    """The report's directory, its table, every attempt, and the cost model they ran under."""

    out: Path
    table: str
    attempts: list
    costs: Costs

    @property
    def failed(self) -> list:
        return [a for a in self.attempts if not a.ok]


def check_modes(specs: list) -> None:
    """Refuse, before anything runs, a mode the simulator does not model: what changes
    the bytes on the wire or DDP's communication (+int8, +topk, +bf16, +fp16, ddp's comm
    hooks and post-local SGD) has no cost model here."""
    for spec in specs:
        if wire_suffix(spec) or spec.name.startswith("ddp-local"):
            raise ConfigError(f"--modes: the virtual clock does not model {spec.name} (no cost "
                              "model for compressed or cast traffic, DDP's comm hooks or "
                              "post-local SGD); simulate single, hogwild, ps-async, "
                              "ps-dc-asgd, ps-ssp[:K], "
                              "ps-sync, ps-backup[:B|:auto] (each +balance), ddp, "
                              "ddp+balance, diloco[:H|:auto[:H]] or "
                              "async-diloco[:H|:auto[:H]] (a parameter-server mode also "
                              "+dynamic), "
                              "or run it with the real clock")


def _out_dir(out: Optional[str], command: str) -> Path:
    if out is not None and Path(out).exists() and any(Path(out).iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new directory")
    return RunDir.create(out, command).path


class Shown:
    """A line per run as it starts and as it ends (each run draws its own progress)."""

    def __init__(self, total: int, style: str, stream: TextIO):
        self.total, self.stream, self.index = total, stream, 0
        self.quiet = style == "off"

    def say(self, text: str) -> None:
        if not self.quiet:
            self.stream.write(text + "\n")
            self.stream.flush()

    def starting(self, attempt: Attempt, repeats: int) -> None:
        self.index += 1
        self.say(f"[{self.index}/{self.total}] {attempt.label}"
                 + (f", repeat {attempt.repeat + 1}/{repeats}" if repeats > 1 else "")
                 + f" (seed {attempt.seed}): simulating")

    def finished(self, attempt: Attempt, goal: Goal) -> None:
        took = f"in {attempt.seconds:.1f} s of real time"
        if not attempt.ok:
            self.say(f"[{self.index}/{self.total}] {attempt.label} {attempt.status.upper()} "
                     f"{took}: {attempt.error}")
            return
        numbers, metric = attempt.run.numbers(goal), goal.metric
        reached = numbers["time_to_target"]
        score = ("" if numbers["final_metric"] is None else
                 f": final test {metric.name} {metric.format(numbers['final_metric'])}")
        if reached is not None:
            score += f", {goal.label} at {reached:.2f} virtual s"
        self.say(f"[{self.index}/{self.total}] {attempt.label} done {took}{score}")


def simulate(cfg: SimulateConfig, argv: Optional[list] = None, stream: TextIO = sys.stderr,
             command: str = "simulate") -> SimulateResult:
    """Simulate every mode of ``cfg.modes`` ``cfg.repeats`` times and write the report.
    ``command``: what the report and its directory are named after (``compare`` hands
    its --clock virtual here)."""
    specs = parse_modes(cfg.modes)
    check_modes(specs)
    Pacing.parse(cfg.slowdown, cfg.delay).check_ranks(cfg.workers, "--workers")
    leave, join = parse_leave(cfg.leave), parse_join(cfg.join)
    check_ranks(leave, cfg.workers)
    given = Given.of(cfg)
    task = _task(cfg, cfg.seed)
    goal = Goal(task.metric, cfg.target if cfg.target is not None else task.default_target,
                clock="virtual")
    try:
        task.metric.check_target(goal.target)
    except ValueError as exc:
        raise ConfigError(f"{exc} (task {task.name} scores {task.metric.name})") from None
    if cfg.tune == "lr" and goal.target is None:
        raise ConfigError(f"--tune lr picks the lr that reaches the target soonest, and task "
                          f"{task.name} has no default target: give --target")
    if cfg.tune == "none" and cfg.tune_budget is not None:
        raise ConfigError("--tune-budget is the budget of --tune lr's candidates: add --tune "
                          "lr, or drop --tune-budget")
    schedule(1.0, cfg.lr_schedule, cfg.warmup)  # one every mode knows: refused before any work
    costs, measured = cost_model(cfg, given, task)
    eval_every = cfg.eval_every or AUTO_EVAL_STEPS * costs.step.median
    out = _out_dir(cfg.out, command)
    header = {"command": argv if argv is not None else sys.argv, "clock": "virtual",
              "config": dataclasses.asdict(cfg),
              "task": {"name": cfg.task, "train_samples": len(task.train),
                       "test_samples": len(task.test), "lr": cfg.lr or task.lr,
                       "batch_size": cfg.batch_size or task.batch_size,
                       "metric": task.metric.describe(), "target": goal.target},
              "costs": costs_record(costs, measured),
              "eval_every": eval_every,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **environment()}
    (out / f"{command}.json").write_text(json.dumps(header, indent=2, default=str) + "\n")
    total = len(specs) * cfg.repeats
    shown = Shown(total, cfg.progress, stream)
    shown.say(f"{command}: {len(specs)} mode(s) x {cfg.repeats} repeat(s) = {total} run(s) "
              f"of {cfg.workers} simulated workers on {task.name}, virtual clock, budget "
              f"{cfg.budget:g} virtual s each; writing {out}")
    attempts: list = []
    choices: dict = {}
    table, interrupted = "", False
    base = VirtualSetup(workers=cfg.workers, seed=cfg.seed, costs=costs, lr=cfg.lr,
                        target=goal.target, max_seconds=cfg.budget,
                        epochs=cfg.epochs or NO_EPOCH_LIMIT, eval_every=eval_every,
                        batch_size=cfg.batch_size,
                        stop_at_target=cfg.stop_at_target and goal.target is not None,
                        leave=leave, join=join, record_digests=cfg.record_digests,
                        lr_schedule=cfg.lr_schedule, warmup=cfg.warmup,
                        clip_grad_norm=cfg.clip_grad_norm, accumulate=cfg.accumulate)
    try:
        with sigterm_as_interrupt():
            if cfg.tune == "lr":
                choices = _tune(cfg, specs, task, base, out, argv, goal, stream)
                header["tuning"] = {m: {**c.to_dict(), "budget": _tune_budget(cfg)}
                                    for m, c in choices.items()}
            for repeat in range(cfg.repeats):  # interleaved, as compare's
                seed = cfg.seed + repeat
                run_task = task if seed == cfg.seed else _task(cfg, seed)
                for spec in specs:
                    lr = choices[spec.name].lr if choices else cfg.lr
                    label = f"{spec.name} (lr {lr:g})" if choices else spec.name
                    attempt = Attempt(label, repeat, seed,
                                      run_dir=str(out / f"{spec.slug}-r{repeat + 1}"))
                    attempts.append(attempt)
                    _run(attempt, run_task, spec, dataclasses.replace(base, seed=seed, lr=lr),
                         cfg, argv, shown, goal)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:  # also after Ctrl-C or SIGTERM: report what ran
        if attempts:
            notes = fairness_notes(cfg.workers, cfg.workers, specs,
                                   {m: c.lr for m, c in choices.items()} if choices else None,
                                   lr=cfg.lr or task.lr, real_clock=False)
            header["fairness"] = notes
            sections = render_tuning(choices, goal, _tune_budget(cfg), cfg.seed) \
                if choices else []
            table = publish(out, title(cfg, command),
                            [*(p for n in notes for p in (n, "")),
                             *intro(cfg, header, costs, measured)],
                            attempts, goal, header, sections=tuple(sections))
        if interrupted:
            shown.say(f"interrupted; the report of the runs so far: {out / 'report.md'}")
    return SimulateResult(out, table, attempts, costs)


def _tune_budget(cfg: SimulateConfig) -> float:
    """Virtual seconds of each --tune lr candidate: --tune-budget, else a quarter of
    --budget."""
    return cfg.tune_budget if cfg.tune_budget is not None else cfg.budget / 4


def _tune(cfg: SimulateConfig, specs: list, task, base: VirtualSetup, out: Path,
          argv: Optional[list], goal: Goal, stream: TextIO) -> dict:
    """Each mode's candidate lrs race on the virtual clock (seed --seed, up to
    ``_tune_budget``, into OUT/tuning/): they advance together, an evaluation interval at a
    time, and once one reaches the target the others stop there, so a mode's tuning costs
    about its candidates x the winner's run, however hopeless the others. Then up to
    REFINE_ROUNDS races of the leader's x2 and /2 where the grid has no lr that near
    (``analysis.tuning.refine``). -> mode -> Choice"""
    short = dataclasses.replace(base, max_seconds=_tune_budget(cfg), stop_at_target=True)
    shown = Shown(len(specs), cfg.progress, stream)
    choices = {}
    for spec in specs:
        grid = grid_of(spec, cfg.lr or task.lr, cfg.workers)
        shown.say(f"tune {spec.name}: lr {', '.join(f'{lr:g}' for lr in grid)} race for up "
                  f"to {short.max_seconds:g} virtual s, stopping at {goal.label}")

        def trial(lrs: list, leader=None, spec=spec) -> list:
            # a refining candidate still short of the target one evaluation after the
            # leader had reached it cannot win: it stops there
            cap = (leader.chosen.time_to_target + base.eval_every
                   if leader is not None and leader.chosen.reached else short.max_seconds)
            return _race(spec, lrs, task,
                         dataclasses.replace(short, max_seconds=min(cap, short.max_seconds)),
                         out, argv, goal, shown)

        choice = refine(trial(grid),
                        lambda outcomes: choose(outcomes, "time", goal.metric.higher_is_better,
                                                unit=goal.unit),
                        trial, lambda text, spec=spec: shown.say(f"tune {spec.name}: {text}"))
        choices[spec.name] = choice
        shown.say(f"tune {spec.name}: lr {choice.lr:g} chosen, {choice.why}")
    return choices


def _race(spec, lrs: list, task, short: VirtualSetup, out: Path, argv: Optional[list],
          goal: Goal, shown: Shown) -> list:
    """Race the candidates ``lrs`` of ``spec`` into OUT/tuning/: their Outcomes."""
    racers = {lr: prepare(task, spec, dataclasses.replace(short, lr=lr),
                          out=str(out / "tuning" / f"{spec.slug}-lr{lr:g}"),
                          progress="off", argv=argv) for lr in lrs}
    with one_thread():
        errors = race(racers, short.eval_every,
                      lambda text: shown.say(f"tune {spec.name}: {text}"))
    outcomes = []
    for lr, engine in racers.items():
        attempt = Attempt(f"{spec.name} lr {lr:g}", 0, short.seed,
                          run_dir=str(out / "tuning" / f"{spec.slug}-lr{lr:g}"))
        try:
            with one_thread():
                finish(engine, played=True, error=errors.get(lr))
        except AsyncSGDError as exc:
            attempt.status, attempt.error = "failed", str(exc)
        attempt.read_back()
        outcomes.append(outcome_of(lr, attempt, goal, out))
        shown.say(f"tune {spec.name}: lr {lr:g} " + (
            f"reached {goal.label} at {outcomes[-1].time_to_target:.3g} virtual s"
            if outcomes[-1].reached else "failed: " + str(errors[lr]).split(":")[0]
            if lr in errors else f"did not reach {goal.label}"))
    return outcomes


def _task(cfg: SimulateConfig, seed: int):
    return load_task(cfg.task, samples=cfg.samples, data_dir=cfg.data_dir,
                     cache_dir=cfg.cache_dir, seed=seed)


def _run(attempt: Attempt, task, spec, setup: VirtualSetup, cfg: SimulateConfig,
         argv: Optional[list], shown: Shown, goal: Goal) -> None:
    """One run into ``attempt.run_dir``; ``attempt`` says how it went, even if interrupted.
    A run that fails (its task raised) is recorded and the others go on; a bad setting
    stops them all."""
    shown.starting(attempt, cfg.repeats)
    began = time.monotonic()
    try:
        simulate_run(task, spec, setup, out=attempt.run_dir, progress=cfg.progress,
                     argv=argv)
    except KeyboardInterrupt:
        attempt.status, attempt.error = "interrupted", "interrupted by the user"
        raise
    except ConfigError:
        attempt.status, attempt.error = "failed", "refused its settings"
        raise
    except AsyncSGDError as exc:
        attempt.status, attempt.error = "failed", str(exc)
    finally:
        attempt.seconds = time.monotonic() - began
        attempt.read_back()
        shown.finished(attempt, goal)


def title(cfg: SimulateConfig, command: str = "simulate") -> str:
    pacing = Pacing.parse(cfg.slowdown, cfg.delay)
    return (f"asyncsgd {command}: {cfg.task}, {cfg.workers} simulated workers, virtual clock"
            + (f", {pacing.describe()}" if pacing.active else "")
            + (", {:g} of the workers {:g}x slower".format(*parse_slow_workers(
                cfg.slow_workers)) if cfg.slow_workers else ""))


def intro(cfg: SimulateConfig, header: dict, costs: Costs, measured: frozenset) -> list:
    task, host, versions = header["task"], header["host"], header["versions"]
    last = cfg.seed + cfg.repeats - 1
    faults = [f"worker {rank} leaves at {t:g} virtual s" for t, rank in parse_leave(cfg.leave)]
    faults += [f"a worker joins at {t:g} virtual s" for (t,) in parse_join(cfg.join)]
    return [
        f"Virtual clock: every mode ran in one process under the simulator, {cfg.workers} "
        f"simulated workers each, training `{task['name']}` ({task['train_samples']:,} "
        f"training / {task['test_samples']:,} test samples) for real with plain SGD (lr "
        f"{task['lr']:g}, batch {task['batch_size']} per worker), seeds {cfg.seed}..{last}; "
        f"only time is simulated. Every time in this report is in virtual seconds: a budget "
        f"of {cfg.budget:g} virtual s a run, an evaluation every {header['eval_every']:.3g} "
        "virtual s" + (", each run ending at the target" if cfg.stop_at_target and
                       task["target"] is not None else "") + ".",
        "",
        "The cost model (docs/simulate.md says how each part is used):",
        "",
        *profile.describe(costs, measured),
        *([f"- faults: {'; '.join(faults)}"] if faults else []),
        "",
        f"Host: {host['hostname']}, {host['cpus']} CPUs; torch {versions['torch']}, asyncsgd "
        f"{versions['asyncsgd']}.",
        "",
        "Command: `" + " ".join(shlex.quote(str(a)) for a in header["command"]) + "`",
    ]
