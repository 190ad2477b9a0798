"""At scale on the virtual clock: where asynchronous training wins, and where it loses.

    python experiments/at_scale.py                          # every part (hours: see below)
    python experiments/at_scale.py --part stragglers --workers 4,16 --extra-workers ''
    python experiments/at_scale.py --part gpu
    python experiments/at_scale.py --report                 # the report from what has run

(experiments/README.md lists the commands behind the committed results.)

Every run is ``asyncsgd simulate`` (the real update rules and real gradients of
mnist1d-cnn to 85%, simulated time), each mode with its own learning rate, tuned by
``simulate --tune lr`` (docs/simulate.md), and 3 seeds whose spread the tables show.

- **stragglers** (Chen et al. 2016's question): ps-async, ps-sync and ps-backup:B
  (B = N/16, at least 1) with N workers whose every step draws a lognormal time, median
  2 ms, sigma in {0.1, 0.5, 1}. Each mode's lr is tuned at sigma 0.5 for each N and kept
  for the other sigmas.
- **staleness** (Dai et al. 2019; Zheng et al. 2017): ps-async's staleness against N and
  its price in samples, beside ps-dc-asgd (delay-compensated), tuned the same way; the
  sigma 0.5 runs of the stragglers part.
- **gpu**: a 100 MB model at a 100 ms step, 8 workers, over 1, 10 and 100 Gbit links
  (20 us latency): ddp, diloco:8, diloco:32, async-diloco:8 (asynchronous Local SGD,
  Liu et al. 2024) and ps-async. Each mode's lr is tuned at 10 Gbit and kept for the other
  links (lock-step modes learn the same whatever the link; only their time changes).

A run costs its real gradients: about 1 ms of this machine's CPU per simulated step, so
N x steps. The N of --extra-workers (default 256) are not tuned: each mode's lr is
carried from the largest tuned N by the rule of the candidate it chose there (x N, / N,
/ sqrt(N), or the same factor of the task's lr), and they run the seeds of
--extra-seeds, a cell each: a 256-worker run that reaches 85% took 1-6 minutes here, and
tuning there would cost about an hour a mode.

Each cell is one ``simulate`` into SCRATCH/<part>/<cell> (default runs/at_scale), kept
and reused if it finished, so an interrupted run goes on where it stopped and parts run
in parallel processes. The report: ``experiments/results/at_scale.{md,json}`` and
``at_scale_*.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

from asyncsgd.analysis.report import Spread
from asyncsgd.config import SimulateConfig
from asyncsgd.config.modes import DC_ASGD, parse_modes
from asyncsgd.simulator.simulate import simulate
from results import RESULTS

NAME = "at_scale"
TASK, TARGET, SEEDS = "mnist1d-cnn", 0.85, 3
TASK_LR = 0.1  # mnist1d-cnn's: what the tuning grid multiplies
AT = f"{TARGET:.0%}"  # how tables name the target
# The median step of the stragglers part: the order of a real mnist1d-cnn step here
# (1.1-2.5 ms a worker step, measured by simulator_fidelity.py), rounded
STEP = "2ms"
SIGMAS = (0.1, 0.5, 1.0)
TUNE_SIGMA = 0.5
WORKERS = (4, 16, 64)
EXTRA = (256,)
GPU = dict(workers=8, step_time="100ms", gradient_bytes="100MB", latency="20us",
           budget=200_000.0)
LINKS = ("1gbit", "10gbit", "100gbit")
TUNE_LINK = "10gbit"
CARRIED = "carried.json"  # in a cell whose lr was carried from a smaller N: by which rule
DONE = "done"  # in a cell whose simulate returned
STOPPED = "stopped"  # in a cell stopped on purpose, saying why (its runs were interrupted)
GPU_MODES = ("ddp", "diloco:8", "diloco:32", "async-diloco:8", "ps-async")


def backup(n: int) -> int:
    """Chen et al. 2016 ran ~4-6% backup workers; N/16 here (1, 1, 4, 16)."""
    return max(1, n // 16)


def extra_budget(mode: str) -> float:
    """Virtual seconds of a run at --extra-workers. An async run at 256 workers trains
    ~1.5 M samples a virtual second, so one that stalls at chance costs ~8 minutes of CPU
    by 10 s; a sync round waits for the slowest of 256 steps, and ps-sync at sigma 1
    needed 24 s to 85%."""
    return 60.0 if parse_modes(mode)[0].consistency == "sync" else 10.0


def straggler_modes(n: int, with_dc: bool) -> list:
    return ["ps-async", *(["ps-dc-asgd"] if with_dc else []), "ps-sync", f"ps-backup:{backup(n)}"]


def cell(scratch: Path, part: str, name: str, say, **settings) -> dict:
    """One ``simulate`` (reused when it finished before): its report's results.json,
    each run's summary, and the tuning it did."""
    out = scratch / part / name
    while not finished(out) and not _claim(scratch / part / f"{name}.running"):
        say(f"{part}/{name}: another at_scale.py is running it; waiting")
        time.sleep(30)
    if finished(out):
        say(f"{part}/{name}: done before, reused")
        return read_cell(out)
    try:
        if out.exists():  # an interrupted cell starts again
            shutil.rmtree(out)
        say(f"{part}/{name}: simulating")
        cfg = SimulateConfig(task=TASK, target=TARGET, stop_at_target=True,
                             out=str(out), progress="log", **settings)
        simulate(cfg, argv=["experiments/at_scale.py", part, name])
        (out / DONE).write_text("")  # not after an interrupt: its report is partial
    finally:
        (scratch / part / f"{name}.running").unlink()
    return read_cell(out)


