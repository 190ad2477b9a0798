"""Staleness: PS async with 1, 2, 4, 8 workers, plain, with staleness-scaled lr and with DC-ASGD.

    python experiments/staleness.py                                   # 24 runs x 25 s, ~14 min
    python experiments/staleness.py --workers 1,4 --budget 10 --repeats 1 --no-save
    python experiments/staleness.py --plot-only     # redraw the PNGs from staleness.json's runs

Every run is one ``asyncsgd compare --modes ps-async --procs W`` with the
variant's server flags (``--mode-args 'ps-async=--staleness-lr'`` or
``'ps-async=--dc-asgd 0.04'``): the same owned server and worker processes,
seeds and budget as the compare command. Every worker runs one torch thread
(``--mode-args 'worker=--threads 1'``), whatever W: one worker with two
threads would otherwise run a different, and on a busy machine much slower,
step than eight with one. This script only chooses the grid, runs it
``--repeats`` times in alternating order (drift on a shared machine then hits
every configuration alike; repeat r uses seed + r), relabels the runs and
writes one report over all of them.

Writes into ``experiments/results/``: ``staleness.md`` (tables),
``staleness.json`` (every run's numbers), ``staleness_accuracy_vs_samples.png``
(one panel per variant, one line per worker count: convergence per sample,
where staleness shows), ``staleness_accuracy_vs_time.png``. The run
directories stay in ``--runs`` (default ``runs/staleness-<time>``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from asyncsgd.analysis.report import Attempt, mode_rows, render_table
from asyncsgd.comparison.runner import compare
from asyncsgd.config import CompareConfig
from asyncsgd.run.metrics import eval_curve
from asyncsgd.run.process_group import available_cores
from asyncsgd.run.reader import Run
from results import RESULTS, save_results  # this script's folder

VARIANTS = {"plain": "", "staleness-lr": "--staleness-lr", "dc-asgd": "--dc-asgd {lam:g}"}
FIGURE_DPI = 80


def label(variant: str, workers: int) -> str:
    return f"{variant}, {workers} worker{'s' if workers > 1 else ''}"


def samples_to(events: list, target: float):
    """Training samples at the first evaluation at or above ``target`` (None: never)."""
    return next((s for _, s, a in eval_curve(events) if a >= target), None)


def run_grid(args, runs_root: Path) -> list:
    """Every (repeat, variant, workers) as its own compare; the attempts, relabelled."""
    grid = [(v, w) for v in args.variants for w in args.workers]
    attempts = []
    for r in range(args.repeats):
        for variant, workers in (grid if r % 2 == 0 else list(reversed(grid))):
            flags = VARIANTS[variant].format(lam=args.dc_lambda)
            cfg = CompareConfig(
                task=args.task, modes="ps-async", procs=workers, budget=args.budget,
                target=args.target, seed=args.seed + r, eval_every=args.eval_every,
                mode_args=("worker=--threads 1",) + ((f"ps-async={flags}",) if flags else ()),
                progress=args.progress,
                out=str(runs_root / f"{variant}-w{workers}-r{r + 1}"))
            print(f"repeat {r + 1}/{args.repeats}: {label(variant, workers)}", file=sys.stderr)
            result = compare(cfg, argv=["asyncsgd", "compare", "--modes", "ps-async",
                                        "--procs", str(workers), "--budget", f"{args.budget:g}",
                                        "--seed", str(args.seed + r),
                                        "--mode-args", "worker=--threads 1"]
                             + (["--mode-args", f"ps-async={flags}"] if flags else []))
            for a in result.attempts:
                a.label, a.repeat = label(variant, workers), r
                if not a.ok:
                    print(f"  FAILED: {a.error}", file=sys.stderr)
            attempts += result.attempts
    return attempts


def _mean(values: list):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def per_sample_table(attempts: list, args) -> tuple:
    """Variant x workers: mean samples to --target and mean final accuracy."""
    cells, rows = {}, []
    for variant in args.variants:
        for w in args.workers:
            runs = [a.run for a in attempts if a.ok and a.label == label(variant, w)]
            reached = [samples_to(r.events, args.target) for r in runs]
            final = _mean([r.summarized.get("final_metric") for r in runs])
            p50 = _mean([r.summarized.get("staleness_p50") for r in runs])
            mean_reached = _mean(reached)
            cells[(variant, w)] = (
                ("—" if mean_reached is None else f"{mean_reached / 1000:,.0f}k")
                + f" ({sum(x is not None for x in reached)}/{len(runs)})"
                + ("" if final is None else f", {final * 100:.1f}%"))
            rows.append({"variant": variant, "workers": w, "runs": len(runs),
                         "samples_to_target": reached, "final_accuracy_mean": final,
                         "staleness_p50_mean": p50})
    head = "| variant | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}"
                                       for w in args.workers) + " |"
    lines = [head, "|---|" + "---:|" * len(args.workers)]
    for variant in args.variants:
        lines.append(f"| {variant} | "
                     + " | ".join(cells[(variant, w)] for w in args.workers) + " |")
    return "\n".join(lines), rows


def draw(attempts: list, args, out: Path) -> list:
    """Accuracy vs samples (x = 1) and vs time (x = 0), one panel per variant."""
    from matplotlib.figure import Figure
    written = []
    for name, x, xlabel in (("staleness_accuracy_vs_samples.png", 1, "training samples"),
                            ("staleness_accuracy_vs_time.png", 0, "training seconds")):
        fig = Figure(figsize=(4.0 * len(args.variants), 3.4), dpi=FIGURE_DPI,
                     layout="constrained")
        axes = fig.subplots(1, len(args.variants), sharey=True, squeeze=False)[0]
        for ax, variant in zip(axes, args.variants):
            ax.set_title(f"PS async, {variant}")
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            ax.axhline(args.target * 100, color="grey", linestyle="--", linewidth=0.8)
            for i, w in enumerate(args.workers):
                runs = [a.run for a in attempts if a.ok and a.label == label(variant, w)]
                for k, run in enumerate(runs):
                    curve = eval_curve(run.events)
                    ax.plot([p[x] for p in curve], [p[2] * 100 for p in curve],
                            color=f"C{i}", linewidth=1.1, alpha=0.8,
                            label=label(variant, w).split(", ")[1] if k == 0 else None)
            ax.set_ylim(args.ylim, 100)
        axes[0].set_ylabel("test accuracy (%)")
        axes[-1].legend(fontsize="small", loc="lower right")
        fig.savefig(out / name, dpi=FIGURE_DPI)
        written.append(name)
    return written


def saved_attempts() -> list:
    """The attempts of the last saved run, read back from their run directories."""
    record = json.loads((RESULTS / "staleness.json").read_text())
    return [Attempt(r["mode"], r["repeat"], r["seed"], r["status"], r["error"],
                    Run.read(r["run_dir"]) if r["status"] == "ok" else None, r["run_dir"])
            for r in record["runs"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="mnist1d-cnn")
    ap.add_argument("--workers", default="1,2,4,8", help="comma-separated worker counts")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--dc-lambda", type=float, default=0.04, help="DC-ASGD lambda")
    ap.add_argument("--budget", type=float, default=25.0, help="training seconds per run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.85,
                    help="accuracy whose first crossing is timed and counted in samples")
    ap.add_argument("--eval-every", type=float, default=1.0)
    ap.add_argument("--ylim", type=float, default=40.0, help="lowest accuracy %% plotted")
    ap.add_argument("--runs", default=None, help="directory for the run directories")
    ap.add_argument("--progress", default="log", choices=["log", "off"])
    ap.add_argument("--no-save", action="store_true", help="print the tables only")
    ap.add_argument("--plot-only", action="store_true",
                    help="run nothing: redraw the PNGs from the runs staleness.json lists")
    args = ap.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    args.variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if args.plot_only:
        draw(saved_attempts(), args, RESULTS)
        return 0
    runs_root = Path(args.runs or f"runs/staleness-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.monotonic()
    attempts = run_grid(args, runs_root)

    rows = mode_rows(attempts, args.target, baseline=label("plain", 1))
    samples_md, sample_rows = per_sample_table(attempts, args)
    text = "\n".join([
        f"PS async on {args.task}, {available_cores()} cores, {args.repeats} repeat(s) x "
        f"{args.budget:g} s per configuration, plain SGD at the task's lr; DC-ASGD lambda "
        f"{args.dc_lambda:g} ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"{(time.monotonic() - started) / 60:.0f} min in all)", "",
        f"Samples to {args.target * 100:g}% test accuracy (runs that reached it), and mean "
        "final accuracy:", "", samples_md, "",
        "Every run (speed-ups are against plain with 1 worker):", "",
        render_table(rows, args.target)])
    print(text)
    if not args.no_save:
        figures = draw(attempts, args, RESULTS)
        save_results("staleness", text, {
            "command": "python experiments/staleness.py " + " ".join(
                shlex.quote(a) for a in sys.argv[1:]),
            "settings": {k: v for k, v in vars(args).items()},
            "per_sample": sample_rows, "modes": [r.to_dict() for r in rows],
            "runs": [a.to_dict(args.target) for a in attempts], "figures": figures})
    failed = [a for a in attempts if not a.ok]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
