"""Hogwild throughput: aggregate samples/s for 1, 2, 4 and 8 processes, lock-free and locked.

    python experiments/hogwild_scaling.py                      # both tasks, ~4 minutes
    python experiments/hogwild_scaling.py --tasks mnist1d-cnn --seconds 6 --repeats 1
    python experiments/hogwild_scaling.py --plot-only          # redraw the PNG from the JSON

Every configuration trains for ``--seconds`` after all its workers are up
(start-up is excluded: it is reported separately), and the whole grid runs
``--repeats`` times in alternating order so that drift on a shared machine
hits every configuration alike; the table shows medians and the ratios
measured in this one run. Targets on the 2-core project machine:
2 processes >= 1.9x one process on mnist1d-cnn, and 8 processes >= 0.9x
the 2-process figure (no collapse from oversubscription).

Start-up: the table's column comes from runs in this process, which after
the first reuse one fork server (~0.4 s). The figure to quote is measured
last, on ``--repeats`` fresh ``asyncsgd hogwild`` commands with the largest
``--procs`` and the default (or given) ``--start-method``: seconds from the
command's start, imports included, to every worker training, target <= 1.5 s
for 8 processes (issue 42), and from its ``train()`` (issue 14's <= 2.5 s).
The 1-minute load average is printed beside it: on this shared 2-core machine
other work moves it more than anything measured here.

Writes ``experiments/results/hogwild_scaling.md`` (and ``.json``, and the
figure ``hogwild_scaling.png``: speed-up over one process per task) unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncsgd.config import HogwildConfig
from asyncsgd.modes.hogwild import train
from asyncsgd.run.process_group import available_cores
from results import RESULTS, save_results  # this script's folder

FIGURE_DPI = 80
STARTUP_TARGET = 1.5  # seconds from the command to the last of 8 processes training (issue 42)


def measure(task: str, procs: int, lock: bool, seconds: float, start_method: str,
            share: str = "auto") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = HogwildConfig(task=task, procs=procs, lock=lock, epochs=1_000_000,
                            max_seconds=seconds, eval_every=1e6, checkpoint_every=0,
                            progress="off", out=str(Path(tmp) / "run"),
                            start_method=start_method, share_cores=share)
        summary = train(cfg).summary
    return {"rate": summary["steady_samples_per_second"] or 0.0,
            "startup": summary["startup_seconds"], "accuracy": summary["final_metric"]}


def fresh_startup(task: str, procs: int, start_method: str) -> dict:
    """Start-up of a fresh ``asyncsgd hogwild`` command, as a user sees it: seconds from
    its ``train()`` to the last worker training (``startup_seconds``), and from the
    command's start (its imports included). In-process runs of ``measure`` after the
    first reuse the fork server and start in ~0.4 s: this is the figure to quote."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        load = os.getloadavg()[0]
        started = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "asyncsgd", "hogwild", "--task", task, "--procs", str(procs),
             "--max-seconds", "8", "--eval-every", "1000000", "--checkpoint-every", "0",
             "--progress", "off", "--out", str(out), "--start-method", start_method],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        if proc.returncode != 0:
            raise RuntimeError(f"asyncsgd hogwild failed ({proc.returncode}): "
                               f"{proc.stderr[-2000:]}")
        summary = json.loads((out / "summary.json").read_text())
        first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    if summary["startup_seconds"] is None:
        raise RuntimeError(f"{procs} {start_method} workers were not all training within 8 s")
    # A run's clock starts at its command's process start (metrics.jsonl's "t"); its first
    # event is written as train() begins, after the interpreter, imports and task load.
    process_started = first["wall"] - first["t"]
    return {"startup": summary["startup_seconds"] - first["t"],
            "from_command": process_started - started + summary["startup_seconds"],
            "load": load}


def label(lock: bool, share: str, procs: int, cores: int) -> str:
    kind = "locked" if lock else "lock-free"
    if procs > cores:
        kind += ", os scheduler" if share == "os" else ", token ring"
    return kind


