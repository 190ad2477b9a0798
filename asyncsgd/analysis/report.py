"""Tables and report.md from run directories (``asyncsgd compare`` and ``asyncsgd plot``).

Every number comes from a run's own files (``run.reader.Run``); the runs of one mode
(repeats) fold into their median and spread (min–max), and a verdict names a winner only
where the spreads separate.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..core.scoring import Metric
from ..errors import AsyncSGDError, ConfigError
from ..run.reader import Run

log = logging.getLogger(__name__)

BASELINE = "single"
DASH = "—"


def run_label(config: dict) -> str:
    """A run's mode as ``compare`` names it: hogwild, ps-async, ps-ssp:2, ddp, ..."""
    mode = config.get("mode", "?")
    settings = config.get("config", {})
    if mode == "ps":
        consistency = str(settings.get("consistency", "async"))
        return "ps-ssp" if consistency == "ssp:2" else f"ps-{consistency}"
    if mode == "hogwild" and settings.get("lock"):
        return "hogwild-lock"
    return mode


@dataclass(frozen=True)
class Goal:
    """What a report ranks by: the task's metric, and the target in it (or None); and the
    clock its runs' times are on: real, or virtual (``asyncsgd simulate``)."""

    metric: Metric
    target: Optional[float] = None
    clock: str = "real"

    @property
    def unit(self) -> str:
        """Seconds as the table says them: 's', or 'virtual s'."""
        return "virtual s" if self.clock == "virtual" else "s"

    def seconds(self, x: float) -> str:
        """A time as the table says it: virtual ones often last milliseconds."""
        return f"{x:.3g}" if self.clock == "virtual" else _sec(x)

    @property
    def label(self) -> str:
        """The target as a column says it: '90%', 'perplexity 1.84'."""
        if self.target is None:
            return ""
        return f"{self.target * 100:g}%" if self.metric.percent else \
            f"{self.metric.name} {self.target:g}"

    @property
    def short(self) -> str:
        """The metric as a column says it: 'acc. %', 'perplexity'."""
        return "acc. %" if self.metric.name == "accuracy" else self.metric.name

    def value(self, x: float) -> str:
        return f"{x * 100:.2f}" if self.metric.percent else f"{x:.4g}"

    @classmethod
    def of(cls, attempts: list, target: Optional[float]) -> "Goal":
        """The metric the runs share (a table ranks one metric), with ``target``."""
        metrics = {a.run.metric for a in attempts if a.run is not None}
        names = sorted({m.name for m in metrics})
        if len(names) > 1:
            raise ConfigError(f"these runs score different metrics ({', '.join(names)}): "
                              "plot the runs of one task together")
        metric = next(iter(metrics)) if metrics else Metric.described(None)
        try:
            metric.check_target(target)
        except ValueError as exc:
            raise ConfigError(f"{exc} (the runs score {metric.name})") from None
        clocks = sorted({a.run.record.get("clock", "real") for a in attempts
                         if a.run is not None})
        if len(clocks) > 1:
            raise ConfigError("these runs mix the real clock and the virtual one (asyncsgd "
                              "simulate): their times cannot share a table; plot each apart")
        return cls(metric, target, clocks[0] if clocks else "real")


@dataclass
class Attempt:
    """One run of one mode: its directory when it produced one, and whether it succeeded."""

    label: str
    repeat: int = 0
    seed: Optional[int] = None
    status: str = "ok"  # ok | failed | interrupted | not trained (0 samples)
    error: Optional[str] = None
    run: Optional[Run] = None
    run_dir: Optional[str] = None
    logs: Optional[str] = None
    seconds: Optional[float] = None  # wall-clock, start-up and shut-down included

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.run is not None

    def read_back(self) -> None:
        """Once the run ended: the run its directory holds. A directory that cannot be read,
        or no run directory from a run that said nothing failed, fails the attempt."""
        if self.run_dir is not None and (Path(self.run_dir) / "config.json").is_file():
            try:
                self.run = Run.read(self.run_dir)
            except AsyncSGDError as exc:
                self.status, self.error = "failed", str(exc)
                return
            untrained = self.run.untrained()
            if self.status == "ok" and untrained:  # no result: the verdict must not count it
                self.status, self.error = "not trained", untrained
        elif self.status == "ok":
            self.status, self.error = "failed", "it wrote no run directory"

    def to_dict(self, goal: Goal) -> dict:
        record = {"mode": self.label, "repeat": self.repeat, "seed": self.seed,
                  "status": self.status, "error": self.error, "run_dir": self.run_dir,
                  "logs": self.logs, "wall_seconds": self.seconds}
        if self.run is not None:
            record.update(self.run.numbers(goal))
            record["coverage"] = self.run.summarized.get("coverage")
        return record


