"""Stragglers: time to target as one of 4 workers is slowed 1x, 2x, 4x and 8x, in every mode.

    python experiments/stragglers.py                          # 4 slowdowns x 6 modes, ~7 min
    python experiments/stragglers.py --factors 1,4 --modes ddp,ps-async --budget 30

For each slowdown F one ``asyncsgd compare`` (same seeds, data, batch per process,
budget and target in every mode; runs one after another):

    asyncsgd compare --task mnist1d-cnn --procs 4 --slowdown 1:F --target 0.85 \\
        --stop-at-target --modes ddp,ps-sync,ps-backup,ps-ssp,ps-async,hogwild

Rank 1 waits (F - 1) x its own compute time after each step (``--slowdown``).
The published shape (Chen et al. 2016, "Revisiting distributed synchronous SGD";
Dutta et al. 2018): synchronous training's time grows with its slowest worker,
asynchronous training's stays nearly flat, and sync with backup workers
recovers most of what the straggler costs. Writes
``experiments/results/stragglers.md`` (time and samples to target per mode
and slowdown, and the shape found, computed from the table), ``.json`` and
``stragglers.png``.

On this machine's 2 cores the 4 workers share cores, so a sleeping straggler
also frees CPU for the others: the figures measure that machine, and
experiments/README.md says so beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

from asyncsgd.comparison.runner import compare
from asyncsgd.analysis.report import Goal
from asyncsgd.config import CompareConfig
from results import RESULTS  # this script's folder

NAME = "stragglers"
MODES = "ddp,ps-sync,ps-backup,ps-ssp,ps-async,hogwild"


def measure(args, factor, out: Path, key: str = "slowdown", slowdown: Optional[str] = None,
            delay: Optional[str] = None, script: str = NAME, link: Optional[str] = None) -> list:
    """One compare under one condition (``slowdown``/``delay`` as compare takes them),
    recorded as ``key: factor``: per mode, its time and samples to target."""
    cfg = CompareConfig(task=args.task, modes=args.modes, procs=args.procs, budget=args.budget,
                        target=args.target, stop_at_target=True, slowdown=slowdown,
                        delay=delay, link=link, out=str(out), progress="log", seed=args.seed)
    result = compare(cfg, argv=["asyncsgd", "compare", f"(experiments/{script}.py)"])
    rows = []
    for a in result.attempts:
        numbers = a.run.numbers(Goal(a.run.metric, args.target)) if a.ok else {}
        rows.append({"mode": a.label, key: factor, "status": a.status,
                     "error": a.error, "time_to_target": numbers.get("time_to_target"),
                     "samples_to_target": numbers.get("samples_to_target"),
                     "bytes_to_target": numbers.get("bytes_to_target"),
                     "samples_per_second": numbers.get("samples_per_second"),
                     "final_metric": numbers.get("final_metric")})
    return rows


def cell(row: dict, budget: float) -> str:
    if row["status"] != "ok":
        return f"failed ({row['error']})"
    if row["time_to_target"] is None:
        return f"> {budget:g} s"
    return f"{row['time_to_target']:.1f} s / {row['samples_to_target'] / 1000:,.0f}k"


def table(rows: list, key: str, xs: list, headers: list, budget: float) -> list:
    """Markdown lines: one row per mode, one column per value of the condition ``key``."""
    cells = {(r["mode"], r[key]): cell(r, budget) for r in rows}
    return ["| mode | " + " | ".join(headers) + " |", "|---|" + "---|" * len(xs),
            *(f"| {mode} | " + " | ".join(cells.get((mode, x), "") for x in xs) + " |"
              for mode in dict.fromkeys(r["mode"] for r in rows))]


def run_by(name: str, started: float) -> str:
    """A report's provenance: the command as run, how long it took and where."""
    command = " ".join([f"python experiments/{name}.py", *sys.argv[1:]])
    return (f"Run by `{command}` in {(time.monotonic() - started) / 60:.0f} min on a shared "
            "2-core machine")


