"""The comparison plots, as small PNGs: one colour a mode (its median and min–max band where
it ran several times), the task's own metric, the conditions under each title.

Built with matplotlib's object API (no pyplot, no display); what each figure draws is
``figure_data``'s, so it can be checked without reading pixels.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Optional

from ..run.metrics import eval_curve, steady_throughput, train_reports
from .report import Goal, Spread

log = logging.getLogger(__name__)

PLOTS = [("{metric}_vs_time.png", "Test {metric} vs wall-clock time"),
         ("loss_vs_time.png", "Training loss vs wall-clock time"),
         ("loss_vs_samples.png", "Training loss vs samples processed"),
         ("throughput.png", "Throughput per mode")]
# Drawn when a run counts its bytes (the parameter server, ddp): its metric by traffic
BYTES_PLOT = ("{metric}_vs_bytes.png",
              "Test {metric} vs megabytes on the network (single and hogwild use none; a "
              "parameter server's workers on its host move their tensors through shared "
              "memory instead, which the legend names)")
SIZE = (6.4, 4.0)  # inches; at DPI 80 a 512 x 320 PNG of a few tens of KB
DPI = 80


def _figure(title: str, xlabel: str, ylabel: str, conditions: str = ""):
    from matplotlib.figure import Figure
    fig = Figure(figsize=SIZE, dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title + (f"\n{conditions}" if conditions else ""),
                 fontsize="medium" if conditions else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _colour(i: int) -> str:
    return f"C{i % 10}"


def series(groups: list, curve, x: int, y: int) -> list:
    """What a line figure draws, a group in its colour: (label, colour index, xs, ys) of
    a group with one run that has points; of a group with several, one band (label,
    colour index, xs, median, min, max) over its runs (``band``)."""
    lines = []
    for i, (label, runs) in enumerate(groups):
        curves = [[(p[x], p[y]) for p in points] for run in runs if (points := curve(run.events))]
        if len(curves) == 1:
            lines.append((label, i, [p[0] for p in curves[0]], [p[1] for p in curves[0]]))
        elif curves:
            lines.extend(_band(label, i, curves))
    return lines


def band(curves: list) -> tuple:
    """(xs, median, min, max) of several curves [(x, y), ...] at each x any of them has
    where all of them have points (the x range they share), each curve interpolated
    linearly there; ((), (), (), ()) where they share no x range."""
    import numpy
    start, end = max(c[0][0] for c in curves), min(c[-1][0] for c in curves)
    xs = sorted({x for c in curves for x, _ in c if start <= x <= end})
    if not xs:
        return (), (), (), ()
    ys = [numpy.interp(xs, [p[0] for p in c], [p[1] for p in c]).tolist() for c in curves]
    at = list(zip(*ys))
    return (xs, [statistics.median(v) for v in at], [min(v) for v in at],
            [max(v) for v in at])


def _band(label: str, colour: int, curves: list) -> list:
    """The band of ``curves``, or each curve as a line where they share no x range."""
    xs, median, lo, hi = band(curves)
    if not xs:
        return [(label, colour, [p[0] for p in c], [p[1] for p in c]) for c in curves]
    return [(label, colour, xs, median, lo, hi)]


def _lines(lines: list, title: str, xlabel: str, ylabel: str,
           hline: Optional[tuple] = None, conditions: str = "", log: bool = False):
    fig, ax = _figure(title, xlabel, ylabel, conditions)
    if log:
        ax.set_yscale("log")
    counts = {label: sum(line[0] == label for line in lines) for label, *_ in lines}
    shown: set = set()
    for label, colour, xs, ys, *spread in lines:
        if spread:  # the median of several runs, their min–max shaded around it
            ax.fill_between(xs, *spread, color=_colour(colour), alpha=0.2, linewidth=0)
        ax.plot(xs, ys, color=_colour(colour), linewidth=1.2,
                alpha=0.9 if counts[label] == 1 else 0.6,
                label=None if label in shown else label)
        shown.add(label)
    if hline is not None:  # (y, legend label)
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return fig


def loss_curve(events: list) -> list:
    """(t, samples, loss): the training loss of all workers at each report, every point
    a mean over at least half the steps of the run's typical (median) report.

    A report's loss is the mean over the steps since the report before, drawn at the
    report's end. Modes end with a forced report of whatever ran since the last
    periodic one: often a step or two of some workers, milliseconds later. Drawn on
    its own, that last point is the loss of a couple of minibatches (noisy, and the
    latest: below the lagging one-second mean of a falling loss) against the mean just
    before it at nearly the same x: a vertical drop at the end of the curve, made by
    the bookkeeping, not by training.
    So a report with fewer steps than half the median is folded into the point before
    it (their steps' weighted mean, at the later report's time and samples); the
    first report, the curve's start, stands as it is.
    """
    reports = train_reports(events)
    if not reports:
        return []
    least = _median([steps for *_, steps in reports]) / 2
    points = [list(reports[0])]
    for t, samples, loss_sum, steps in reports[1:]:
        if steps >= least:
            points.append([t, samples, loss_sum, steps])
        else:
            last = points[-1]
            last[0], last[1] = max(last[0], t), samples
            last[2], last[3] = last[2] + loss_sum, last[3] + steps
    return [(t, samples, loss_sum / steps) for t, samples, loss_sum, steps in points]


def _median(values: list) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _score_curve(goal: Goal):
    """(t, samples, score) of a run's evaluations; fractions as percentages."""
    scale = 100 if goal.metric.percent else 1

    def curve(events: list) -> list:
        return [(t, s, v * scale) for t, s, v in eval_curve(events, goal.metric)]

    return curve


