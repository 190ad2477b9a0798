"""``asyncsgd compare``: every mode on the same task, seeds and budget, one after another.

Runs never overlap (they would steal each other's cores), repeats interleave, and the
report is written even after Ctrl-C. What each run gets, and the directory it writes,
are in docs/compare.md.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

from ..analysis.fairness import caveat, fairness_notes
from ..analysis.publish import publish
from ..analysis.report import BASELINE, Goal
from ..analysis.tuning import render_tuning
from ..config import CompareConfig
from ..core.pacing import Pacing
from ..core.schedule import schedule
from ..core.tasks import task_of
from ..errors import ConfigError
from ..run.link import Link
from ..run.loggers import check_loggers
from ..run.process_group import available_cores
from ..run.rundir import RunDir, environment
from ..run.signals import sigterm_as_interrupt
from . import linked, tuner
from .mode_run import ModeRun
from ..config.modes import parse_mode_args, parse_modes
from .progress import CompareProgress
from .virtual import compare_virtual


@dataclass
class CompareResult:
    out: Path
    table: str
    attempts: list
    tuning: dict = field(default_factory=dict)  # --tune lr: mode -> analysis.tuning.Choice

    @property
    def failed(self) -> list:
        return [a for a in self.attempts if not a.ok]


def _compare_dir(out: Optional[str]) -> Path:
    if out is not None and Path(out).exists() and any(Path(out).iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new directory")
    return RunDir.create(out, "compare").path


def compare(cfg: CompareConfig, argv: Optional[list] = None,
            stream: TextIO = sys.stderr) -> CompareResult:
    """Run every mode of ``cfg.modes`` ``cfg.repeats`` times and write the report; with
    ``cfg.clock`` virtual, in the simulator (``virtual.py``)."""
    if cfg.clock == "virtual":
        result = compare_virtual(cfg, argv, stream)
        return CompareResult(result.out, result.table, result.attempts)
    specs = parse_modes(cfg.modes)
    extra = parse_mode_args(cfg.mode_args, specs)
    Pacing.parse(cfg.slowdown, cfg.delay).check_ranks(cfg.procs or available_cores(), "--procs")
    Link.parse(cfg.link)
    if any(s.command in linked.SHAPED_COMMANDS for s in specs):  # else nothing to shape
        linked.check_link(cfg.link, cfg.ddp_backend)
    # Fails early on a bad task, and generates and caches its data outside every budget.
    task = task_of(cfg)
    goal = Goal(task.metric, cfg.target if cfg.target is not None else task.default_target)
    try:
        task.metric.check_target(goal.target)
    except ValueError as exc:
        raise ConfigError(f"{exc} (task {task.name} scores {task.metric.name})") from None
    if cfg.stop_at_target and goal.target is None:
        raise ConfigError(f"--stop-at-target needs --target: task {task.name} has no default "
                          f"target (its metric: {task.metric.name})")
    tuner.check(cfg, goal, task.name)
    if cfg.tensorboard:
        _check_tensorboard()
    check_loggers(cfg.log_to)  # before the first run rather than in every run
    # its modes count steps differently: a schedule every one of them knows, or none
    schedule(1.0, cfg.lr_schedule, cfg.warmup)
    out = _compare_dir(cfg.out)
    header = {"command": argv if argv is not None else sys.argv, "config": dataclasses.asdict(cfg),
              "task": {"name": cfg.task, "train_samples": len(task.train),
                       "test_samples": len(task.test), "lr": cfg.lr or task.lr,
                       "batch_size": cfg.batch_size or task.batch_size,
                       "metric": task.metric.describe(), "target": goal.target},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **environment()}
    if cfg.link is not None:  # runs: each ps-*/ddp run's hosts and their links' byte counts
        header["link"] = {"rate": cfg.link, "tbf": Link.parse(cfg.link).tbf(), "runs": {}}
    # what the conditions did to the modes: the report's first lines (analysis/fairness.py)
    procs, cores = cfg.procs or available_cores(), available_cores()
    def fairness(tuned: Optional[dict]) -> list:
        return fairness_notes(procs, cores, specs, tuned, lr=cfg.lr or task.lr,
                              shards=cfg.shards, own_lr=_own_lr(specs, extra))

    # with --tune lr, the line naming each mode's lr is known once the tuning is done
    notes = fairness({} if cfg.tune == "lr" else None)
    header["fairness"] = notes
    # each run's directory -> the Unix time its first process was launched: its clock's origin
    header["launched"] = {}
    (out / "compare.json").write_text(json.dumps(header, indent=2, default=str) + "\n")
    total = len(specs) * cfg.repeats
    shown = CompareProgress(total, cfg.progress, stream, goal, len(task.train))
    base_lr = cfg.lr or task.lr
    for note in notes:
        shown.say(note)
    if cfg.tune == "lr":
        tries = sum(map(len, tuner.grids(cfg, specs, base_lr).values()))
        shown.say(f"compare: --tune lr first: {tries} candidate run(s) of up to "
                  f"{tuner.tune_budget(cfg):g} s each, stopping at {goal.label}, into "
                  f"{out / tuner.TUNING_DIR}")
    shown.say(f"compare: {len(specs)} mode(s) x {cfg.repeats} repeat(s) = {total} run(s) of "
              f"{cfg.budget:g} s each on {task.name}, one after another; writing {out}")
    if cfg.tensorboard:
        shown.say(f"TensorBoard: each run writes {out}/<mode>-r<k>/tensorboard; view them "
                  f"together with: tensorboard --logdir {out}")
    attempts: list = []
    choices: dict = {}
    interrupted = False
    try:
        with sigterm_as_interrupt():
            if cfg.tune == "lr":
                choices = tuner.tune_lrs(cfg, specs, out, extra, goal, base_lr, stream,
                                         len(task.train))
                header["tuning"] = {mode: {**c.to_dict(), "budget": tuner.tune_budget(cfg)}
                                    for mode, c in choices.items()}
                notes = header["fairness"] = fairness({m: c.lr for m, c in choices.items()})
            # Repeats interleave (all modes, then all modes again): drift of a shared
            # machine then spreads over every mode instead of favouring one.
            for repeat in range(cfg.repeats):
                for spec in specs:
                    lr = choices[spec.name].lr if choices else None
                    run = ModeRun(cfg, spec, repeat, out, extra, shown, goal, lr=lr)
                    if choices:  # the table's rows say each mode's lr
                        run.attempt.label = _tuned_label(spec.name, lr)
                    attempts.append(run.attempt)
                    try:
                        run.run()
                    finally:
                        if run.traffic is not None:
                            header["link"]["runs"][f"{spec.name} r{repeat + 1}"] = run.traffic
                        if run.launched_wall is not None:
                            header["launched"][run.run_dir.name] = round(run.launched_wall, 3)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:  # also after Ctrl-C or SIGTERM: report what ran
        if attempts:
            sections = render_tuning(choices, goal, tuner.tune_budget(cfg), cfg.seed) \
                if choices else []
            table = publish(out, _title(cfg, cfg.task), [*_paragraphs(notes), *_intro(cfg, header)],
                            attempts, goal, header, caveat=caveat(procs, cores, specs),
                            sections=tuple(sections),
                            baseline=_tuned_label(BASELINE, choices[BASELINE].lr)
                            if BASELINE in choices else BASELINE)
        if interrupted:
            shown.say(f"interrupted; the report of the runs so far: {out / 'report.md'}"
                      if attempts else f"interrupted while tuning; the candidate runs so "
                      f"far: {out / tuner.TUNING_DIR}")
    return CompareResult(out, table, attempts, choices)


def _tuned_label(mode: str, lr: float) -> str:
    return f"{mode} (lr {lr:g})"


def _paragraphs(lines: list) -> list:
    """Each line a paragraph of its own in report.md."""
    return [part for line in lines for part in (line, "")]


def _own_lr(specs: list, extra: dict) -> tuple:
    """The modes whose --mode-args set their own learning rate (a ps-* mode's workers
    too, through 'worker=')."""
    def sets_lr(flags) -> bool:
        return any(f.split("=")[0] in ("--lr", "--local-lr") for f in flags or ())

    return tuple(s.name for s in specs if sets_lr(extra.get(s.name)) or
                 (s.command == "ps-server" and sets_lr(extra.get("worker"))))


def _check_tensorboard() -> None:
    """--tensorboard: fail before the first run rather than in every run."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install "
                          "tensorboard (or drop --tensorboard)") from exc


