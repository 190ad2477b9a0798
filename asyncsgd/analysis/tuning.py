"""Choosing each mode's learning rate: the grid of candidates, and the pick among their outcomes.

Pure: the candidates' figures come from whoever ran them (real processes or a virtual clock).
"""

from __future__ import annotations

import math
import os

from dataclasses import asdict, dataclass
from typing import Optional

from ..config.compare import REFINE_ROUNDS
from ..config.modes import ModeSpec
from .report import DASH, Attempt, Goal

# A log grid around the task's lr: x0.5 .. x4 (issue 37's measured optimum for ddp was x2-4).
GRID_FACTORS = (0.5, 1.0, 2.0, 4.0)
CRITERIA = {"time": ("time_to_target", "samples_to_target"),
            "samples": ("samples_to_target", "time_to_target")}


def is_synchronous(spec: ModeSpec) -> bool:
    """The mode averages the gradients (or models) of several workers into each step, so it
    takes fewer steps per sample and wants a larger lr: ddp and its variants, ps-sync,
    ps-backup, diloco."""
    return spec.command == "ddp" or (spec.command == "ps-server" and spec.consistency == "sync")


def _clean(x: float) -> float:
    """0.1 * 3 is 0.30000000000000004: 12 significant digits name the lr as people write it."""
    return float(f"{x:.12g}")


def grid_of(spec, base_lr: float, workers: int) -> list:
    """``lr_grid`` of a mode (a ``config.modes.ModeSpec``): single is one process, whatever
    the others' workers."""
    return lr_grid(base_lr, is_synchronous(spec), 1 if spec.command == "single" else workers)


def lr_grid(base_lr: float, synchronous: bool, workers: int) -> list:
    """base x {0.5, 1, 2, 4}; for a synchronous mode also base x workers (linear scaling),
    for an asynchronous one base / workers and base / sqrt(workers) (a gradient N - 1
    updates stale wants a smaller step: Zhang et al. 2016's staleness-aware lr divides by
    the staleness; the square root is the middle ground); sorted, each lr once."""
    factors = GRID_FACTORS + ((float(workers),) if synchronous else
                              (1.0 / workers, workers ** -0.5))
    return sorted({_clean(base_lr * f) for f in factors})


def refined(tried, chosen: float) -> list:
    """What to try next around the ``chosen`` lr: twice it, and half it, on each side where
    no lr ``tried`` lies within that factor. The grid is coarse where its rules leave gaps
    (at 64 workers a synchronous mode's candidates jump from x4 to x64) and ends somewhere:
    a best lr between or beyond them would otherwise go unseen. Empty once the chosen lr
    has a tried neighbour within 2x on both sides."""
    above = any(chosen < lr <= 2 * chosen * (1 + 1e-9) for lr in tried)
    below = any(chosen / 2 * (1 - 1e-9) <= lr < chosen for lr in tried)
    return [_clean(x) for x, covered in ((chosen / 2, below), (chosen * 2, above))
            if not covered]


def refine(outcomes: list, pick, trial, say) -> "Choice":
    """The grid's ``outcomes`` picked (``pick``: outcomes -> Choice), then up to
    REFINE_ROUNDS rounds of ``trial(lrs, leader)`` -> the outcomes of the lrs ``refined``
    names around the leader, until it names none. Only around a leader that reached the
    target: one picked by its best score alone often ties the others (a short budget under
    load evaluates each once), and refining around a tie walks towards ever smaller lrs.
    ``say`` tells each round."""
    choice = pick(outcomes)
    for _ in range(REFINE_ROUNDS):
        more = refined([o.lr for o in outcomes], choice.lr) if choice.chosen.reached else []
        if not more:
            break
        say(f"lr {choice.lr:g} leads; refining with lr {', '.join(f'{lr:g}' for lr in more)}")
        outcomes = outcomes + trial(more, choice)
        choice = pick(outcomes)
    return choice



@dataclass(frozen=True)
class Outcome:
    """One candidate lr's short run: its figures to the target (None: not reached) and its
    final and best scores (None: no evaluation, e.g. it failed)."""

    lr: float
    time_to_target: Optional[float] = None
    samples_to_target: Optional[float] = None
    final_metric: Optional[float] = None
    best_metric: Optional[float] = None
    status: str = "ok"
    run_dir: Optional[str] = None

    @property
    def reached(self) -> bool:
        return self.time_to_target is not None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Choice:
    """The chosen candidate, why, and every candidate (the table the report shows)."""

    chosen: Outcome
    criterion: str
    why: str
    outcomes: tuple

    @property
    def lr(self) -> float:
        return self.chosen.lr

    def to_dict(self) -> dict:
        return {"chosen": self.lr, "criterion": self.criterion, "why": self.why,
                "candidates": [o.to_dict() for o in self.outcomes]}


def outcome_of(lr: float, attempt: Attempt, goal: Goal, out) -> Outcome:
    """A candidate's figures from its ended ``attempt`` (none when it failed), its
    directory named relative to the report's ``out``."""
    numbers = attempt.run.numbers(goal) if attempt.ok else {}
    where = os.path.relpath(attempt.run_dir, out) if attempt.run_dir else None
    return Outcome(lr, numbers.get("time_to_target"), numbers.get("samples_to_target"),
                   numbers.get("final_metric"), numbers.get("best_metric"), attempt.status,
                   where)