def _bytes_curve(goal: Goal):
    """(MB on the network so far, score) at each evaluation that carries ``bytes``."""
    scale = 100 if goal.metric.percent else 1

    def curve(events: list) -> list:
        return [(e["bytes"] / 1e6, e[goal.metric.name] * scale) for e in events
                if e.get("event") == "eval" and e.get("bytes") is not None
                and e.get(goal.metric.name) is not None]

    return curve


def _throughput(groups: list, conditions: str = "", unit: str = "s"):
    fig, ax = _figure("Throughput (after start-up)", "mode", f"training samples / {unit}",
                      conditions)
    names, medians, below, above = [], [], [], []
    for label, runs in groups:  # a bar at the median, whiskers to the min and max
        spread = Spread.of(steady_throughput(r.events) for r in runs)
        names.append(label)
        medians.append(spread.median or 0.0)
        below.append(medians[-1] - spread.lo if spread.n > 1 else 0.0)
        above.append(spread.hi - medians[-1] if spread.n > 1 else 0.0)
    bars = ax.bar(range(len(names)), medians, yerr=[below, above], capsize=4,
                  color=[_colour(i) for i in range(len(names))])
    ax.bar_label(bars, labels=[f"{m:,.0f}" for m in medians], fontsize="small")
    ax.set_xticks(range(len(names)), names, rotation=20 if len(names) > 4 else 0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.grid(False, axis="x")
    return fig


def figure_data(groups: list, goal: Goal) -> dict:
    """What each line figure of ``PLOTS`` draws, by file name: ``series`` of the task's
    metric (percent for a fraction) and of the training loss (``loss_curve``)."""
    name = PLOTS[0][0].format(metric=goal.metric.name)
    return {name: series(groups, _score_curve(goal), 0, 2),
            "loss_vs_time.png": series(groups, loss_curve, 0, 2),
            "loss_vs_samples.png": series(groups, loss_curve, 1, 2)}


def draw_all(groups: list, out_dir: Path, goal: Goal, conditions: str = "") -> list:
    """Write the four PNGs of ``PLOTS`` for ``groups`` = [(label, [Run, ...])], the task's
    metric in ``goal`` (and its target, drawn when given), and ``BYTES_PLOT`` when a run
    counted its traffic; returns [(file name, caption)] of those written.

    Each mode gets one colour: one line where it ran once, else the median of its
    repeats with their min–max shaded (``series``); every figure carries the
    ``conditions`` (task, processes, stragglers, link) under its title."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, caption, figure in figures(groups, goal, conditions):
        figure.savefig(out_dir / name, dpi=DPI)
        written.append((name, caption))
        log.info("wrote %s", out_dir / name)
    return written


def figures(groups: list, goal: Goal, conditions: str = "") -> list:
    """[(file name, caption, matplotlib Figure)] of what ``draw_all`` writes."""
    groups = [(label, runs) for label, runs in groups if runs]
    metric, target = goal.metric, goal.target
    scale = 100 if metric.percent else 1
    unit = " (%)" if metric.percent else ""
    data = figure_data(groups, goal)
    score, by_time, by_samples = data.values()
    # a run's clock starts with the command: its start-up is on the axis too
    seconds = "virtual seconds" if goal.clock == "virtual" else \
        "seconds since the command started"
    hline = None if target is None else (target * scale, f"target {goal.label}")
    drawn = [
        _lines(score, f"Test {metric.name}", seconds,
               f"test {metric.name}{unit}" + ("" if metric.higher_is_better else
                                               " (lower is better)"),
               hline=hline, conditions=conditions, log=log_axis(metric, score)),
        _lines(by_time, "Training loss", seconds, "training loss",
               conditions=conditions),
        _lines(by_samples, "Training loss", "samples processed", "training loss",
               conditions=conditions),
        _throughput(groups, conditions, goal.unit),
    ]
    names = list(PLOTS)
    named = {label: shared_label(label, runs) for label, runs in groups}
    by_bytes = [(named[label], *rest)
                for label, *rest in series(groups, _bytes_curve(goal), 0, 1)]
    if by_bytes:
        drawn.append(_lines(
            by_bytes, f"Test {metric.name} by traffic", "MB on the network",
            f"test {metric.name}{unit}", hline=hline, conditions=conditions,
            log=log_axis(metric, by_bytes)))
        names.append(BYTES_PLOT)
    made = []
    for figure, (name, caption) in zip(drawn, names):
        name, caption = name.format(metric=metric.name), caption.format(metric=metric.name)
        if goal.clock == "virtual":
            caption = caption.replace("wall-clock", "virtual")
        made.append((name, caption, figure))
    return made


def shared_label(label: str, runs: list) -> str:
    """``label``, with the megabytes its runs moved through shared memory where they did
    (a parameter server and workers on one host): the traffic figure's x axis counts only
    what crossed a socket, so those runs would look nearly free beside ddp's."""
    moved = max((e.get("shared_bytes", 0) for run in runs for e in run.events
                 if e.get("event") == "eval"), default=0)
    return f"{label} (shared memory: {moved / 1e6:,.1f} MB not on the wire)" if moved else label


def log_axis(metric, lines: list) -> bool:
    """A lower-is-better metric that is no fraction (perplexity, mse, a loss) falls by
    orders of magnitude early on: on a linear axis its first values flatten every later
    curve and the target line. Log where every value drawn is positive."""
    values = [y for line in lines for ys in line[3:] for y in ys]  # medians, mins, maxes
    return not metric.higher_is_better and not metric.percent and bool(values) \
        and min(values) > 0