def _title(cfg: CompareConfig, task: str) -> str:
    pacing = Pacing.parse(cfg.slowdown, cfg.delay)
    return (f"asyncsgd compare: {task}, {cfg.procs or available_cores()} processes"
            + (f", {pacing.describe()}" if pacing.active else "")
            + (f", {cfg.link} links" if cfg.link else ""))


def _intro(cfg: CompareConfig, header: dict) -> list:
    versions, host = header["versions"], header["host"]
    task = header["task"]
    lr = "lr tuned per mode: see Learning rates" if header.get("tuning") else f"lr {task['lr']:g}"
    return [
        f"Every mode trained `{task['name']}` ({task['train_samples']:,} training / "
        f"{task['test_samples']:,} test samples) for a budget of {cfg.budget:g} s (start-up "
        f"included), one run after another, with plain SGD ({lr}, batch "
        f"{task['batch_size']} per process), seeds {cfg.seed}..{cfg.seed + cfg.repeats - 1} "
        f"(same model initialisation and data order in every mode), evaluating every "
        f"{cfg.eval_every:g} s. single steps on the same batch as each process; ddp averages "
        f"one per rank into each update "
        f"(global batch {task['batch_size']} x ranks), Hogwild and the PS apply every "
        f"process's gradient on its own. Every process, single's too, runs "
        f"{max(1, available_cores() // (cfg.procs or available_cores()))} torch thread(s)."
        + _stragglers(cfg),
        "",
        f"Host: {host['hostname']}, {host['cpus']} CPUs, "
        f"{'GPUs: ' + ', '.join(host['gpus']) if host.get('gpus') else 'no GPU'}; "
        f"torch {versions['torch']}, asyncsgd {versions['asyncsgd']}.",
        "",
        "Command: `" + " ".join(shlex.quote(str(a)) for a in header["command"]) + "`",
    ] + (["", linked.describe(Link.parse(cfg.link), header["link"]["runs"])]
         if cfg.link else [])


def _stragglers(cfg: CompareConfig) -> str:
    pacing = Pacing.parse(cfg.slowdown, cfg.delay)
    if not pacing.active:
        return ""
    return (f" Stragglers staged in every parallel mode: {pacing.describe()} (a slowed rank "
            "waits after computing each gradient; single, rank 0 alone, gets what rank 0 is "
            "given).")