def choose(outcomes, criterion: str = "time", higher_is_better: bool = True,
           unit: str = "s") -> Choice:
    """The best of ``outcomes`` by ``criterion`` ("time" or "samples" to the target, the other
    breaking ties): a candidate that reached the target beats every one that did not; among
    those that did not, the better best score wins (``higher_is_better``: the metric's
    direction). Ties go to the smaller lr: of two equally good rates the smaller is further
    from divergence, which a short run may not have shown yet."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion {criterion!r}: choose from {', '.join(CRITERIA)}")
    outcomes = tuple(sorted(outcomes, key=lambda o: o.lr))
    if not outcomes:
        raise ValueError("choose: no candidates")
    first, second = CRITERIA[criterion]
    reached = [o for o in outcomes if o.reached]
    if reached:
        best = min(reached, key=lambda o: (getattr(o, first), _or_inf(getattr(o, second)),
                                           o.lr))
        figure = getattr(best, first)
        why = (f"the {'soonest' if criterion == 'time' else 'fewest samples'} to the target "
               f"({_figure(criterion, figure, unit)})")
    else:
        sign = -1.0 if higher_is_better else 1.0
        scored = [o for o in outcomes if o.best_metric is not None]
        best = min(scored, key=lambda o: (sign * o.best_metric, o.lr)) if scored else outcomes[0]
        why = ("no candidate reached the target: the best score" if scored else
               "no candidate recorded a score: the smallest lr")
    ties = [o for o in (reached or outcomes) if o is not best and _same(o, best, first, second)]
    if ties:
        why += f"; tied with lr {', '.join(f'{o.lr:g}' for o in ties)}, the smaller lr wins"
    return Choice(best, criterion, why, outcomes)


def _or_inf(x: Optional[float]) -> float:
    return float("inf") if x is None else x


def _same(a: Outcome, b: Outcome, first: str, second: str) -> bool:
    if a.reached or b.reached:
        return (getattr(a, first), getattr(a, second)) == (getattr(b, first), getattr(b, second))
    return a.best_metric == b.best_metric


def tried_first(grid: list, base: float) -> list:
    """The grid in the order a tuner tries it: nearest the base lr first (by factor, the
    larger of two equally near first). Once a candidate reaches the target, the later ones
    need run no longer than it took, so the likeliest winners go first."""
    return sorted(grid, key=lambda lr: (abs(math.log(lr / base)), -lr))


def _figure(criterion: str, value: float, unit: str = "s") -> str:
    """A time in ``unit`` ('s', or 'virtual s': those often last milliseconds), or samples."""
    if criterion != "time":
        return f"{value:,.0f} samples"
    return f"{value:.1f} s" if unit == "s" else f"{value:.3g} {unit}"


def render_tuning(choices: dict, goal: Goal, budget: float, seed: int) -> list:
    """report.md's "Learning rates" section: every candidate of every mode (``choices``:
    mode -> Choice), the chosen one marked, and why it won."""
    by_time = all(c.criterion == "time" for c in choices.values())
    best, other = ("soonest", "fewer samples") if by_time else ("with the fewest samples",
                                                                 "less time")
    lines = ["## Learning rates", "",
             f"Each mode's learning rate was tuned before the runs (--tune lr): every candidate "
             f"trained once, seed {seed}, for up to {budget:g} {goal.unit}, stopping at "
             f"{goal.label}; the "
             f"mode then ran with the one that reached {goal.label} {best} ({other} breaking "
             "ties; a candidate that reached it beats every one that did not, which are ranked "
             "by their best score; ties go to the smaller lr). Candidate runs: `tuning/`.", "",
             f"| mode | lr | time to {goal.label} | samples to {goal.label} | best {goal.short} "
             "| chosen |", "|---|---|---|---|---|---|"]
    for mode, choice in choices.items():
        for o in choice.outcomes:
            mark = "**chosen**" if o is choice.chosen else ""
            lr = f"**{o.lr:g}**" if mark else f"{o.lr:g}"
            time = f"{goal.seconds(o.time_to_target)} {goal.unit}" if o.reached else (
                "not reached" if o.status == "ok" else o.status)
            samples = f"{o.samples_to_target:,.0f}" if o.reached else DASH
            best = DASH if o.best_metric is None else goal.value(o.best_metric)
            lines.append(f"| {mode} | {lr} | {time} | {samples} | {best} | {mark} |")
    lines.append("")
    lines += [f"- {mode}: lr {choice.lr:g}, {choice.why}{edge_note(choice)}."
              for mode, choice in choices.items()]
    return lines + [""]


def edge_note(choice) -> str:
    """Said where the chosen lr is the grid's largest or smallest: the best lr may lie
    beyond the grid, so the mode may be faster than its row shows."""
    tried = sorted(o.lr for o in choice.outcomes)
    if len(tried) < 2 or choice.lr not in (tried[0], tried[-1]):
        return ""
    side = "largest" if choice.lr == tried[-1] else "smallest"
    return (f" (the {side} lr tried: a {'larger' if side == 'largest' else 'smaller'} one may "
            "do better; give --lr to move the grid)")