def report(name: str, lines: list, record, draw, no_save: bool, rows: list) -> int:
    """Print the report, save it (unless ``no_save``: ``save``), and the exit code: 1 when
    a run failed."""
    text = "\n".join(lines)
    print(text)
    if not no_save:
        save(name, text, record, draw)
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def save(name: str, text: str, record, draw) -> None:
    """``results/NAME.md`` (``text``), ``.json`` (``record``) and ``.png`` (``draw(path)``)."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    draw(RESULTS / f"{name}.png")


def shape(rows: list, factors: list, budget: float) -> list:
    """What the table shows, in sentences computed from it."""
    by = {(r["mode"], r["slowdown"]): r["time_to_target"] for r in rows}
    lo, hi = factors[0], factors[-1]
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        a, b = by.get((mode, lo)), by.get((mode, hi))
        if a is None:
            lines.append(f"- {mode}: did not reach the target unslowed within {budget:g} s.")
        elif b is None:
            lines.append(f"- {mode}: {a:.1f} s unslowed; not within {budget:g} s at {hi}x.")
        else:
            lines.append(f"- {mode}: {a:.1f} s unslowed, {b:.1f} s at {hi}x "
                         f"({b / a:.2f}x as long).")
    if 4 in factors and by.get(("ddp", 4)):
        for mode in ("ps-async", "ps-backup"):
            t = by.get((mode, 4))
            if t:
                lines.append(f"- At 4x: {mode} reached the target {by[('ddp', 4)] / t:.2f}x "
                             f"sooner than ddp ({t:.1f} s vs {by[('ddp', 4)]:.1f} s).")
    return lines


def plot(rows: list, key: str, xs: list, ticks: list, xlabel: str, title: str, path: Path,
         log2: bool = False) -> None:
    """Time to target per mode against the condition ``key`` (one line per mode)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        points = [(r[key], r["time_to_target"]) for r in rows
                  if r["mode"] == mode and r["time_to_target"] is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=mode)
    if log2:
        ax.set_xscale("log", base=2)
    ax.set_xticks(xs, ticks)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("seconds of training to the target")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def arguments(doc: str, **defaults) -> argparse.ArgumentParser:
    """The options every compare-based experiment takes (``defaults`` override)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--task", default=defaults.get("task", "mnist1d-cnn"))
    ap.add_argument("--modes", default=defaults.get("modes", MODES))
    ap.add_argument("--procs", type=int, default=defaults.get("procs", 4))
    ap.add_argument("--budget", type=float, default=defaults.get("budget", 45.0),
                    help="seconds per run")
    ap.add_argument("--target", type=float, default=defaults.get("target", 0.85))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=None, help="where the compare directories go")
    ap.add_argument("--no-save", action="store_true", help="leave experiments/results alone")
    return ap


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--factors", default="1,2,4,8", help="slowdowns of rank 1")
    args = ap.parse_args()
    factors = sorted(int(f) for f in args.factors.split(","))
    runs = Path(args.runs or f"runs/stragglers-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.monotonic()
    rows = []
    for factor in factors:
        rows += measure(args, factor, runs / f"x{factor}",
                        slowdown=f"1:{factor}" if factor > 1 else None)
    lines = [f"# Time (and samples) to {args.target:.0%} with one straggler of "
             f"{args.procs} workers", "",
             f"{run_by(NAME, started)}: task {args.task}, seed {args.seed}, "
             f"budget {args.budget:g} s "
             "per run (start-up included), each cell one run: training seconds to the "
             "target / training samples (all workers) to it.", "",
             *table(rows, "slowdown", factors, [f"{f}x" for f in factors], args.budget)]
    lines += ["", "What it shows (computed from the table):", "",
              *shape(rows, factors, args.budget), "", f"![time to target]({NAME}.png)"]
    return report(NAME, lines, rows, lambda path: plot(
        rows, "slowdown", factors, [f"{f}x" for f in factors],
        "slowdown of one worker of four",
        f"Time to target with one straggler ({args.task}, 2 cores)", path, log2=True),
        args.no_save, rows)


if __name__ == "__main__":
    sys.exit(main())
