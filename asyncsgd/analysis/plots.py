"""The comparison plots, as small PNGs (matplotlib, no display needed).

    from asyncsgd.analysis.plots import draw_all
    draw_all([("hogwild", [run_a, run_b]), ("ps-async", [run_c])], Path("out"),
             Goal(run_a.metric, 0.9), conditions="mnist1d-cnn, 4 processes")

Each mode gets one colour; its repeats are drawn as separate lines of that
colour. Every figure carries the conditions (task, processes, stragglers, link)
under its title, and the task's own metric (accuracy, perplexity, ...). Curves
come from metrics.jsonl through ``metrics.eval_curve`` and ``metrics.train_curve``;
throughput is ``metrics.steady_throughput``. Figures are built with the object API
(no pyplot), so nothing depends on a display or on global pyplot state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from ..run.metrics import eval_curve, steady_throughput, train_curve
from .report import Goal, Spread

log = logging.getLogger(__name__)

PLOTS = [("{metric}_vs_time.png", "Test {metric} vs wall-clock time"),
         ("loss_vs_time.png", "Training loss vs wall-clock time"),
         ("loss_vs_samples.png", "Training loss vs samples processed"),
         ("throughput.png", "Throughput per mode")]
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


def _lines(groups: list, curve, x: int, y: int, title: str, xlabel: str, ylabel: str,
           hline: Optional[tuple] = None, conditions: str = ""):
    fig, ax = _figure(title, xlabel, ylabel, conditions)
    for i, (label, runs) in enumerate(groups):
        for k, run in enumerate(runs):
            points = curve(run.events)
            if not points:
                continue
            ax.plot([p[x] for p in points], [p[y] for p in points], color=_colour(i),
                    linewidth=1.2, alpha=0.9 if len(runs) == 1 else 0.6,
                    label=label if k == 0 else None)
    if hline is not None:  # (y, legend label)
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return fig


def _score_curve(goal: Goal):
    """(t, samples, score) of a run's evaluations; fractions as percentages."""
    scale = 100 if goal.metric.percent else 1

    def curve(events: list) -> list:
        return [(t, s, v * scale) for t, s, v in eval_curve(events, goal.metric)]

    return curve


def _throughput(groups: list, conditions: str = ""):
    fig, ax = _figure("Throughput (after start-up)", "mode", "training samples / s",
                      conditions)
    names, means, stds = [], [], []
    for label, runs in groups:
        spread = Spread.of(steady_throughput(r.events) for r in runs)
        names.append(label)
        means.append(spread.mean or 0.0)
        stds.append(spread.std or 0.0)
    bars = ax.bar(range(len(names)), means, yerr=stds, capsize=4,
                  color=[_colour(i) for i in range(len(names))])
    ax.bar_label(bars, labels=[f"{m:,.0f}" for m in means], fontsize="small")
    ax.set_xticks(range(len(names)), names, rotation=20 if len(names) > 4 else 0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.grid(False, axis="x")
    return fig


def draw_all(groups: list, out_dir: Path, goal: Goal, conditions: str = "") -> list:
    """Write the four PNGs of ``PLOTS`` for ``groups`` = [(label, [Run, ...])], the task's
    metric in ``goal`` (and its target, drawn when given); returns [(file name, caption)]
    of those written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = [(label, runs) for label, runs in groups if runs]
    metric, target = goal.metric, goal.target
    scale = 100 if metric.percent else 1
    unit = " (%)" if metric.percent else ""
    figures = [
        _lines(groups, _score_curve(goal), 0, 2, f"Test {metric.name}", "training seconds",
               f"test {metric.name}{unit}" + ("" if metric.higher_is_better else
                                               " (lower is better)"),
               hline=None if target is None else (target * scale, f"target {goal.label}"),
               conditions=conditions),
        _lines(groups, train_curve, 0, 2, "Training loss", "training seconds",
               "training loss", conditions=conditions),
        _lines(groups, train_curve, 1, 2, "Training loss", "samples processed",
               "training loss", conditions=conditions),
        _throughput(groups, conditions),
    ]
    written = []
    for figure, (name, caption) in zip(figures, PLOTS):
        name, caption = name.format(metric=metric.name), caption.format(metric=metric.name)
        figure.savefig(out_dir / name, dpi=DPI)
        written.append((name, caption))
        log.info("wrote %s", out_dir / name)
    return written