@dataclass
class Spread:
    """The values that exist over a mode's repeats, and how many did: their median and
    spread (min–max), what the table shows; mean and sample standard deviation, which
    results.json keeps for its older readers."""

    values: list

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.values) if self.values else None

    @property
    def lo(self) -> Optional[float]:
        return min(self.values) if self.values else None

    @property
    def hi(self) -> Optional[float]:
        return max(self.values) if self.values else None

    @property
    def mean(self) -> Optional[float]:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> Optional[float]:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    @classmethod
    def of(cls, values) -> "Spread":
        return cls([float(v) for v in values if v is not None and math.isfinite(v)])


@dataclass
class Row:
    """One mode in the table: its attempts folded over repeats."""

    label: str
    attempts: list
    stats: dict = field(default_factory=dict)  # name -> Spread over successful runs
    speedup_time: Optional[float] = None
    speedup_throughput: Optional[float] = None
    group: str = ""  # the task, where runs of several share a table (``grouped_rows``)

    @property
    def succeeded(self) -> int:
        return sum(a.ok for a in self.attempts)

    def to_dict(self) -> dict:
        return {"mode": self.label, **({"task": self.group} if self.group else {}),
                "runs": len(self.attempts), "succeeded": self.succeeded,
                **{name: {"median": s.median, "min": s.lo, "max": s.hi, "mean": s.mean,
                          "std": s.std, "n": s.n}
                   for name, s in self.stats.items()},
                "speedup_time_to_target": self.speedup_time,
                "speedup_samples_per_second": self.speedup_throughput}


def mode_rows(attempts: list, goal: Goal, baseline: str = BASELINE) -> list:
    """One row per label, in first-seen order, with speed-ups over ``baseline``.

    Speed-up over the baseline is a ratio of medians over repeats: of its time to
    target over the mode's (where both reached the target), and of the mode's
    samples/s over its samples/s.
    """
    by_label: dict = {}
    for a in attempts:
        by_label.setdefault(a.label, []).append(a)
    rows = []
    for label, group in by_label.items():
        numbers = [a.run.numbers(goal) for a in group if a.ok]
        names = numbers[0].keys() if numbers else ()
        rows.append(Row(label, group, {name: Spread.of(n[name] for n in numbers)
                                       for name in names}))
    base = next((r for r in rows if r.label == baseline and r.succeeded), None)
    if base is not None:
        for row in rows:
            if not row.succeeded:
                continue
            row.speedup_throughput = _ratio(row.stats["samples_per_second"].median,
                                            base.stats["samples_per_second"].median)
            row.speedup_time = _ratio(base.stats["time_to_target"].median,
                                      row.stats["time_to_target"].median)
    return rows


def grouped_rows(groups: list, goal: Goal, baseline: str = BASELINE) -> list:
    """``mode_rows`` of each (group, attempts) of ``groups`` (runs of one task each), the
    rows marked with their group: a speed-up is over the baseline of the same task, never
    across tasks, whose samples cost different work."""
    rows = []
    for name, attempts in groups:
        for row in mode_rows(attempts, goal, baseline):
            row.group = name
            rows.append(row)
    return rows


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


def _fmt(spread: Spread, fmt, unit: str = "") -> str:
    """'12.3 s (10.1–14.0)': the median, and the min–max over repeats where there are
    several; one run: its value alone."""
    if spread.median is None:
        return DASH
    text = fmt(spread.median) + unit
    if spread.n > 1:
        text += f" ({fmt(spread.lo)}–{fmt(spread.hi)})"
    return text


