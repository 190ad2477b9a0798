"""``compare --tune lr`` on the real clock: each mode's candidate learning rates, each trained
once on a short budget in ``OUT/tuning/<mode>-lr<value>/``, and the pick (``analysis.tuning``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, TextIO

from ..analysis.report import Goal
from ..analysis.tuning import Outcome, choose, grid_of, outcome_of, refine, tried_first
from ..config import CompareConfig
from ..errors import ConfigError
from ..run.process_group import available_cores
from .mode_run import ModeRun
from .progress import CompareProgress

TUNE_MIN_SECONDS = 10.0  # a quarter of a short --budget is mostly start-up
TUNING_DIR = "tuning"


def check(cfg: CompareConfig, goal: Goal, task_name: str) -> None:
    """Refuse what --tune cannot do, before anything runs."""
    if cfg.tune == "none":
        if cfg.tune_budget is not None:
            raise ConfigError("--tune-budget is the budget of --tune lr's candidates: add "
                              "--tune lr, or drop --tune-budget")
        return
    if goal.target is None:
        raise ConfigError(f"--tune lr picks the lr that reaches the target soonest, and task "
                          f"{task_name} has no default target: give --target (e.g. 0.85 for "
                          f"85% {goal.metric.name})")


def tune_budget(cfg: CompareConfig) -> float:
    """Seconds each candidate gets: --tune-budget, else a quarter of --budget, at least
    ``TUNE_MIN_SECONDS``, at most --budget."""
    if cfg.tune_budget is not None:
        return cfg.tune_budget
    return min(cfg.budget, max(TUNE_MIN_SECONDS, cfg.budget / 4))


def grids(cfg: CompareConfig, specs: list, base_lr: float) -> dict:
    """mode -> its candidate lrs."""
    workers = cfg.procs or available_cores()
    return {s.name: grid_of(s, base_lr, workers) for s in specs}


def tune_lrs(cfg: CompareConfig, specs: list, out: Path, extra: dict, goal: Goal,
             base_lr: float, stream: TextIO, train_samples: Optional[int] = None) -> dict:
    """Train every candidate lr of every mode once (seed --seed, ``tune_budget`` seconds,
    stopping at the target) and pick each mode's: mode -> ``analysis.tuning.Choice``."""
    short = dataclasses.replace(cfg, budget=tune_budget(cfg), stop_at_target=True, repeats=1)
    candidates = grids(cfg, specs, base_lr)
    shown = CompareProgress(sum(map(len, candidates.values())), cfg.progress, stream, goal,
                            train_samples)
    choices = {}
    for spec in specs:
        soonest = [short.budget]

        def run(lrs: list, spec=spec) -> list:
            return [_candidate(spec, lr, short, soonest, out, extra, shown, goal)
                    for lr in lrs]

        def trial(lrs: list, leader) -> list:  # the refinement's runs, beyond the grid's
            shown.total += len(lrs)
            return run(lrs)

        choice = refine(run(tried_first(candidates[spec.name], base_lr)),
                        lambda outcomes: choose(outcomes, "time", goal.metric.higher_is_better),
                        trial, lambda text: shown.say(f"tune {spec.name}: {text}"))
        shown.say(f"tune {spec.name}: lr {choice.lr:g} chosen, {choice.why}")
        choices[spec.name] = choice
    return choices


def _candidate(spec, lr: float, short: CompareConfig, soonest: list, out: Path, extra: dict,
               shown: CompareProgress, goal: Goal) -> Outcome:
    """Train one candidate lr; ``soonest[0]``, the budget left to beat the leader, shrinks
    when it reaches the target: a candidate still short of the target when an earlier one
    had reached it cannot win, so it stops there (one evaluation later, so a tie is seen)."""
    run = ModeRun(dataclasses.replace(short, budget=soonest[0]), spec, 0, out / TUNING_DIR,
                  extra, shown, goal, lr=lr, name=f"{spec.slug}-lr{lr:g}")
    run.attempt.label = f"{spec.name} lr {lr:g}"
    run.run()
    outcome = outcome_of(lr, run.attempt, goal, out)
    shown.say(f"tune {spec.name}: lr {lr:g} {_told(outcome, goal)}")
    if outcome.reached:
        soonest[0] = min(soonest[0], outcome.time_to_target + short.eval_every)
    return outcome


def _told(o: Outcome, goal: Goal) -> str:
    if o.reached:
        return (f"reached {goal.label} in {o.time_to_target:.1f} s "
                f"({o.samples_to_target:,.0f} samples)")
    if o.status != "ok":
        return o.status
    best = "no evaluation" if o.best_metric is None else f"best {goal.metric.format(o.best_metric)}"
    return f"did not reach {goal.label} ({best})"
