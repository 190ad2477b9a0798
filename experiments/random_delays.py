"""Random delays: time to target when every worker's step is delayed by an exponential
random time of mean 0.5x, 1x and 2x the step time, in every mode.

    python experiments/random_delays.py                       # 4 conditions x 6 modes, ~8 min
    python experiments/random_delays.py --means 1 --modes ddp,ps-async --budget 30

First one ``asyncsgd compare`` without delays, whose Hogwild run gives the step time T
(seconds per step of one worker: processes x batch / samples per second, with the
workers sharing this machine's cores); then, for each multiple m, one with

    asyncsgd compare --task mnist1d-cnn --procs 4 --delay exp:<m x T> --target 0.85 \\
        --stop-at-target --modes ddp,ps-sync,ps-backup,ps-ssp,ps-async,hogwild

Every rank draws its own delays (seeded by --seed and rank) after computing each
gradient. The published shape (Dutta et al., AISTATS 2018, "Slow and stale gradients
can win the race"): with random delays a synchronous step waits for the maximum of N
delays (for exponential delays, about H_N = 1 + 1/2 + ... + 1/N times the mean: 2.08x
for N = 4), an asynchronous one for one; so async's time per update grows less, and
the error-runtime trade-off favours async the more the delays vary, while sync with
backup workers waits for the N-B fastest (about H_N - H_B: 1.08x the mean for B = 1).
Writes ``experiments/results/random_delays.md`` (time and samples to target per mode
and condition, and the shape found, computed from the table), ``.json`` and ``.png``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from stragglers import arguments, measure, plot, report, run_by, table

NAME = "random_delays"


def step_seconds(rows: list, procs: int, batch: int) -> float:
    """Seconds per step of one worker in the delay-free Hogwild run (all workers sharing
    the cores), from its samples/s."""
    hog = next(r for r in rows if r["mode"] == "hogwild" and r["samples_per_second"])
    return procs * batch / hog["samples_per_second"]


def shape(rows: list, means: list, budget: float) -> list:
    """What the table shows, in sentences computed from it."""
    by = {(r["mode"], r["delay"]): r["time_to_target"] for r in rows}
    hi = means[-1]
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        a, b = by.get((mode, 0)), by.get((mode, hi))
        if a is None:
            lines.append(f"- {mode}: did not reach the target without delays within "
                         f"{budget:g} s.")
        elif b is None:
            lines.append(f"- {mode}: {a:.1f} s without delays; not within {budget:g} s with "
                         f"delays of mean {hi:g}x the step.")
        else:
            lines.append(f"- {mode}: {a:.1f} s without delays, {b:.1f} s with delays of mean "
                         f"{hi:g}x the step ({b / a:.2f}x as long).")
    for m in means[1:]:
        sync, fast = by.get(("ps-sync", m)), by.get(("ps-async", m))
        if sync and fast:
            lines.append(f"- Delays of mean {m:g}x: ps-async reached the target "
                         f"{sync / fast:.2f}x sooner than ps-sync ({fast:.1f} s vs {sync:.1f} s).")
    return lines


def main() -> int:
    ap = arguments(__doc__)
    ap.add_argument("--batch", type=int, default=32, help="the task's batch (mnist1d: 32)")
    ap.add_argument("--means", default="0.5,1,2", help="delay means, in step times")
    args = ap.parse_args()
    if "hogwild" not in args.modes.split(","):
        ap.error("--modes must include hogwild: its delay-free run gives the step time")
    multiples = sorted(float(m) for m in args.means.split(","))
    runs = Path(args.runs or f"runs/{NAME}-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.monotonic()
    rows = measure(args, 0, runs / "none", key="delay", script=NAME)
    step = step_seconds(rows, args.procs, args.batch)
    for m in multiples:
        rows += measure(args, m, runs / f"exp{m:g}", key="delay",
                        delay=f"exp:{m * step * 1000:.1f}ms", script=NAME)
    means = [0, *multiples]
    lines = [f"# Time (and samples) to {args.target:.0%} with random delays on all "
             f"{args.procs} workers", "",
             f"{run_by(NAME, started)}: task {args.task}, seed {args.seed}, "
             f"budget {args.budget:g} s "
             f"per run (start-up included). Step time T = {step * 1000:.1f} ms (one worker's "
             "step in the delay-free Hogwild run, the 4 workers sharing 2 cores); columns: "
             "exponential delays of mean m x T after every step of every worker. Each cell "
             "one run: training seconds to the target / training samples (all workers) to it.",
             "", *table(rows, "delay", means,
                        ["none", *(f"{m:g} T ({m * step * 1000:.0f} ms)" for m in multiples)],
                        args.budget)]
    lines += ["", "What it shows (computed from the table):", "",
              *shape(rows, means, args.budget), "", f"![time to target]({NAME}.png)"]
    return report(NAME, lines, {"step_seconds": step, "rows": rows}, lambda path: plot(
        rows, "delay", means, ["none", *(f"{m:g}x" for m in multiples)],
        "mean exponential delay per step, in step times (every worker)",
        f"Time to target with random delays ({args.task}, {args.procs} workers, 2 cores)",
        path), args.no_save, rows)


if __name__ == "__main__":
    sys.exit(main())
