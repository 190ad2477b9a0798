"""Async vs sync: time to accuracy of single, Hogwild, PS async/ssp/sync and DDP on mnist1d-cnn.

    python experiments/async_vs_sync.py                  # 6 modes x 2 repeats x 60 s, ~13 min
    python experiments/async_vs_sync.py --budget 20 --repeats 1   # a quick look

A thin wrapper around the command that does the work,

    asyncsgd compare --task mnist1d-cnn --procs 2 --budget 60 --target 0.9 --repeats 2

(same owned processes, seeds, batch per process and budget for every mode;
repeats interleaved), followed by copying its report into
``experiments/results/``: ``async_vs_sync.md`` (the report without the list of
local run directories), ``async_vs_sync.json`` (compare's results.json) and
``async_vs_sync_<plot>.png``. The run directories stay in ``--runs``
(default ``runs/async-vs-sync-<time>``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from asyncsgd.comparison.runner import compare
from asyncsgd.analysis.plots import PLOTS
from asyncsgd.config import COMPARE_MODES, CompareConfig
from results import RESULTS  # this script's folder

NAME = "async_vs_sync"


def publish_copy(out: Path, extra_note: str) -> None:
    """compare's report.md, results.json and PNGs, renamed into experiments/results/."""
    RESULTS.mkdir(exist_ok=True)
    report = (out / "report.md").read_text()
    report = report.split("\n## Runs\n")[0].rstrip() + "\n"  # local paths: not committed
    for png, _ in PLOTS:
        shutil.copyfile(out / png, RESULTS / f"{NAME}_{png}")
        report = report.replace(f"]({png})", f"]({NAME}_{png})")
    report = re.sub(r"^Command: .*$", lambda m: m.group(0) + "\n\n" + extra_note, report,
                    count=1, flags=re.M)
    (RESULTS / f"{NAME}.md").write_text(report)
    results = json.loads((out / "results.json").read_text())
    (RESULTS / f"{NAME}.json").write_text(json.dumps(results, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="mnist1d-cnn")
    ap.add_argument("--modes", default=COMPARE_MODES)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--budget", type=float, default=60.0, help="training seconds per run")
    ap.add_argument("--target", type=float, default=0.9, help="accuracy whose crossing is timed")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--runs", default=None, help="compare's output directory")
    ap.add_argument("--no-save", action="store_true", help="leave experiments/results alone")
    args = ap.parse_args()
    out = Path(args.runs or f"runs/async-vs-sync-{time.strftime('%Y%m%d-%H%M%S')}")
    argv = ["asyncsgd", "compare", "--task", args.task, "--modes", args.modes,
            "--procs", str(args.procs), "--budget", f"{args.budget:g}",
            "--target", f"{args.target:g}", "--repeats", str(args.repeats),
            "--out", str(out)]
    started = time.monotonic()
    result = compare(CompareConfig(task=args.task, modes=args.modes, procs=args.procs,
                                   budget=args.budget, target=args.target,
                                   repeats=args.repeats, out=str(out), progress="log"),
                     argv=argv)
    print(result.table)
    if not args.no_save:
        command = " ".join(["python experiments/async_vs_sync.py", *sys.argv[1:]])
        publish_copy(result.out, f"Run by `{command}` in "
                     f"{(time.monotonic() - started) / 60:.0f} min on a shared machine.")
    for a in result.failed:
        print(f"FAILED {a.label} (repeat {a.repeat + 1}): {a.error}", file=sys.stderr)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