def _sec(x: float) -> str:
    return f"{x:.1f}"


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def _count(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def _times(x: Optional[float]) -> str:
    return DASH if x is None else f"{x:.2f}×"


def _time_cell(row: Row, goal: Goal) -> str:
    """'4.0 s (3.0–5.0)', '1.0 s (1/2 reached)' or 'not reached' (virtual s on the virtual
    clock)."""
    ttt = row.stats["time_to_target"]
    text = _fmt(ttt, goal.seconds, f" {goal.unit}") if ttt.n else "not reached"
    return text + (f" ({ttt.n}/{row.succeeded} reached)" if 0 < ttt.n < row.succeeded else "")


def table_cells(row: Row, goal: Goal) -> dict:
    """The row as the table prints it, column name -> text."""
    s = row.stats
    runs = f"{row.succeeded}/{len(row.attempts)}"
    final, best = f"final {goal.short}", f"best {goal.short}"
    named = {"mode": row.label, "task": row.group} if row.group else {"mode": row.label}
    if not row.succeeded:
        return {**named, final: row.attempts[0].status, "runs ok": runs}
    cells = {
        **named,
        final: _fmt(s["final_metric"], goal.value),
        best: _fmt(s["best_metric"], goal.value),
    }
    if goal.target is not None:
        ttt = s["time_to_target"]
        cells[f"time to {goal.label}"] = _time_cell(row, goal)
        cells["speed-up (time)"] = _times(row.speedup_time)
        cells[f"samples to {goal.label}"] = _fmt(s["samples_to_target"], _rate) \
            if ttt.n else DASH
        # the modes that count their traffic (the parameter server's workers); else a dash
        cells[f"MB to {goal.label}"] = _fmt(s["bytes_to_target"], _mb) \
            if ttt.n and s["bytes_to_target"].n else DASH
    cells.update({
        f"samples/{goal.unit}": _fmt(s["samples_per_second"], _rate),
        f"speed-up (samples/{goal.unit})": _times(row.speedup_throughput),
        f"start-up {goal.unit}": _fmt(s["startup_seconds"], goal.seconds),
        "staleness p50 / p99": (f"{_fmt(s['staleness_p50'], _count)} / "
                                f"{_fmt(s['staleness_p99'], _count)}"
                                if s["staleness_p50"].n else DASH),
        "coverage spread": _fmt(s["coverage_spread"], _times),
        "runs ok": runs,
    })
    return cells


def columns(goal: Goal, grouped: bool = False) -> list:
    """The table's columns; ``grouped``: rows of several tasks, each row saying its own."""
    names = ["mode", *(["task"] if grouped else []), f"final {goal.short}",
             f"best {goal.short}"]
    if goal.target is not None:
        names += [f"time to {goal.label}", "speed-up (time)", f"samples to {goal.label}",
                  f"MB to {goal.label}"]
    return names + [f"samples/{goal.unit}", f"speed-up (samples/{goal.unit})",
                    f"start-up {goal.unit}", "staleness p50 / p99", "coverage spread",
                    "runs ok"]


def render_table(rows: list, goal: Goal) -> str:
    """A markdown table padded to line up in a terminal too."""
    names = columns(goal, grouped=any(r.group for r in rows))
    body = [[table_cells(r, goal).get(n, "") for n in names] for r in rows]
    widths = [max(len(n), *(len(b[i]) for b in body)) for i, n in enumerate(names)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(names), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(b) for b in body)])


def parse_table(text: str) -> list:
    """The rows of the first table in a report, as dicts of column -> text (for readers
    and tests of report.md)."""
    lines: list = []
    for ln in text.splitlines():
        if ln.startswith("|"):
            lines.append(ln)
        elif lines:
            break
    if len(lines) < 2:
        return []
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in ln.strip("|").split("|"))))
            for ln in lines[2:]]


NOTES = """\
How to read this table:
- Every time is counted from the launch of the run's first process (the command's
  process, as the kernel recorded its start; `compare` launches each mode's, the
  parameter server before its workers): starting Python, importing torch, loading the
  task, spawning and connecting the other processes are time its user waits too
  (metrics.jsonl's `t`; a run started from Python counts from the call).
- *final* / *best*: the task's test metric (accuracy, perplexity, ...) at the end of the
  run / at its best evaluation (metrics.jsonl).
- *time to X*: seconds from that launch until the first evaluation at or past the target
  X, in the metric's direction (metrics.jsonl; resolution: the evaluation interval).
- *samples to X%*: training samples (all processes together) until that evaluation: what
  reaching the target cost in gradients, whatever the speed (stale updates cost more).
- *samples/s*: training samples processed per second from the end of start-up to the
  end of the run (metrics.jsonl); *start-up s*: seconds from the launch until the first
  samples were processed (starting Python and torch, loading the task, spawning
  processes, connecting workers, building process groups).
- *speed-up*: over `single`, a ratio of medians over repeats: single's time to target
  over the mode's, where both reached the target, and the mode's samples/s over single's.
- *staleness*: parameter-server modes only, in versions of a shard's parameters between
  a worker's pull and its push (percentiles over every push).
- *coverage spread*: how evenly the run trained its samples, the most times a sample
  was trained over the fewest (summary.json's `coverage`): 1.00× is even; fixed
  partitions with a straggler give about its slowdown; — where a run reports none, or
  left some sample untrained.
- With several repeats: the median over the runs that succeeded, and in parentheses
  their spread, min–max (a time to target: over the runs that reached it). The plots
  draw a mode's median curve and its min–max band. The verdict names a winner only
  where the spreads separate (the leader's worst run beats the runner-up's best; a mode
  that missed the target in some run has no worst time); else it says the modes are not
  distinguishable at that many seeds. With one seed per mode there is no spread, and
  the verdict says so.
"""