def finished(out: Path) -> bool:
    """A cell whose simulate returned, or that was stopped on purpose (STOPPED says why)."""
    return (out / DONE).exists() or (out / STOPPED).exists()


def _claim(lock: Path) -> bool:
    """Take the cell's lock, atomically; a dead owner's lock is taken over."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        if _alive(int(lock.read_text() or 0)):
            return False
        lock.unlink(missing_ok=True)
        return _claim(lock)
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return pid > 0


def read_cell(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())  # simulate.json's, + tuning
    runs = []
    for run in results["runs"]:
        summary_path = out / Path(run["run_dir"]).name / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        runs.append({**{k: run.get(k) for k in (
            "mode", "seed", "status", "time_to_target", "samples_to_target",
            "bytes_to_target", "staleness_p50", "staleness_p99", "final_metric",
            "wall_seconds")}, "staleness_mean": summary.get("staleness_mean"),
            "stopped_by": summary.get("stopped_by"), "samples": summary.get("samples"),
            "train_seconds": summary.get("train_seconds"), "error": run.get("error")})
    carried_ = out / CARRIED
    return {"runs": runs, "tuning": results.get("tuning", {}),
            "lr": {r["mode"]: lr_of(results, r["mode"]) for r in runs},
            "carried": json.loads(carried_.read_text()) if carried_.exists() else {}}


def lr_of(header: dict, mode: str) -> float:
    tuned = header.get("tuning", {}).get(base_mode(mode))
    return tuned["chosen"] if tuned else (header["config"]["lr"] or header["task"]["lr"])


def base_mode(label: str) -> str:
    return re.sub(r" \(lr [^)]*\)$", "", label)


def carried(lr: float, base: float, tuned_at: int, n: int) -> tuple:
    """The lr for ``n`` workers by the rule of the candidate chosen at ``tuned_at``: the
    tuning grid's x N, / N and / sqrt(N) scale with N; a plain factor of the task's lr stays."""
    for rule, scale in (("x N", lambda k: k), ("/ N", lambda k: 1 / k),
                        ("/ sqrt(N)", lambda k: 1 / math.sqrt(k))):
        if math.isclose(lr, base * scale(tuned_at), rel_tol=1e-9):
            return base * scale(n), rule
    return lr, f"x {lr / base:g}"


# ---- the parts ---------------------------------------------------------------------------

def stragglers(args, say) -> None:
    tuned_at = {}
    for n in args.workers:
        tuned = cell(args.scratch, "stragglers", f"n{n}-sigma{TUNE_SIGMA:g}", say,
                     modes=",".join(straggler_modes(n, with_dc=True)), workers=n,
                     step_time=f"lognormal:{STEP}:{TUNE_SIGMA:g}", tune="lr",
                     repeats=args.repeats)
        tuned_at[n] = tuned["tuning"]
        for sigma in (s for s in args.sigmas if s != TUNE_SIGMA):
            for mode in straggler_modes(n, with_dc=False):
                lr = tuned["tuning"][mode]["chosen"]
                cell(args.scratch, "stragglers", f"n{n}-sigma{sigma:g}-{slug(mode)}", say,
                     modes=mode, workers=n, lr=lr, step_time=f"lognormal:{STEP}:{sigma:g}",
                     repeats=args.repeats)
    if args.extra_workers:
        n0 = max(args.workers)
        tuned = tuned_at[n0]
        for n in args.extra_workers:
            for sigma in sorted(args.sigmas, key=lambda s: s != TUNE_SIGMA):
                for mode in straggler_modes(n, with_dc=sigma == TUNE_SIGMA):
                    if args.extra_modes and mode.split(":")[0] not in args.extra_modes:
                        continue
                    old = straggler_modes(n0, True)[straggler_modes(n, True).index(mode)]
                    lr, rule = carried(tuned[old]["chosen"], TASK_LR, n0, n)
                    for seed in args.extra_seeds:  # a cell each: parallel processes share
                        name = f"n{n}-sigma{sigma:g}-{slug(mode)}" + (f"-seed{seed}" if seed
                                                                       else "")
                        cell(args.scratch, "stragglers", name, say, modes=mode, workers=n,
                             lr=lr, step_time=f"lognormal:{STEP}:{sigma:g}", seed=seed,
                             budget=args.extra_budget or extra_budget(mode))
                        (args.scratch / "stragglers" / name / CARRIED).write_text(json.dumps(
                            {mode: f"{rule} from N={n0}'s {tuned[old]['chosen']:g}"}))


def gpu(args, say) -> None:
    tuned = cell(args.scratch, "gpu", f"link{TUNE_LINK}", say, modes=",".join(GPU_MODES),
                 link=TUNE_LINK, tune="lr", repeats=args.repeats, **GPU)
    for link in (x for x in LINKS if x != TUNE_LINK):
        for mode in GPU_MODES:
            cell(args.scratch, "gpu", f"link{link}-{slug(mode)}", say, modes=mode, link=link,
                 lr=tuned["tuning"][mode]["chosen"], repeats=args.repeats, **GPU)


def slug(mode: str) -> str:
    return mode.replace(":", "-")


def merge(cells: dict, key, got: dict) -> None:
    """The cells of one setting (a mode each, or the tuned one): runs, lrs, tuning."""
    into = cells.setdefault(key, {"runs": [], "lr": {}, "tuning": {}, "carried": {}})
    into["runs"] += got["runs"]
    for part in ("lr", "tuning", "carried"):
        into[part].update(got[part])


# ---- the report --------------------------------------------------------------------------

def spread(values: list) -> dict:
    """The report's Spread of ``values`` (those that exist), as at_scale.json keeps it."""
    s = Spread.of(values)
    return {"median": s.median, "min": s.lo, "max": s.hi, "n": s.n}


