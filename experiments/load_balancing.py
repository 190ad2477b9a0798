"""Load balancing: what data on demand, speed-sized batches and DyLU recover of a straggler's cost.

    python experiments/load_balancing.py --part real        # 2 workers, real clock (~40 min)
    python experiments/load_balancing.py --part virtual4    # 4 workers, virtual clock
    python experiments/load_balancing.py --part virtual64   # 64 workers, virtual clock (~1 hour)
    python experiments/load_balancing.py --report           # the report from what has run

(experiments/README.md, "Load balancing", lists the commands behind the committed results.)

Each part first runs the plain modes unslowed with ``--tune lr`` (each mode its own lr) and
3 repeats; then every mode, balanced or not, with the straggler(s) and 3 repeats, at the lr
its plain mode was tuned to (balancing keeps each update's rule and global batch, so the
plain mode's lr is the balanced one's too; the report says so):

- **real**: ``asyncsgd compare``, 2 workers, rank 1 slowed 4x (``--slowdown 1:4``), a batch of
  256 a worker: a step of mnist1d-cnn costs about 0.55 ms whatever its batch, plus about
  11 us a row (measured here), so batches of 32 would leave nothing for balancing to move.
- **virtual4**: ``asyncsgd simulate``, 4 workers, rank 3 slowed 4x, the task's batch.
- **virtual64**: ``asyncsgd simulate``, 64 workers whose speeds are drawn once from a
  lognormal of sigma 0.5 (``--worker-speeds lognormal:0.5``), the task's batch.

Modes: ddp and ddp+balance; ps-sync, ps-sync+balance and ps-backup; ps-async and
ps-async+dynamic; diloco:8 and diloco:auto:8. Each cell is one compare or simulate into
SCRATCH/<part>/<cell> (default runs/load_balancing), reused when it finished, so an
interrupted part goes on where it stopped. The report: experiments/results/load_balancing.{md,json}
and load_balancing.png (each mode's time over its plain mode's unslowed time).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from asyncsgd.analysis.report import Spread
from asyncsgd.comparison.runner import compare
from asyncsgd.config import CompareConfig, SimulateConfig
from asyncsgd.simulator.simulate import simulate
from results import RESULTS

NAME = "load_balancing"
TASK, TARGET, REPEATS = "mnist1d-cnn", 0.85, 3
DONE = "done"
PARTS = {
    "real": dict(clock="real", workers=2, slowed="--slowdown 1:4", batch=256, budget=150.0,
                 backup="ps-backup:1"),
    "virtual4": dict(clock="virtual", workers=4, slowed="--slowdown 3:4", batch=None,
                     budget=120.0, backup="ps-backup:1"),
    "virtual64": dict(clock="virtual", workers=64, slowed="--worker-speeds lognormal:0.5",
                      batch=None, budget=60.0, backup="ps-backup:4"),
}
# The virtual parts' step (of the task's batch of 32; a balanced worker's scales per row):
# given, not profiled, so that every cell (one simulate each) is charged alike; the order
# of a real mnist1d-cnn step here (0.75 ms on one thread), rounded up as at_scale.py's.
# Evaluations every 10 steps' time: times to the target are read at that resolution.
VIRTUAL = dict(step_time="2ms", eval_every=0.02)
# (the plain mode, the balanced variants that carry its tuned lr)
FAMILIES = (("ddp", ("ddp+balance",)),
            ("ps-sync", ("ps-sync+balance", "BACKUP")),
            ("ps-async", ("ps-async+dynamic",)),
            ("diloco:8", ("diloco:auto:8",)))
BOUND = {"real": 1.6, "virtual4": 1.23}  # the compute left after one 4x straggler


def modes_of(part: str) -> list:
    backup = PARTS[part]["backup"]
    return [(plain, [plain] + [backup if m == "BACKUP" else m for m in variants])
            for plain, variants in FAMILIES]


def cell(scratch: Path, part: str, name: str, say, **settings) -> dict:
    """One compare or simulate (reused when it finished): its results.json and summaries."""
    out = scratch / part / name
    if not (out / DONE).exists():
        if out.exists():  # an interrupted cell starts again
            shutil.rmtree(out)
        p = PARTS[part]
        say(f"{part}/{name}: running")
        common = dict(task=TASK, target=TARGET, stop_at_target=True, out=str(out),
                      progress="log", repeats=REPEATS, budget=p["budget"],
                      batch_size=p["batch"], **settings)
        argv = ["experiments/load_balancing.py", part, name]
        if p["clock"] == "real":
            compare(CompareConfig(procs=p["workers"], **common), argv=argv)
        else:
            simulate(SimulateConfig(workers=p["workers"], **VIRTUAL, **common), argv=argv)
        (out / DONE).write_text("")
    return read_cell(out)


def read_cell(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    runs = []
    for run in results["runs"]:
        path = out / Path(run["run_dir"]).name / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else {}
        runs.append({"mode": base(run["mode"]), "seed": run.get("seed"),
                     "status": run["status"], "time_to_target": run.get("time_to_target"),
                     "samples_to_target": run.get("samples_to_target"),
                     "final_metric": run.get("final_metric"),
                     "coverage": (summary.get("coverage") or {}).get("spread"),
                     "rehanded": summary.get("rehanded")})
    lrs = {m: t["chosen"] for m, t in (results.get("tuning") or {}).items()}
    return {"runs": runs, "lr": lrs, "lr_default": results["config"].get("lr")
            or results["task"]["lr"]}


def base(label: str) -> str:
    return re.sub(r" \(lr [^)]*\)$", "", label)


def run_part(part: str, scratch: Path, say) -> None:
    families = modes_of(part)
    plain = ",".join(p for p, _ in families)
    tuned = cell(scratch, part, "unslowed", say, modes=plain, tune="lr")
    for fam, modes in families:
        lr = tuned["lr"].get(fam, tuned["lr_default"])
        for mode in modes:
            cell(scratch, part, f"slowed-{slug(mode)}", say, modes=mode, lr=lr,
                 **slowed_settings(part))


def slowed_settings(part: str) -> dict:
    flag, value = PARTS[part]["slowed"].split(" ")
    return {flag[2:].replace("-", "_"): value}


def slug(mode: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", mode)


# ---- the report --------------------------------------------------------------------------

def spread(values: list, fmt: str = "{:.1f}") -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "—"
    s = Spread(got)
    return f"{fmt.format(s.median)} ({fmt.format(s.lo)}–{fmt.format(s.hi)})"


def median(values: list):
    got = [v for v in values if v is not None]
    return Spread(got).median if got else None


def report(scratch: Path) -> tuple:
    lines = ["# Load balancing", "",
             "Written by `python experiments/load_balancing.py --report` from its cells "
             f"(`--scratch`). mnist1d-cnn to {TARGET:.0%} test accuracy, {REPEATS} repeats a "
             "mode (seeds 0–2): median (min–max). Each plain mode's lr was tuned unslowed "
             "(`--tune lr`); its balanced variants ran at that lr.", ""]
    rows = []
    for part, p in PARTS.items():
        if not (scratch / part / "unslowed" / DONE).exists():
            continue
        unslowed = read_cell(scratch / part / "unslowed")
        clock = ("real clock on this 2-core machine: ddp 2 processes; the parameter-server "
                 "modes 2 workers + the server and its shard, 4 processes (oversubscribed)"
                 if p["clock"] == "real" else "virtual clock")
        lines += [f"## {part}: {p['workers']} workers, {p['slowed']} ({clock})", "",
                  "| mode | lr | time to target, s | × unslowed | samples to target | "
                  "final acc. | coverage spread | runs at target |",
                  "|---|---|---|---|---|---|---|---|"]
        for fam, modes in modes_of(part):
            ref = median([r["time_to_target"] for r in unslowed["runs"] if r["mode"] == fam])
            lr = unslowed["lr"].get(fam, unslowed["lr_default"])
            lines.append(f"| {fam}, unslowed | {lr:g} | " + cells(
                [r for r in unslowed["runs"] if r["mode"] == fam], ref))
            for mode in modes:
                out = scratch / part / f"slowed-{slug(mode)}"
                if not (out / DONE).exists():
                    lines.append(f"| {mode} | {lr:g} | not run | | | | | |")
                    continue
                runs = read_cell(out)["runs"]
                lines.append(f"| {mode} | {lr:g} | " + cells(runs, ref))
                t = median([r["time_to_target"] for r in runs])
                rows.append({"part": part, "mode": mode, "lr": lr, "unslowed": ref,
                             "time_to_target": t, "ratio": t / ref if t and ref else None,
                             "bound": BOUND.get(part), "runs": runs})
        lines.append("")
    return "\n".join(lines), rows


def cells(runs: list, ref) -> str:
    times = [r["time_to_target"] for r in runs]
    t = median(times)
    ratio = f"{t / ref:.2f}" if t and ref else "—"
    hit = sum(1 for x in times if x is not None)
    samples = spread([r["samples_to_target"] for r in runs], "{:,.0f}")
    return (f"{spread(times)} | {ratio} | {samples}"
            f" | {spread([r['final_metric'] for r in runs], '{:.3f}')}"
            f" | {spread([r['coverage'] for r in runs], '{:.2f}')} | {hit}/{len(runs)} |")


def plot(rows: list, path: Path) -> None:
    """Each part's modes: median time to the target over their plain mode's unslowed time,
    the min–max spread as a bar, the bound the compute left sets as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = [p for p in PARTS if any(r["part"] == p for r in rows)]
    if not parts:
        return
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.2), squeeze=False)
    for ax, part in zip(axes[0], parts):
        mine = [r for r in rows if r["part"] == part and r["ratio"] is not None]
        ratios = []
        for r in mine:
            times = [x["time_to_target"] for x in r["runs"] if x["time_to_target"] is not None]
            ratios.append((r["ratio"], min(times) / r["unslowed"], max(times) / r["unslowed"]))
        xs = range(len(mine))
        ax.bar(xs, [m for m, _, _ in ratios], color="#4c72b0",
               yerr=[[m - lo for m, lo, _ in ratios], [hi - m for m, _, hi in ratios]],
               capsize=3)
        ax.axhline(1.0, color="black", lw=0.8)
        if BOUND.get(part):
            ax.axhline(BOUND[part], color="#c44e52", ls="--", lw=1,
                       label=f"bound {BOUND[part]}x (the compute left)")
            ax.legend(loc="upper right", fontsize=8)
        ax.set_xticks(list(xs), [r["mode"] for r in mine], rotation=45, ha="right",
                      fontsize=8)
        ax.set_ylabel(f"time to {TARGET:.0%} / the plain mode's unslowed")
        ax.set_title(f"{part}: {PARTS[part]['workers']} workers, {PARTS[part]['slowed']}",
                     fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=sorted(PARTS), action="append", default=[])
    ap.add_argument("--report", action="store_true", help="only write the report")
    ap.add_argument("--scratch", type=Path, default=Path("runs") / NAME)
    args = ap.parse_args()
    say = lambda text: print(f"[{NAME}] {text}", file=sys.stderr, flush=True)  # noqa: E731
    for part in ([] if args.report else args.part or list(PARTS)):
        run_part(part, args.scratch, say)
    table, rows = report(args.scratch)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{NAME}.md").write_text(table + "\n")
    (RESULTS / f"{NAME}.json").write_text(json.dumps(rows, indent=2) + "\n")
    plot(rows, RESULTS / f"{NAME}.png")
    print(table)


if __name__ == "__main__":
    main()