VIRTUAL_NOTE = """\
On the virtual clock (`asyncsgd simulate`, docs/simulate.md): every time below and in the
table is in virtual seconds, the simulator's clock under its cost model, not this machine's,
counted from the run's simulated start (no process is launched: start-up is the first
step's); the samples, scores and staleness are real (every gradient was computed).
"""


def _leader(rows: list, name: str, metric: Metric) -> Row:
    """The row whose median of ``name`` (a metric column) is best in the metric's
    direction."""
    leader = rows[0]
    for row in rows[1:]:
        if metric.better(row.stats[name].median, leader.stats[name].median):
            leader = row
    return leader


def verdict(rows: list, goal: Goal, caveat: str = "") -> str:
    """Which mode did best under these conditions, by how much, at what cost in samples:
    sentences computed from the table's medians and spreads, never canned; one verdict
    per task where rows of several share the table (no mode wins across tasks).
    ``caveat``: a sentence said after it (what the conditions did to some modes)."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    if len(groups) > 1:
        text = " ".join(f"{name}: {_verdict(group, goal)}" for name, group in groups.items())
    else:
        text = _verdict(rows, goal)
    return f"{text} {caveat}" if caveat else text


def _quote(spread: Spread, fmt, unit: str = "") -> str:
    """A figure inside the verdict's parentheses: '4.0 s', or '4.0 s; 3.5–4.5'."""
    text = fmt(spread.median) + unit
    return text + (f"; {fmt(spread.lo)}–{fmt(spread.hi)}" if spread.n > 1 else "")


def _seeds(*rows) -> str:
    """'3 seeds', or '3 and 2 seeds' where the rows had unlike numbers of runs."""
    counts = sorted({r.succeeded for r in rows}, reverse=True)
    return " and ".join(map(str, counts)) + (" seed" if counts == [1] else " seeds")


def _interval(row: Row, name: str, missing: bool = False) -> tuple:
    """(best case, worst case) of ``name`` over the row's runs as (lo, hi); ``missing``:
    some run has no value (it never reached the target), so the worst case is unbounded."""
    spread = row.stats[name]
    if not spread.n:
        return math.inf, math.inf
    return spread.lo, math.inf if missing else spread.hi


def _separated(leader: tuple, rival: tuple, lower_wins: bool) -> bool:
    """The leader's worst run beats the rival's best: their spreads do not overlap."""
    return leader[1] < rival[0] if lower_wins else leader[0] > rival[1]


def _tied(what: str, a: Row, b: Row, show) -> str:
    """The sentence for two modes whose spreads overlap; ``show``: a row's figure as the
    table prints it."""
    return (f"{what}: {a.label} and {b.label} are not distinguishable at {_seeds(a, b)} "
            f"({show(a)} vs {show(b)}: the spreads overlap)")


def _one_seed(*rows) -> str:
    """Said where every mode compared ran once: a ranking of single runs is no verdict."""
    return (" One seed per mode: no spread, no verdict (--repeats 3 or more gives one)."
            if rows and all(r.succeeded == 1 for r in rows) else "")