ORDER = ("ps-async", "ps-dc-asgd", "ps-sync", "ps-backup", *GPU_MODES)


def by_mode(runs: list) -> dict:
    """Runs by mode, in ORDER (each table lists its modes the same way)."""
    modes: dict = {}
    for run in runs:
        modes.setdefault(base_mode(run["mode"]), []).append(run)
    rank = {m: ORDER.index(m) if m in ORDER else ORDER.index(m.split(":")[0]) for m in modes}
    return dict(sorted(modes.items(), key=lambda kv: rank[kv[0]]))


def summarise(runs: list) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    return {"runs": len(runs), "reached": sum(r["time_to_target"] is not None for r in ok),
            "failed": [r["error"] for r in runs if r["status"] != "ok"],
            # stopped by hand (SIGTERM): where it was, and its score then
            "stopped": [(r["train_seconds"], r["final_metric"]) for r in runs
                        if r.get("stopped_by") == "interrupted"],
            **{k: spread([r[k] for r in ok]) for k in (
                "time_to_target", "samples_to_target", "bytes_to_target", "staleness_mean",
                "staleness_p99")}}


def separated(a: dict, b: dict, runs_a: int, runs_b: int) -> bool:
    """a beats b when a's worst run beats b's best, and every run of a reached the target."""
    return (a["n"] == runs_a and a["max"] is not None
            and (b["min"] is None or a["max"] < b["min"]))