def draw(table: list, cores: int, path: Path) -> None:
    """One panel per task: samples/s over one lock-free process's, vs processes, lock-free
    and locked (token ring beyond the cores), lock-free left to the kernel scheduler, and
    the ideal. One baseline for all lines, so the locked line shows the lock's cost too."""
    from matplotlib.figure import Figure
    tasks = list(dict.fromkeys(row["task"] for row in table))
    fig = Figure(figsize=(4.2 * len(tasks), 3.4), dpi=FIGURE_DPI, layout="constrained")
    axes = fig.subplots(1, len(tasks), sharey=True, squeeze=False)[0]
    series = [((False, "auto"), "lock-free", "C0", "-"), ((True, "auto"), "locked", "C1", "-"),
              ((False, "os"), "lock-free, kernel scheduler", "C0", ":")]
    for ax, task in zip(axes, tasks):
        rows = [r for r in table if r["task"] == task]
        base = next(r["samples_per_second"] for r in rows
                    if r["procs"] == 1 and not r["lock"] and r["share_cores"] == "auto")
        procs = sorted({r["procs"] for r in rows})
        ax.plot(procs, [min(p, cores) for p in procs], color="grey", linestyle="--",
                linewidth=0.9, label=f"ideal ({cores} cores)")
        for (lock, share), name, colour, style in series:
            points = sorted((r["procs"], r["samples_per_second"] / base) for r in rows
                            if r["lock"] == lock and r["share_cores"] == share)
            if share == "os":  # beyond the cores only; start it from the shared 'cores' point
                points = sorted(set(points) | {(r["procs"], r["samples_per_second"] / base)
                                               for r in rows
                                               if not r["lock"] and r["share_cores"] == "auto"
                                               and r["procs"] == cores})
            if points:
                ax.plot([p for p, _ in points], [v for _, v in points], color=colour,
                        linestyle=style, marker="o", markersize=3.5, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(procs, [str(p) for p in procs])
        ax.set_title(task + (" (sparse)" if "sparse" in task else " (dense)"))
        ax.set_xlabel("processes")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("samples/s vs 1 lock-free process")
    axes[-1].legend(fontsize="small", loc="lower right")
    fig.savefig(path, dpi=FIGURE_DPI)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="mnist1d-cnn,sparse-logreg")
    ap.add_argument("--procs", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=8.0, help="training seconds per configuration")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-lock", action="store_true", help="skip the locked baseline")
    ap.add_argument("--start-method", default=HogwildConfig().start_method,
                    choices=["spawn", "forkserver"],
                    help="default: the library's (forkserver where the platform has it)")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--plot-only", action="store_true",
                    help="measure nothing: redraw the figure from the saved JSON")
    args = ap.parse_args()
    if args.plot_only:
        draw(json.loads((RESULTS / "hogwild_scaling.json").read_text()), available_cores(),
             RESULTS / "hogwild_scaling.png")
        return 0
    tasks = args.tasks.split(",")
    procs_list = [int(p) for p in args.procs.split(",")]
    locks = [False] if args.no_lock else [False, True]
    cores = available_cores()
    grid = [(t, p, lk, "auto") for t in tasks for lk in locks for p in procs_list]
    # The same oversubscribed runs left to the kernel scheduler: what the token ring buys.
    grid += [(t, p, False, "os") for t in tasks for p in procs_list if p > cores]
    results: dict = {g: [] for g in grid}
    print(f"{available_cores()} cores; {len(grid)} configurations x {args.repeats} repeats, "
          f"{args.seconds:g} s each", file=sys.stderr)
    for r in range(args.repeats):
        for g in (grid if r % 2 == 0 else list(reversed(grid))):
            m = measure(g[0], g[1], g[2], args.seconds, args.start_method, g[3])
            results[g].append(m)
            print(f"  {g[0]:14s} procs={g[1]} {label(g[2], g[3], g[1], cores)}: "
                  f"{m['rate']:,.0f} samples/s (start-up {m['startup'] or float('nan'):.1f} s)",
                  file=sys.stderr)

    lines = [f"Hogwild throughput, {available_cores()} cores, median of {args.repeats} x "
             f"{args.seconds:g} s per configuration ({time.strftime('%Y-%m-%d %H:%M')})", "",
             "| task | updates | procs | samples/s | vs 1 proc | vs 2 procs | start-up s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    table = []
    for t in tasks:
        for lk, share in [(lk, "auto") for lk in locks] + [(False, "os")]:
            runs = {p: results[(t, p, lk, share)] for p in procs_list
                    if (t, p, lk, share) in results}
            if not runs:
                continue
            base = {p: statistics.median(m["rate"] for m in results[(t, p, lk, "auto")])
                    for p in procs_list}
            for p, ms in runs.items():
                rate = statistics.median(m["rate"] for m in ms)
                vs1 = rate / base[1] if base.get(1) else float("nan")
                vs2 = rate / base[2] if base.get(2) else float("nan")
                start = statistics.median(m["startup"] if m["startup"] is not None
                                          else float("nan") for m in ms)
                kind = label(lk, share, p, cores)
                lines.append(f"| {t} | {kind} | {p} | {rate:,.0f} | {vs1:.2f}x | {vs2:.2f}x "
                             f"| {start:.1f} |")
                table.append({"task": t, "lock": lk, "share_cores": share, "procs": p,
                              "samples_per_second": rate, "vs_1": vs1, "vs_2": vs2,
                              "startup_seconds": start})
    text = "\n".join(lines)
    print(text)
    cnn = {row["procs"]: row for row in table
           if row["task"] == "mnist1d-cnn" and not row["lock"] and row["share_cores"] == "auto"}
    if 1 in cnn and 2 in cnn and 8 in cnn:
        print(f"\ntargets (mnist1d-cnn, lock-free): 2 procs / 1 proc = {cnn[2]['vs_1']:.2f}x "
              f"(target >= 1.9x); 8 procs / 2 procs = {cnn[8]['vs_2']:.2f}x (target >= 0.9x)")
    starts = [fresh_startup(tasks[0], max(procs_list), args.start_method)
              for _ in range(args.repeats)]
    start = statistics.median(s["startup"] for s in starts)
    command = statistics.median(s["from_command"] for s in starts)
    loads = [s["load"] for s in starts]
    verdict = "met" if command <= STARTUP_TARGET else "NOT met"
    note = (f"{max(procs_list)}-process start-up of a fresh `asyncsgd hogwild --task {tasks[0]}` "
            f"(--start-method {args.start_method}, median of {args.repeats}): {command:.2f} s "
            f"from the command to every worker training, imports included ({start:.2f} s from "
            f"train()); target <= {STARTUP_TARGET:g} s from the command: {verdict}; 1-min load "
            f"{min(loads):.2f}-{max(loads):.2f}")
    print(note)
    text += "\n\n" + note
    if not args.no_save:
        save_results("hogwild_scaling", text, table)
        draw(table, cores, RESULTS / "hogwild_scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
