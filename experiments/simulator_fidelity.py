"""How far the virtual clock is from the real one: real runs against their simulations.

    python experiments/simulator_fidelity.py                 # 3 seeds, about 15 minutes
    python experiments/simulator_fidelity.py --seeds 1 --modes ps-async,ddp

Real runs have no more processes than cores (2 workers on 2 cores) so that the clock they
measure is the algorithm's, not the scheduler's: ``asyncsgd compare --procs 2`` of
ps-async, ps-sync, ddp and diloco:8, and ps-backup:1 with rank 1 four times slower, each
to 85% on mnist1d-cnn. Each is then simulated (``asyncsgd.simulator``) with 2 workers and
the cost model profiled on this machine (``simulator.profile``), the same seeds, the same
evaluation interval. The table puts the medians side by side: training time to the
target (start-up excluded: the virtual clock has none), samples to the target, and
ps-async's staleness. Writes ``experiments/results/simulator_fidelity.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from asyncsgd.comparison.runner import compare
from asyncsgd.config import CompareConfig
from asyncsgd.config.modes import parse_modes
from asyncsgd.core.tasks import load_task
from asyncsgd.run.reader import Run
from asyncsgd.simulator import VirtualSetup, simulate_run
from asyncsgd.simulator import profile
from results import RESULTS

NAME = "simulator_fidelity"
TASK, TARGET, WORKERS = "mnist1d-cnn", 0.85, 2
EVAL_EVERY = 0.25  # seconds, real and virtual: time to target is known to this step
STRAGGLER = "1:4"  # ps-backup:1 is run with rank 1 four times slower, as its purpose is
TOLERANCE = 0.20  # the bar: every cell within 20% of the real run
BUDGET = 90.0


def real_runs(modes: list, seeds: int, slowdown, out: Path) -> dict:
    """{mode: [Run]} of ``asyncsgd compare --procs 2`` with every mode stopped at the target."""
    cfg = CompareConfig(task=TASK, modes=",".join(modes), procs=WORKERS, budget=BUDGET,
                        target=TARGET, stop_at_target=True, repeats=seeds,
                        eval_every=EVAL_EVERY, slowdown=slowdown, progress="off", out=str(out))
    result = compare(cfg, argv=["simulator_fidelity.py"])
    runs: dict = {}
    for attempt in result.attempts:
        if attempt.ok:
            runs.setdefault(attempt.label, []).append(attempt.run)
    return runs


def virtual_runs(modes: list, seeds: int, slowdown, costs, out: Path) -> dict:
    """{mode: [Run]} of the same modes and seeds on the virtual clock."""
    task = load_task(TASK)
    costs = dataclasses.replace(costs, slowdown=((1, 4.0),) if slowdown else ())
    runs: dict = {}
    for spec in parse_modes(",".join(modes)):
        for seed in range(seeds):
            setup = VirtualSetup(workers=WORKERS, seed=seed, costs=costs, target=TARGET,
                                 stop_at_target=True, max_seconds=BUDGET, epochs=1000,
                                 eval_every=EVAL_EVERY)
            result = simulate_run(task, spec, setup, out=str(out / f"{spec.slug}-r{seed}"),
                                  progress="off")
            runs.setdefault(spec.name, []).append(Run.read(result.run_dir))
    return runs


def _median(values: list):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def figures(runs: list) -> dict:
    """Medians over seeds: training seconds and samples to the target, mean staleness."""
    rows = []
    for run in runs:
        events = run.events
        reached = next((e for e in events if e.get("event") == "eval"
                        and e.get("accuracy", 0) >= TARGET), None)
        start = next((e["t"] for e in events if e.get("event") == "train"), 0.0)
        hist = run.summary.get("staleness_hist")
        rows.append({"train_seconds": None if reached is None else reached["t"] - start,
                     "samples": None if reached is None else reached["samples"],
                     "staleness_mean": (sum(i * n for i, n in enumerate(hist)) / sum(hist))
                     if hist and sum(hist) else None})
    keys = ("train_seconds", "samples", "staleness_mean")
    return {key: _median([r[key] for r in rows]) for key in keys} | {"seeds": len(rows)}


def _cell(real, virtual) -> tuple:
    """(text, within the tolerance) of one comparison."""
    if real is None or virtual is None:
        return f"{real} / {virtual}", False
    ratio = virtual / real if real else float("inf")
    return f"{real:.3g} / {virtual:.3g} ({ratio:.2f}x)", abs(ratio - 1) <= TOLERANCE


def table(real: dict, virtual: dict, costs) -> tuple:
    lines = ["| mode | training s to 85%, real / virtual | samples to 85%, real / virtual "
             "| mean staleness, real / virtual |", "|---|---|---|---|"]
    record, misses = [], []
    for mode in real:
        r, v = figures(real[mode]), figures(virtual.get(mode, []))
        cells = []
        for key in ("train_seconds", "samples", "staleness_mean"):
            if key == "staleness_mean" and not mode.startswith("ps-async"):
                cells.append("—")
                continue
            text, ok = _cell(r[key], v[key])
            cells.append(text if ok else f"**{text}**")
            if not ok:
                misses.append(f"{mode} {key}")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        record.append({"mode": mode, "real": r, "virtual": v})
    return lines, record, misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--modes", default="ps-async,ps-sync,ddp,diloco:8")
    args = parser.parse_args()
    modes = args.modes.split(",")
    started = time.time()
    costs = profile.profile(load_task(TASK))
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        tmp = Path(tmp)
        real = real_runs(modes, args.seeds, None, tmp / "real")
        real |= real_runs(["ps-backup:1"], args.seeds, STRAGGLER, tmp / "real-straggler")
        virtual = virtual_runs(modes, args.seeds, False, costs, tmp / "virtual")
        virtual |= virtual_runs(["ps-backup:1"], args.seeds, True, costs, tmp / "virtual-straggler")
        lines, record, misses = table(real, virtual, costs)
    text = "\n".join([
        f"# Virtual clock against real runs: {TASK} to {TARGET:.0%}, {WORKERS} workers on "
        f"{WORKERS} cores", "",
        f"Medians over {args.seeds} seed(s); ps-backup:1 with rank 1 4x slower. Cost model "
        "of the simulations:", "", *profile.describe(costs), "",
        "Cells in bold are more than 20% away from the real run.", "", *lines, "",
        f"{len(misses)} cell(s) outside ±20%: {', '.join(misses) or 'none'}. "
        f"Took {time.time() - started:.0f} s."])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{NAME}.md").write_text(text + "\n")
    (RESULTS / f"{NAME}.json").write_text(json.dumps(
        {"task": TASK, "target": TARGET, "workers": WORKERS, "seeds": args.seeds,
         "costs": repr(costs), "modes": record, "misses": misses}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
