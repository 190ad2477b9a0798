"""Staleness in isolation: samples to target as each gradient is applied S = 0, 1, 4, 16
steps late, with sgd, momentum and adam, on a shallow and a deep model.

    python experiments/staleness_sensitivity.py              # 4 S x 3 rules x 2 models x 2 seeds
    python experiments/staleness_sensitivity.py --staleness 0,4 --seeds 1

Every cell is ``asyncsgd single --simulate-staleness S`` (one process, so throughput
plays no part: only statistical efficiency), e.g.

    asyncsgd single --task mnist1d-mlp:width=128,depth=6 --optimizer adam --lr 0.001 \\
        --simulate-staleness 4 --epochs 15 --threads 1 --delay const:4ms

Every run trains all its epochs; from its metrics.jsonl come the samples until the first
evaluation at --target and the final accuracy (the mean of the last epoch's evaluations:
one evaluation of 1,000 test samples moves by a few points from one to the next).

Models: MNIST-1D MLPs of width 128 with 1 hidden layer (shallow) and 6 (deep). Rules:
plain SGD (lr 0.1), SGD with momentum 0.9 (lr 0.01: the same effective step) and Adam
(lr 0.001). Beside them, the staleness a real parameter server measured: ps-async with
2, 4 and 8 workers of one thread each (``asyncsgd compare --modes ps-async``; mean and
p50/p95/p99 of its histogram of updates between a worker's pull and its push, the unit
of S: a gradient applied S steps late has S other updates between its model and its
application), so a reader sees which S a cluster of that size stages.

The published shape (Dai et al., ICLR 2019, "Toward understanding the impact of
staleness in distributed machine learning"): staleness costs more samples the deeper
the model and with adaptive optimizers and momentum than with plain SGD. Writes
``experiments/results/staleness_sensitivity.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from asyncsgd.comparison.runner import compare
from asyncsgd.config import CompareConfig, SingleConfig
from asyncsgd.modes.single import train
from asyncsgd.run.metrics import eval_curve, samples_to_target
from asyncsgd.run.rundir import RunDir
from stragglers import save

NAME = "staleness_sensitivity"
MODELS = {"shallow (1 hidden layer)": "mnist1d-mlp:width=128,depth=1",
          "deep (6 hidden layers)": "mnist1d-mlp:width=128,depth=6"}
RULES = {"sgd": dict(optimizer="sgd", lr=0.1),
         "momentum 0.9": dict(optimizer="sgd", lr=0.01, momentum=0.9),
         "adam": dict(optimizer="adam", lr=0.001)}


def one_run(task: str, rule: dict, staleness: int, seed: int, args) -> dict:
    # single evaluates at its checks, every 0.2 s: at this MLP's ~40,000 samples/s that is
    # every ~8,000 samples, too coarse to tell S=0 from S=1. A constant wait after each
    # step (--delay, the straggler dial) slows the steps so that checks, hence
    # evaluations, come every ~1,300 samples; it changes no gradient.
    # No --target: every run trains all its epochs, so its final accuracy is comparable.
    with tempfile.TemporaryDirectory() as tmp:
        result = train(SingleConfig(
            task=task, epochs=args.epochs, seed=seed, threads=1,
            eval_every=0.05, checkpoint_every=0, progress="off", delay=args.step_delay,
            simulate_staleness=staleness, out=str(Path(tmp) / "run"), **rule))
        events = list(RunDir.open(result.run_dir).events())
    curve = eval_curve(events)
    per_epoch = result.summary["samples"] / args.epochs
    last_epoch = [score for _, samples, score in curve
                  if samples > result.summary["samples"] - per_epoch]
    return {"samples_to_target": samples_to_target(events, args.target),
            "final_accuracy": statistics.fmean(last_epoch),
            "best_accuracy": max(score for _, _, score in curve),
            "samples": result.summary["samples"], "evaluations": len(curve)}


def measure(args, staleness: list, seeds: list) -> list:
    rows = []
    for model, task in MODELS.items():
        for rule_name, rule in RULES.items():
            for s in staleness:
                runs = [one_run(task, rule, s, seed, args) for seed in seeds]
                reached = [r["samples_to_target"] for r in runs if r["samples_to_target"]]
                rows.append({"model": model, "rule": rule_name, "staleness": s,
                             "reached": len(reached), "runs": len(runs),
                             "samples_to_target": statistics.fmean(reached) if reached else None,
                             "final_accuracy": statistics.fmean(r["final_accuracy"] for r in runs),
                             "best_accuracy": statistics.fmean(r["best_accuracy"] for r in runs),
                             "per_seed": runs})
                print({k: v for k, v in rows[-1].items() if k != "per_seed"}, flush=True)
    return rows


def quantile(hist: list, q: float) -> int:
    """The value at quantile ``q`` of a histogram (bucket i counts staleness i), as the
    server computes its p50/p99 (asyncsgd.servers.evaluator.percentile)."""
    total, seen = sum(hist), 0
    for value, count in enumerate(hist):
        seen += count
        if seen >= q * total:
            return value
    return len(hist) - 1


def ps_staleness(args) -> list:
    """Mean and p50/p95/p99 staleness of ps-async with 2, 4, 8 one-thread workers here."""
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (2, 4, 8):
            result = compare(CompareConfig(
                task=MODELS["shallow (1 hidden layer)"], modes="ps-async", procs=workers,
                budget=args.ps_budget, mode_args=("worker=--threads 1",),
                out=str(Path(tmp) / f"w{workers}"), progress="off"),
                argv=["asyncsgd", "compare", f"(experiments/{NAME}.py)"])
            attempt = result.attempts[0]
            hist = (attempt.run.summarized.get("staleness_hist") or []) if attempt.ok else []
            # the server's last bucket counts everything at or past it (asyncsgd.servers.shard)
            row = {"workers": workers, "pushes": sum(hist), "status": attempt.status,
                   "error": attempt.error, "hist": hist}
            if sum(hist):
                row.update(mean=sum(i * c for i, c in enumerate(hist)) / sum(hist),
                           **{f"p{round(q * 100)}": quantile(hist, q) for q in (0.5, 0.95, 0.99)})
            found.append(row)
    return found


def cell(row: dict) -> str:
    if not row["reached"]:
        return f"not reached (best {row['best_accuracy']:.0%})"
    text = f"{row['samples_to_target'] / 1000:,.0f}k"
    return text + ("" if row["reached"] == row["runs"] else f" ({row['reached']}/{row['runs']})")


def accuracy_cell(row: dict) -> str:
    return f"{row['final_accuracy']:.1%}"


def shape(rows: list, staleness: list) -> list:
    by = {(r["model"], r["rule"], r["staleness"]): r for r in rows}
    lo, hi = staleness[0], staleness[-1]
    lines = []
    for model in MODELS:
        for rule in RULES:
            a, b = by[(model, rule, lo)], by[(model, rule, hi)]
            if not a["reached"]:
                lines.append(f"- {model}, {rule}: did not reach the target even at S={lo}.")
            elif not b["reached"]:
                worst = max((s for s in staleness if by[(model, rule, s)]["reached"]))
                lines.append(f"- {model}, {rule}: {a['samples_to_target'] / 1000:,.0f}k "
                             f"samples at S={lo}; the target not reached at S={hi} (last "
                             f"reached at S={worst}; best {b['best_accuracy']:.0%}).")
            else:
                lines.append(f"- {model}, {rule}: {a['samples_to_target'] / 1000:,.0f}k "
                             f"samples at S={lo}, {b['samples_to_target'] / 1000:,.0f}k at "
                             f"S={hi} ({b['samples_to_target'] / a['samples_to_target']:.2f}x).")
            lines[-1] += (f" Final accuracy {a['final_accuracy']:.1%} at S={lo}, "
                          f"{b['final_accuracy']:.1%} at S={hi} "
                          f"({(b['final_accuracy'] - a['final_accuracy']) * 100:+.1f} points).")
    return lines


def plot(rows: list, staleness: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, len(MODELS), figsize=(10, 7.6), sharey="row")
    for ax, model in zip(grid[1], MODELS):
        for rule in RULES:
            ax.plot(*zip(*[(r["staleness"], 100 * r["final_accuracy"]) for r in rows
                           if r["model"] == model and r["rule"] == rule]), marker="o",
                    label=rule)
        ax.set_xscale("symlog", base=2, linthresh=1)
        ax.set_xticks(staleness, [str(s) for s in staleness])
        ax.set_xlabel("simulated staleness S (steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    grid[1][0].set_ylabel("final test accuracy (%)")
    axes = grid[0]
    for ax, model in zip(axes, MODELS):
        for rule in RULES:
            base = next(r for r in rows if r["model"] == model and r["rule"] == rule
                        and r["staleness"] == staleness[0])
            points = [(r["staleness"], r["samples_to_target"] / base["samples_to_target"])
                      for r in rows if r["model"] == model and r["rule"] == rule
                      and r["samples_to_target"] and base["samples_to_target"]]
            if points:
                ax.plot(*zip(*points), marker="o", label=rule)
        ax.set_xscale("symlog", base=2, linthresh=1)
        ax.set_xticks(staleness, [str(s) for s in staleness])
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("samples to target / samples at S=0")
    fig.suptitle("Cost of staleness (single --simulate-staleness, MNIST-1D MLPs)\n"
                 "top: samples to target relative to S=0 (no point: not reached); "
                 "bottom: final accuracy", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--staleness", default="0,1,4,16")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--target", type=float, default=0.4)
    ap.add_argument("--step-delay", default="const:4ms",
                    help="wait after each step, for finer evaluations in samples")
    ap.add_argument("--ps-budget", type=float, default=20.0)
    ap.add_argument("--no-save", action="store_true", help="leave experiments/results alone")
    args = ap.parse_args()
    staleness = sorted(int(s) for s in args.staleness.split(","))
    started = time.monotonic()
    rows = measure(args, staleness, list(range(args.seeds)))
    measured = ps_staleness(args)
    command = " ".join([f"python experiments/{NAME}.py", *sys.argv[1:]])
    runs = [run for r in rows for run in r["per_seed"]]
    spacing = statistics.fmean(run["samples"] / run["evaluations"] for run in runs)

    def table(render) -> list:
        out = ["| model | rule | " + " | ".join(f"S={s}" for s in staleness) + " |",
               "|---|---|" + "---:|" * len(staleness)]
        for model in MODELS:
            for rule in RULES:
                out.append(f"| {model} | {rule} | " + " | ".join(
                    render(next(r for r in rows if r["model"] == model and r["rule"] == rule
                                and r["staleness"] == s)) for s in staleness) + " |")
        return out

    lines = [f"# Samples to {args.target:.0%} and final accuracy as gradients are applied S "
             "steps late", "",
             f"Run by `{command}` in {(time.monotonic() - started) / 60:.0f} min: "
             f"`single --simulate-staleness S --threads 1`, {args.epochs} epochs of MNIST-1D "
             f"(4,000 training samples, batch 32), mean over {args.seeds} seed(s). Each step "
             f"waits --delay {args.step_delay} so that evaluations come every "
             f"~{spacing:,.0f} samples.", "",
             f"Training samples until the first evaluation at {args.target:.0%} test accuracy "
             "(\"not reached\": no seed reached it within the epochs; (1/2): one seed did):",
             "", *table(cell), "",
             f"Final test accuracy after {args.epochs} epochs (mean of the last epoch's "
             "evaluations, then of the seeds):", "", *table(accuracy_cell), "",
             "What it shows (computed from the tables):", "", *shape(rows, staleness), "",
             "The staleness a real parameter server staged on this machine (ps-async, "
             f"{MODELS['shallow (1 hidden layer)']}, one thread per worker, "
             f"{args.ps_budget:g} s; updates between a worker's pull and its push, the unit "
             "of S):", "", "| workers | pushes | mean | p50 | p95 | p99 |",
             "|---:|---:|---:|---:|---:|---:|",
             *(f"| {m['workers']} | {m['pushes']:,} | {m['mean']:.1f} | {m['p50']} | "
               f"{m['p95']} | {m['p99']} |" if m.get("mean") is not None else
               f"| {m['workers']} | {m['pushes']} | {m['status']}: "
               f"{m['error'] or 'no push within the budget'} | | | |" for m in measured),
             "", f"![cost of staleness]({NAME}.png)"]
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        save(NAME, text, {"rows": rows, "ps_staleness": measured},
             lambda path: plot(rows, staleness, path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