def winner(rows: dict, key: str = "time_to_target") -> str:
    """The separation rule of simulate's verdict, on the merged runs of one setting."""
    ranked = sorted((m for m in rows if rows[m][key]["median"] is not None),
                    key=lambda m: rows[m][key]["median"])
    if not ranked:
        return "no mode reached the target"
    lead, seeds = ranked[0], rows[ranked[0]]["runs"]
    if len(rows) == 1:
        return f"{lead} alone"
    if rows[lead]["reached"] < seeds:
        return (f"{lead} first in its runs that reached the target, but it missed in "
                f"{seeds - rows[lead]['reached']} of {seeds}")
    if min(row["runs"] for row in rows.values()) < 2:
        return f"{lead} first (one seed: no spread)"
    rivals = [m for m in rows if m != lead]
    if all(separated(rows[lead][key], rows[m][key], seeds, rows[m]["runs"]) for m in rivals):
        return f"**{lead}** (spreads separate)"
    tied = [m for m in rivals
            if not separated(rows[lead][key], rows[m][key], seeds, rows[m]["runs"])]
    return f"{lead} and {', '.join(tied)} not distinguishable at {seeds} seeds"


def edges(tuning: dict) -> set:
    """The modes whose tuned lr is the smallest or largest candidate: the best lr may lie
    beyond the grid."""
    return {m for m, c in tuning.items()
            if c["chosen"] in (min(x["lr"] for x in c["candidates"]),
                               max(x["lr"] for x in c["candidates"]))}


