"""Communication-efficient training over shaped links: time, samples and bytes to target
of the synchronous baselines with PyTorch's own tools, the parameter server, and Local SGD
/ DiLoCo on it, sync and async.

    python experiments/communication.py                      # 2 links x 12 modes, ~30 min
    python experiments/communication.py --links 50mbit --modes ddp,diloco:8 --budget 30

For each link one ``asyncsgd compare --link RATE`` (needs root: network namespaces):

    asyncsgd compare --task mnist1d-mlp:width=512 --procs 4 --link 50mbit --target 0.5 \\
        --stop-at-target --modes ddp,ddp+fp16,ddp+powersgd,ddp-local:8,ps-sync,ps-async,\\
        ps-async+bf16,ps-async+int8,diloco:8,diloco:32,async-diloco:8,async-diloco:32

Every process (the server, each worker, each DDP rank) runs on a host of its own whose
link is shaped both ways by tbf. The model, an MLP 40-512-512-10, has 288,266 parameters
(1.15 MB of float32): wide enough that its communication, not its compute, decides on a
narrow link. "Bytes" are what the kernel counted on every host's link for the whole run
(it stops at the target, so: bytes to target, plus start and stop); the parameter
server's workers also count their own traffic, and "PS MB to target" is theirs at the
first evaluation at the target. ddp+bf16 is left out: PyTorch's bf16 hook needs NCCL.
ddp-local:H is PyTorch's post-local SGD, diloco:H the PS's --local-steps H with
Nesterov in sync rounds, async-diloco:H the same async through delayed Nesterov;
ps-async+bf16 casts pushes and pulls, ps-async+int8 compresses pushes with error
feedback.

Writes ``experiments/results/communication.{md,json,png}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from link_bandwidth import measure_links, utilisation
from stragglers import report, run_by, table

NAME = "communication"
MODES = ("ddp,ddp+fp16,ddp+powersgd,ddp-local:8,ps-sync,ps-async,ps-async+bf16,ps-async+int8,"
         "diloco:8,diloco:32,async-diloco:8,async-diloco:32")


def link_bytes(compare_dir: Path) -> dict:
    """mode -> bytes every host of its (first) run sent over its link."""
    record = json.loads((compare_dir / "results.json").read_text())
    runs = record.get("link", {}).get("runs", {})
    return {name.rsplit(" r", 1)[0]: sum(h.get("sent", 0) for h in hosts.values())
            for name, hosts in runs.items() if name.endswith(" r1")}


def bytes_table(rows: list, links: list) -> list:
    """Per mode and link: the kernel's bytes over every link for the run, and the run's
    own figure to the target (counted by the PS workers, computed by ddp)."""
    cells = {(r["mode"], r["link"]): r for r in rows}
    heads = [f"{link}: links / own MB to target" for link in links]
    lines = ["| mode | " + " | ".join(heads) + " |", "|---|" + "---|" * len(links)]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        texts = []
        for link in links:
            r = cells.get((mode, link), {})
            whole, counted = r.get("bytes"), r.get("bytes_to_target")
            texts.append(("—" if whole is None else f"{whole / 1e6:,.1f} MB") + " / "
                         + ("—" if counted is None else f"{counted / 1e6:,.1f} MB"))
        lines.append(f"| {mode} | " + " | ".join(texts) + " |")
    return lines


def verdict(rows: list, links: list, budget: float) -> list:
    """Which mode reached the target first at each link, by how much, from the table."""
    lines = []
    for link in links:
        done = sorted((r for r in rows if r["link"] == link and r["time_to_target"]),
                      key=lambda r: r["time_to_target"])
        if not done:
            lines.append(f"- {link}: no mode reached the target within {budget:g} s.")
            continue
        best = done[0]
        text = f"- {link}: {best['mode']} first, in {best['time_to_target']:.1f} s"
        ddp = next((r for r in done if r["mode"] == "ddp"), None)
        if ddp and ddp is not best:
            text += (f", {ddp['time_to_target'] / best['time_to_target']:.2f}x sooner than "
                     f"ddp ({ddp['time_to_target']:.1f} s)")
        sync = next((r for r in done if r["mode"] == "ps-sync"), None)
        if sync and sync is not best and sync.get("bytes") and best.get("bytes"):
            text += f"; {sync['bytes'] / best['bytes']:.1f}x fewer bytes than ps-sync"
        missed = [r["mode"] for r in rows if r["link"] == link and not r["time_to_target"]]
        lines.append(text + (f"; not within {budget:g} s: {', '.join(missed)}." if missed
                             else "."))
    return lines


def plot(rows: list, links: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4.5), squeeze=False)
    for ax, link in zip(axes[0], links):
        mine = [r for r in rows if r["link"] == link and r["time_to_target"] and r.get("bytes")]
        for r in mine:
            ax.scatter(r["bytes"] / 1e6, r["time_to_target"], s=40)
            ax.annotate(r["mode"], (r["bytes"] / 1e6, r["time_to_target"]), fontsize=8,
                        xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("MB over all links (run stopped at the target)")
        ax.set_ylabel("seconds to the target")
        ax.set_title(f"every link {link}")
        ax.grid(alpha=0.3)
    fig.suptitle("Time and bytes to target (MLP 40-512-512-10, 4 processes, 2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def with_link_bytes(link: str, compare_dir: Path, rows: list) -> list:
    sent = link_bytes(compare_dir)
    return [{**r, "bytes": sent.get(r["mode"])} for r in rows]


def main() -> int:
    args, links, rows, started = measure_links(
        __doc__, NAME, "1gbit,50mbit", with_link_bytes, task="mnist1d-mlp:width=512",
        modes=MODES, procs=4, budget=60.0, target=0.5)
    lines = [f"# Communication: time, samples and bytes to {args.target:.0%}", "",
             f"{run_by(NAME, started)}: task {args.task}, {args.procs} processes (each on a "
             f"host of its own), seed {args.seed}, budget {args.budget:g} s per run (start-up "
             "included), one run per cell.", "",
             "Training seconds to the target / training samples to it:", "",
             *table(rows, "link", links, links, args.budget),
             "", "Bytes over all links for the whole run (stopping at the target), as the "
             "kernel counted them, and the run's own figure to the target: the parameter "
             "server's workers count every frame they send and receive; ddp computes its "
             "all-reduces' payload (a ring's 2(W-1) x one rank's; no TCP/IP or Gloo framing):",
             "",
             *bytes_table(rows, links),
             "", "Samples/s after start-up:", "", *utilisation(rows, links),
             "", "Which won (computed from the tables):", "",
             *verdict(rows, links, args.budget), "", f"![time and bytes]({NAME}.png)"]
    return report(NAME, lines, rows, lambda path: plot(rows, links, path), args.no_save, rows)


if __name__ == "__main__":
    sys.exit(main())