def _verdict(rows: list, goal: Goal) -> str:
    ok = [r for r in rows if r.succeeded]
    if not ok:
        return "No run succeeded: nothing to compare."
    unit = "%" if goal.metric.percent else ""
    lower = not goal.metric.higher_is_better
    if goal.target is None:
        return _untargeted(ok, goal, unit, lower)
    pct = goal.label
    reached = sorted((r for r in ok if r.stats["time_to_target"].n),
                     key=lambda r: r.stats["time_to_target"].median)
    missed = [r for r in ok if not r.stats["time_to_target"].n]
    if not reached:
        best = _leader(ok, "best_metric", goal.metric)
        return (f"No mode reached {pct} within the budget; the closest was {best.label} "
                f"(best {_fmt(best.stats['best_metric'], goal.value, unit)})."
                + _one_seed(*ok))
    first = reached[0]
    rival = reached[1] if len(reached) > 1 else (missed[0] if missed else None)

    def when(row, name="time_to_target"):  # a run that missed the target: no worst case
        return _interval(row, name, row.stats["time_to_target"].n < row.succeeded)

    if rival is not None and not _separated(when(first), when(rival), lower_wins=True):
        text = _tied(f"Time to {pct}", first, rival, lambda r: _time_cell(r, goal)) + "."
    else:
        time1 = first.stats["time_to_target"]
        text = f"{first.label} reached {pct} first, in {_fmt(time1, goal.seconds, f' {goal.unit}')}"
        if len(reached) > 1:
            second = reached[1]
            time2 = second.stats["time_to_target"]
            s1 = first.stats["samples_to_target"].median
            s2 = second.stats["samples_to_target"].median
            quoted = _quote(time2, goal.seconds, f" {goal.unit}")
            text += (f": {time2.median / time1.median:.2f}x sooner than the next, "
                     f"{second.label} ({quoted}), with {s1 / s2:.2f}x "
                     f"its samples ({s1:,.0f} vs {s2:,.0f})")
            thrifty = min(reached, key=lambda r: r.stats["samples_to_target"].median)
            if thrifty is not first and _separated(when(thrifty, "samples_to_target"),
                                                   when(first, "samples_to_target"), True):
                text += (f"; the fewest samples to {pct}: {thrifty.label} "
                         f"({_quote(thrifty.stats['samples_to_target'], _rate)})")
        text += "."
    if missed:
        text += f" Not reached within the budget: {', '.join(r.label for r in missed)}."
    return text + _one_seed(*([first, rival] if rival is not None else [first]))


def _untargeted(ok: list, goal: Goal, unit: str, lower: bool) -> str:
    """Without a target: the best final metric and the most samples/s, each named only
    where its spread separates from the runner-up's."""
    parts, final = [], _ranked(ok, "final_metric", lower)
    for ranked, key, what, fmt, u, lower_wins in (
            (final, "final_metric", f"final {goal.metric.name}", goal.value, unit, lower),
            (_ranked(ok, "samples_per_second", False), "samples_per_second", "samples/s",
             _rate, "", False)):
        top = ranked[0]
        if len(ranked) > 1 and not _separated(_interval(top, key), _interval(ranked[1], key),
                                               lower_wins):
            parts.append(_tied(what, top, ranked[1],
                               lambda r, k=key, f=fmt, u=u: _fmt(r.stats[k], f, u)))
        else:
            best = "best" if key == "final_metric" else "most"
            parts.append(f"{best} {what}: {top.label} ({_fmt(top.stats[key], fmt, u)})")
    text = f"{parts[0][0].upper()}{parts[0][1:]}; {parts[1]}."
    return text + " Give --target to compare times to a target." + _one_seed(*final[:2])


def _ranked(rows: list, name: str, lower: bool) -> list:
    """``rows`` best first by their median of ``name``; rows without one last."""
    def key(row):
        median = row.stats[name].median
        return (median is None, 0.0 if median is None else median if lower else -median)

    return sorted(rows, key=key)


def render_report(title: str, intro: list, rows: list, goal: Goal,
                  plots: list, out_dir: Path, warnings: tuple = (), caveat: str = "",
                  sections: tuple = ()) -> str:
    """report.md: the table (after ``warnings``, what a reader must know before trusting
    it), ``sections`` (lines of markdown), failed runs with their errors, the plots, every
    run's directory; ``caveat``: a sentence the verdict ends with."""
    parts = [f"# {title}", "", *intro, ""]
    if warnings:
        parts += [*(f"- **Warning**: {w}" for w in warnings), ""]
    parts += [render_table(rows, goal), "",
             f"**Verdict** (computed from the table): {verdict(rows, goal, caveat)}", "",
             *([VIRTUAL_NOTE] if goal.clock == "virtual" else []), NOTES, *sections]
    failed = [a for r in rows for a in r.attempts if not a.ok]
    if failed:
        parts += ["## Failed runs", ""]
        for a in failed:
            where = f" (logs: `{_rel(a.logs, out_dir)}`)" if a.logs else ""
            parts.append(f"- **{a.label}**, repeat {a.repeat + 1}, {a.status}: "
                         f"{(a.error or 'no error recorded').strip()}{where}")
        parts.append("")
    if plots:
        parts += ["## Plots", ""]
        parts += [f"![{caption}]({name})\n" for name, caption in plots]
    parts += ["## Runs", "", "| mode | repeat | seed | status | run directory |",
              "|---|---|---|---|---|"]
    for r in rows:
        for a in r.attempts:
            where = f"`{_rel(a.run_dir, out_dir)}`" if a.run is not None else DASH
            parts.append(f"| {a.label} | {a.repeat + 1} | {a.seed} | {a.status} | {where} |")
    return "\n".join(parts) + "\n"


def _rel(path: Optional[str], base: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)