def cell_table(rows: dict, lrs: dict, carried_from: dict, with_staleness: bool,
               with_bytes: bool = False, edge: frozenset = frozenset()) -> list:
    head = ["mode", "lr", f"time to {AT}, virtual s", f"samples to {AT}"]
    head += [f"GB to {AT}"] if with_bytes else []
    head += ["staleness mean", "reached"] if with_staleness else ["reached"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, row in rows.items():
        lr = f"{lrs.get(mode, float('nan')):.3g}" + (" (carried)" if mode in carried_from
                                                     else " (grid edge)" if mode in edge
                                                     else "")
        cells = [mode, lr, quote(row["time_to_target"], "time"),
                 quote(row["samples_to_target"], "{:,.0f}")]
        if with_bytes:
            cells.append(quote(row["bytes_to_target"], "{:.3g}", 1e-9))
        if with_staleness:
            cells.append(quote(row["staleness_mean"], "{:.3g}"))
        cells.append(f"{row['reached']}/{row['runs']}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def quote(s: dict, fmt: str, scale: float = 1.0) -> str:
    """median (min–max); ``fmt`` a format, or "time": 3 digits below 1,000, whole above."""
    if s["median"] is None:
        return "—"

    def show(x: float) -> str:
        if fmt == "time":
            return f"{x:,.0f}" if x >= 1000 else f"{x:.3g}"
        return fmt.format(x * scale)

    text = show(s["median"])
    if s["n"] > 1:
        text += f" ({show(s['min'])}–{show(s['max'])})"
    return text


def lrs_of(cell_: dict) -> dict:
    got = {base_mode(m): lr for m, lr in cell_["lr"].items()}
    got.update({m: c["chosen"] for m, c in cell_.get("tuning", {}).items()})
    return got


def report(scratch: Path) -> str:
    """experiments/results/at_scale.{md,json} and the figures, from the cells that ran."""
    found: dict = {"stragglers": {}, "gpu": {}}
    for part in found:
        for out in sorted((scratch / part).glob("*")) if (scratch / part).exists() else ():
            if (out / "results.json").exists():
                found[part][out.name] = read_cell(out)
    data: dict = {"stragglers": {}, "gpu": {}}
    for name, got in found["stragglers"].items():
        n, sigma = re.match(r"n(\d+)-sigma([\d.]+)", name).groups()
        key = f"N={n} sigma={sigma}"
        merge(data["stragglers"], key, got)
    for name, got in found["gpu"].items():
        merge(data["gpu"], re.match(r"link(\w+?)(?:-|$)", name).group(1), got)
    table = {part: {key: {"rows": {m: summarise(r) for m, r in by_mode(c["runs"]).items()},
                          "lr": lrs_of(c), "carried": c["carried"], "tuning": c["tuning"]}
                    for key, c in cells.items()} for part, cells in data.items()}
    lines = render(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{NAME}.md").write_text("\n".join(lines) + "\n")
    (RESULTS / f"{NAME}.json").write_text(json.dumps(table, indent=2, default=str) + "\n")
    figures(table)
    return "\n".join(lines)


def setting_order(key: str) -> tuple:
    n, sigma = re.match(r"N=(\d+) sigma=([\d.]+)", key).groups()
    return float(sigma), int(n)


def overview(table: dict) -> list:
    """The three summary tables: time to the target per setting, staleness, GPU-like."""
    def first(rows: dict) -> str:
        return winner(rows).replace("**", "").replace(" (spreads separate)", ", separate")

    lines = []
    stragglers_ = table["stragglers"]
    if stragglers_:
        lines += ["| N | σ | ps-async | ps-sync | ps-backup | first (spreads) |",
                  "|---|---|---|---|---|---|"]
        for key in sorted(stragglers_, key=lambda k: setting_order(k)[::-1]):
            rows = {m: r for m, r in stragglers_[key]["rows"].items() if m != "ps-dc-asgd"}
            n, sigma = setting_order(key)[1], setting_order(key)[0]
            cells = [next((quote(r["time_to_target"], "time") + miss(r)
                           for m, r in rows.items() if m.split(":")[0] == mode), "—")
                     for mode in ("ps-async", "ps-sync", "ps-backup")]
            lines.append(f"| {n} | {sigma:g} | " + " | ".join(cells) + f" | {first(rows)} |")
        lines += ["", f"| N | mean staleness | p99 | ps-async lr | samples to {AT}, ps-async "
                  f"| ps-dc-asgd (λ {DC_ASGD[1]}) lr | its samples to {AT} |",
                  "|---|---|---|---|---|---|---|"]
        for key in sorted((k for k in stragglers_ if setting_order(k)[0] == TUNE_SIGMA),
                          key=lambda k: setting_order(k)[1]):
            rows, lrs = stragglers_[key]["rows"], stragglers_[key]["lr"]
            a, d = rows.get("ps-async"), rows.get("ps-dc-asgd")
            if a is None:
                continue
            lines.append(f"| {setting_order(key)[1]} | {quote(a['staleness_mean'], '{:.3g}')} "
                         f"| {quote(a['staleness_p99'], '{:.0f}')} | "
                         f"{lrs.get('ps-async', float('nan')):.3g} | "
                         f"{quote(a['samples_to_target'], '{:,.0f}')}{miss(a)} | "
                         + (f"{lrs.get('ps-dc-asgd', float('nan')):.3g} | "
                            + quote(d["samples_to_target"], "{:,.0f}") + miss(d) if d
                            else "— | —") + " |")
    if table["gpu"]:
        lines += ["", "| link | " + " | ".join(GPU_MODES) + " | first (spreads) |",
                  "|---|" + "---|" * (len(GPU_MODES) + 1)]
        for link in sorted(table["gpu"], key=lambda x: float(x.rstrip("gbit"))):
            rows = table["gpu"][link]["rows"]
            lines.append(f"| {link} | " + " | ".join(
                quote(rows[m]["time_to_target"], "time") + miss(rows[m]) if m in rows
                else "—" for m in GPU_MODES) + f" | {first(rows)} |")
    return lines + [""]


def miss(row: dict) -> str:
    """Said where some runs missed the target (or failed), and where one was stopped."""
    if row["reached"] == row["runs"]:
        return ""
    stopped = "".join(f"; stopped at {t:g} virtual s, accuracy {score:.1%}"
                      for t, score in row.get("stopped", ()))
    return f" [{row['reached']}/{row['runs']} reached{stopped}]"


def render(table: dict) -> list:
    lines = [f"# At scale on the virtual clock: {TASK} to {TARGET:.0%}", "",
             "Written by `python experiments/at_scale.py` (docs in its docstring). Every "
             "figure is from `asyncsgd simulate`: real gradients and the real update rules, "
             "time simulated (virtual seconds), measured at each evaluation (every 0.1 "
             "virtual s in the stragglers part, 5 in the GPU-like one: times differing by "
             "one interval are one evaluation apart). Each cell: median over seeds, "
             "(min–max) over them. Each mode's lr was tuned (`--tune lr`, seed 0) at "
             f"sigma {TUNE_SIGMA:g} for each N, and at {TUNE_LINK} in the GPU-like part, and "
             "kept for the other sigmas and links; at the N marked carried it was not "
             "tuned but carried from the largest tuned N.", "",
             "## Overview", "", f"Time to {AT} in virtual seconds; then staleness at "
             f"sigma {TUNE_SIGMA:g}; then the GPU-like regime.", "", *overview(table)]
    stragglers_ = table["stragglers"]
    if stragglers_:
        lines += ["## Stragglers: async vs sync vs sync + backup workers", "",
                  f"Lognormal step times, median {STEP}; the loopback's link and the shard's "
                  "apply cost measured on this machine (one shard). Each mode's lr was tuned "
                  f"at sigma {TUNE_SIGMA:g}, seed 0, for each N and kept for the other sigmas. "
                  "ps-backup's staleness counts its late pushes too (those that came after "
                  "their round: counted, never applied).", ""]
        edge = {setting_order(k)[1]: edges(c["tuning"]) for k, c in stragglers_.items()
                if c["tuning"]}
        for key in sorted(stragglers_, key=setting_order):
            got = stragglers_[key]
            rows = {m: r for m, r in got["rows"].items() if m != "ps-dc-asgd"}
            lines += [f"### {key}", "", *cell_table(rows, got["lr"], got["carried"], True,
                                                     edge=edge.get(setting_order(key)[1],
                                                                   set())), "",
                      f"Fastest to {AT}: {winner(rows)}." + carried_note(got["carried"]), ""]
    if table["gpu"]:
        lines += [f"## GPU-like: a {GPU['gradient_bytes']} model at a {GPU['step_time']} step, "
                  f"{GPU['workers']} workers", "",
                  "Every worker and the server have a link of the bandwidth named, "
                  f"{GPU['latency']} latency. ddp's ring all-reduce against one "
                  "parameter-server shard, whose link carries every worker's push and pull "
                  "(a sharded server divides that load; the simulator models one shard). "
                  f"Each mode's lr was tuned at {TUNE_LINK} and kept for the other links.",
                  ""]
        edge = set().union(*(edges(c["tuning"]) for c in table["gpu"].values()))
        for link in sorted(table["gpu"], key=lambda x: float(x.rstrip("gbit"))):
            got = table["gpu"][link]
            lines += [f"### {link}", "", *cell_table(got["rows"], got["lr"], {}, False, True,
                                                     edge=edge),
                      "", f"Fastest to {AT}: {winner(got['rows'])}.", ""]
    return lines


def carried_note(carried_: dict) -> str:
    return (" Carried lrs: " + "; ".join(f"{m} {c}" for m, c in carried_.items()) + "."
            if carried_ else "")


def figures(table: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stragglers_ = table["stragglers"]
    if stragglers_:
        sigmas = sorted({setting_order(k)[0] for k in stragglers_})
        fig, axes = plt.subplots(1, len(sigmas), figsize=(4.5 * len(sigmas), 3.6),
                                 squeeze=False, sharey=True)
        for ax, sigma in zip(axes[0], sigmas):
            keys = sorted((k for k in stragglers_ if setting_order(k)[0] == sigma),
                          key=setting_order)
            for mode, colour in (("ps-async", "C0"), ("ps-sync", "C3"), ("ps-backup", "C1")):
                xs, med, lo, hi = [], [], [], []
                for key in keys:
                    row = next((r for m, r in stragglers_[key]["rows"].items()
                                if m.split(":")[0] == mode), None)
                    s = row and row["time_to_target"]
                    if s and s["median"] is not None:
                        xs.append(setting_order(key)[1])
                        med.append(s["median"])
                        lo.append(s["median"] - s["min"])
                        hi.append(s["max"] - s["median"])
                if xs:
                    ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=mode,
                                color=colour)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"lognormal sigma {sigma:g}")
            ax.set_xlabel("workers N")
        axes[0][0].set_ylabel(f"virtual s to {AT} (median, min–max)")
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{NAME}_stragglers.png", dpi=110)
        plt.close(fig)
    if table["gpu"]:
        links = sorted(table["gpu"], key=lambda x: float(x.rstrip("gbit")))
        modes = list(next(iter(table["gpu"].values()))["rows"])
        fig, ax = plt.subplots(figsize=(7, 3.6))
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            values = [table["gpu"][link]["rows"].get(mode, {}).get(
                "time_to_target", {}).get("median") for link in links]
            ax.bar([j + i * width for j in range(len(links))],
                   [v if v is not None else 0 for v in values], width, label=mode)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(links))], links)
        ax.set_yscale("log")
        ax.set_ylabel(f"virtual s to {AT} (median)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / f"{NAME}_gpu.png", dpi=110)
        plt.close(fig)


def numbers(text: str, kind=int) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "stragglers", "gpu"), default="all")
    ap.add_argument("--workers", type=numbers, default=WORKERS,
                    help="N of the stragglers part, tuned and seeded (default 4,16,64)")
    ap.add_argument("--extra-workers", type=numbers, default=EXTRA,
                    help="N run with lrs carried from the largest tuned N, not tuned "
                         "(default 256; '' none)")
    ap.add_argument("--extra-seeds", type=numbers, default=(0,),
                    help="seeds of the --extra-workers runs, e.g. 0,1,2 (default 0)")
    ap.add_argument("--extra-modes", type=lambda t: tuple(m for m in t.split(",") if m),
                    default=(), help="only these modes at --extra-workers, e.g. "
                    "ps-sync,ps-backup (default all)")
    ap.add_argument("--extra-budget", type=float, default=None,
                    help="virtual seconds of each --extra-workers run (default: 10 for "
                    "async modes, 60 for sync ones)")
    ap.add_argument("--sigmas", type=lambda t: numbers(t, float), default=SIGMAS)
    ap.add_argument("--repeats", type=int, default=SEEDS)
    ap.add_argument("--scratch", type=Path, default=Path("runs") / NAME,
                    help="where every cell's simulate writes (reused when finished)")
    ap.add_argument("--report", action="store_true", help="only write the report")
    args = ap.parse_args(argv)

    def say(text: str) -> None:
        print(f"at_scale: {text}", file=sys.stderr, flush=True)

    if not args.report:
        if args.part in ("all", "gpu"):
            gpu(args, say)
        if args.part in ("all", "stragglers"):
            stragglers(args, say)
    print(report(args.scratch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
