"""Link bandwidth: time to target and throughput of ddp, ps-sync and ps-async as every
process's link narrows from unshaped to 1 Gbit, 200 Mbit and 50 Mbit, on a
communication-heavy model.

    python experiments/link_bandwidth.py                       # 4 links x 3 modes, ~5 min
    python experiments/link_bandwidth.py --links none,50mbit --modes ps-async

For each link one ``asyncsgd compare`` (needs root: network namespaces):

    asyncsgd compare --task mnist1d-mlp:width=512 --procs 2 --link 200mbit --target 0.5 \\
        --stop-at-target --modes ddp,ps-sync,ps-async

With ``--link`` the server, each worker and each DDP rank runs in a network namespace
of its own whose veth link is shaped both ways by a tbf qdisc (``asyncsgd.run.link``);
"none" runs them all on 127.0.0.1 unshaped. The model, an MLP 40-512-512-10, has
288,266 parameters: 1.15 MB of float32 per gradient or parameter copy. A PS step moves
the parameters down and the gradient up through the worker's link and the server's
(which all workers share); a DDP step all-reduces the gradient over the ranks' links.
"Throughput" is samples/s after start-up; "utilisation" is that over the same mode's
unshaped samples/s: the share of its computing speed the link leaves.

Writes ``experiments/results/link_bandwidth.{md,json,png}``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from stragglers import arguments, measure, report, run_by, table

NAME = "link_bandwidth"


def utilisation(rows: list, links: list) -> list:
    """Markdown lines: samples/s per mode and link, and its share of the unshaped rate."""
    rate = {(r["mode"], r["link"]): r["samples_per_second"] for r in rows}
    lines = ["| mode | " + " | ".join(links) + " |", "|---|" + "---|" * len(links)]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        base = rate.get((mode, "none"))
        cells = []
        for link in links:
            r = rate.get((mode, link))
            cells.append("—" if not r else f"{r:,.0f}" + (f" ({r / base:.0%})" if base else ""))
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


def shape(rows: list, links: list, budget: float) -> list:
    """What the tables show, in sentences computed from them."""
    by = {(r["mode"], r["link"]): r for r in rows}
    narrow = links[-1]
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        a, b = by.get((mode, "none"), {}), by.get((mode, narrow), {})
        ra, rb = a.get("samples_per_second"), b.get("samples_per_second")
        ta, tb = a.get("time_to_target"), b.get("time_to_target")
        text = f"- {mode}:"
        if ra and rb:
            text += f" {ra:,.0f} samples/s unshaped, {rb:,.0f} at {narrow} ({rb / ra:.0%})"
        text += (f"; target in {ta:.1f} s unshaped" if ta else
                 f"; target not reached unshaped within {budget:g} s")
        text += (f", {tb:.1f} s at {narrow}." if tb else
                 f", not within {budget:g} s at {narrow}.")
        lines.append(text)
    return lines


def plot(rows: list, links: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    xs = range(len(links))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = {r["link"]: r for r in rows if r["mode"] == mode}
        rate = [mine.get(link, {}).get("samples_per_second") for link in links]
        ttt = [mine.get(link, {}).get("time_to_target") for link in links]
        left.plot([x for x, v in zip(xs, rate) if v], [v for v in rate if v], marker="o",
                  label=mode)
        right.plot([x for x, v in zip(xs, ttt) if v], [v for v in ttt if v], marker="o",
                   label=mode)
    for ax, ylabel in ((left, "samples / s after start-up"),
                       (right, "seconds of training to the target")):
        ax.set_xticks(list(xs), links)
        ax.set_xlabel("every process's link")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Throughput and time to target as the link narrows "
                 "(MLP 40-512-512-10, 2 processes, 2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_links(doc: str, name: str, links: str, enrich=None, **defaults) -> tuple:
    """The command line (``defaults``, and ``--links``, comma-separated rates, 'none' for
    unshaped), then one compare per link: ``(args, links, rows, started)``; ``enrich(link,
    compare directory, rows)`` may add to each link's rows."""
    ap = arguments(doc, **defaults)
    ap.add_argument("--links", default=links)
    args = ap.parse_args()
    links = args.links.split(",")
    runs = Path(args.runs or f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    started = time.monotonic()
    rows = []
    for link in links:
        measured = measure(args, link, runs / link, key="link", script=name,
                           link=None if link == "none" else link)
        rows += enrich(link, runs / link, measured) if enrich else measured
    return args, links, rows, started


def main() -> int:
    args, links, rows, started = measure_links(
        __doc__, NAME, "none,1gbit,200mbit,50mbit", task="mnist1d-mlp:width=512",
        modes="ddp,ps-sync,ps-async", procs=2, budget=40.0, target=0.5)
    lines = [f"# Time to {args.target:.0%} and throughput as the link narrows", "",
             f"{run_by(NAME, started)}: task {args.task}, {args.procs} processes, "
             f"seed {args.seed}, budget {args.budget:g} s per run (start-up included), one "
             "run per cell.", "",
             "Training seconds to the target / training samples to it:", "",
             *table(rows, "link", links, links, args.budget),
             "", "Samples/s after start-up (and the share of the same mode's unshaped rate):",
             "", *utilisation(rows, links),
             "", "What it shows (computed from the tables):", "",
             *shape(rows, links, args.budget), "", f"![link bandwidth]({NAME}.png)"]
    return report(NAME, lines, rows, lambda path: plot(rows, links, path), args.no_save, rows)


if __name__ == "__main__":
    sys.exit(main())
