"""A report directory: the plots, report.md and results.json of a set of runs.

    publish(out, "my runs", intro_lines, attempts, Goal.of(attempts, 0.9), header={...})

``asyncsgd compare`` publishes the runs it made; ``asyncsgd plot`` those of any
run directories (``report_runs``), compare directories included. The table
and report come from ``report``, the figures from ``plots`` (matplotlib loads
only when they are drawn).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from ..errors import ConfigError
from .plots import draw_all
from .report import (Attempt, Goal, Run, mode_rows, render_report, render_table, run_label,
                     verdict)


def write_results(path: Path, header: dict, rows: list, goal: Goal) -> None:
    """results.json: the same numbers as the table, unrounded, and every attempt."""
    record = {**header, "metric": goal.metric.describe(), "target": goal.target,
              "modes": [r.to_dict() for r in rows],
              "runs": [a.to_dict(goal) for r in rows for a in r.attempts]}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def publish(out_dir: Path, title: str, intro: list, attempts: list, goal: Goal,
            header: dict) -> str:
    """Write the plots, report.md and results.json of ``attempts`` into ``out_dir``;
    returns the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = mode_rows(attempts, goal)
    plots = draw_all([(r.label, [a.run for a in r.attempts if a.ok]) for r in rows],
                     out_dir, goal, conditions=title)
    (out_dir / "report.md").write_text(
        render_report(title, intro, rows, goal, plots, out_dir))
    write_results(out_dir / "results.json", header, rows, goal)
    return render_table(rows, goal) + "\n\n" + verdict(rows, goal)


def report_runs(paths: list, out: Path, target: Optional[float]) -> str:
    """``asyncsgd plot``: the plots and report.md of any run directories (or compare
    directories, whose runs keep their modes and repeats) into ``out``; returns the table."""
    attempts, plain = [], []
    for path in paths:
        path = Path(path)
        if (path / "results.json").is_file() and not (path / "config.json").is_file():
            attempts += _compare_attempts(path)
            continue
        run = Run.read(path)
        plain.append(Attempt(run_label(run.config), seed=run.seed, run=run, run_dir=str(path)))
        attempts.append(plain[-1])
    labels = [a.label for a in attempts]
    for a in plain:  # plain runs of one mode are different experiments, not repeats
        if labels.count(a.label) > 1:
            a.label = f"{a.label} ({Path(a.run_dir).name})"
    return publish(out, "asyncsgd plot", [f"Runs: {', '.join(str(p) for p in paths)}"],
                   attempts, Goal.of(attempts, target), {"command": sys.argv})


def _compare_attempts(path: Path) -> list:
    """The attempts of an earlier compare, from its results.json and run directories."""
    try:
        record = json.loads((path / "results.json").read_text())
        runs = record["runs"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path}/results.json is not a compare result: {exc}") from exc
    attempts = []
    for r in runs:
        run_dir = path / Path(r["run_dir"]).name if r.get("run_dir") else None
        run = Run.read(run_dir) if run_dir and (run_dir / "config.json").is_file() else None
        attempts.append(Attempt(r["mode"], r.get("repeat", 0), r.get("seed"),
                                r.get("status", "ok"), r.get("error"), run,
                                str(run_dir) if run_dir else None, r.get("logs")))
    return attempts
