"""A report directory: the plots, report.md and results.json of a set of runs, made by
``asyncsgd compare`` for its runs and by ``asyncsgd plot`` for any run directories.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional

from ..errors import ConfigError
from .fairness import recorded_notes
from .plots import draw_all
from ..run.reader import Run
from .report import (BASELINE, Attempt, Goal, grouped_rows, mode_rows, render_report,
                     render_table, run_label, verdict)

# What makes two runs runs of one task, and how a message names it.
TASK_FIELDS = (("name", "task"), ("train_samples", "training samples"),
               ("test_samples", "test samples"))
# Settings whose difference a report of the same task warns about: (key, name, whether
# None means "the task's default", which summary.json resolves where the run records it).
SETTINGS = (("batch_size", "batch size per process", True), ("lr", "learning rate", True),
            ("max_seconds", "time budget (--max-seconds)", False),
            ("epochs", "--epochs", False),
            ("processes", "training processes (workers or ranks)", False))
# The settings a legend names to tell runs of one mode apart (plain runs, not repeats), in
# this order, at most LEGEND_SETTINGS of them: those that change what or how a run trains.
TELLING = ("procs", "workers", "batch_size", "lr", "lr_schedule", "warmup", "optimizer",
           "momentum", "weight_decay", "consistency", "shards", "local_steps", "push_every",
           "compress", "push_dtype", "pull_dtype", "transport", "accumulate", "clip_grad_norm",
           "amp", "comm_hook", "data_dispatch", "balance", "threads", "device", "slowdown",
           "delay", "max_seconds", "epochs", "target", "seed")
LEGEND_SETTINGS = 3
UNKNOWN = object()


class Plotted(NamedTuple):
    """What ``report_runs`` made: the table and verdict to print, the warnings report.md
    carries too, and the attempts that failed."""

    text: str
    warnings: list
    failed: list


def write_results(path: Path, header: dict, rows: list, goal: Goal) -> None:
    """results.json: the same numbers as the table, unrounded, and every attempt."""
    record = {**header, "metric": goal.metric.describe(), "target": goal.target,
              "modes": [r.to_dict() for r in rows],
              "runs": [a.to_dict(goal) for r in rows for a in r.attempts]}
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")


def publish(out_dir: Path, title: str, intro: list, attempts: list, goal: Goal,
            header: dict, *, groups: Optional[list] = None, warnings: tuple = (),
            caveat: str = "", baseline: str = BASELINE, sections: tuple = ()) -> str:
    """Write the plots, report.md and results.json of ``attempts`` into ``out_dir``;
    returns the table and verdict. ``groups``: [(task, attempts)] of runs of several
    tasks, each with rows and speed-ups of its own; ``warnings``: said above the table;
    ``caveat``: a sentence the verdict ends with (``fairness.caveat``); ``baseline``: the
    label speed-ups are over; ``sections``: report.md's lines after the table's notes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = grouped_rows(groups, goal) if groups else mode_rows(attempts, goal, baseline)
    plots = draw_all([(_legend(r), [a.run for a in r.attempts if a.ok]) for r in rows],
                     out_dir, goal, conditions=title)
    (out_dir / "report.md").write_text(
        render_report(title, intro, rows, goal, plots, out_dir, warnings=tuple(warnings),
                      caveat=caveat, sections=tuple(sections)))
    write_results(out_dir / "results.json",
                  {**header, "warnings": list(warnings)} if warnings else header, rows, goal)
    return render_table(rows, goal) + "\n\n" + verdict(rows, goal, caveat)


def _legend(row) -> str:
    return f"{row.label} [{row.group}]" if row.group else row.label


def report_runs(paths: list, out: Path, target: Optional[float],
                allow_mixed: bool = False) -> Plotted:
    """``asyncsgd plot``: the plots and report.md of any run directories (or compare
    directories, whose runs keep their modes and repeats) into ``out``.

    ``plot`` was not there when its runs ran, so it checks what ``compare`` makes sure of
    by construction: each run given once, one task (unless ``allow_mixed``: each task then
    gets its own rows, speed-ups and verdict), and alike settings where they change what
    a sample costs or how long a run had (warned about). A run's status is what its own
    files say: one that failed at start is no result. Runs that recorded more training
    processes than their host had CPUs are warned about first, and the verdict says what
    that did to the lock-step modes."""
    writable(out)
    _given_once(paths)
    sourced = [(path, a) for path in paths for a in _attempts_of(Path(path))]
    _runs_once(sourced)
    attempts = [a for _, a in sourced]
    groups = task_groups(attempts, allow_mixed)
    plain = {id(a) for path, a in sourced if not _is_compare_dir(Path(path))}
    for _, group in groups:
        _tell_apart(group, [a for a in group if id(a) in plain])
    crowded, caveat = recorded_notes([(a.label, a.run) for a in attempts if a.ok])
    warnings = crowded + _mixed_warning(groups) + [w for task, group in groups
                                                   for w in setting_warnings(group, task)]
    warnings += [f"{a.run_dir} has no summary.json (killed before it finished?): it is "
                 "reported from what its metrics.jsonl recorded"
                 for a in attempts if a.ok and not a.run.recorded_summary]
    warnings += [f"{a.run_dir} was stopped by Ctrl-C or SIGTERM before its budget was "
                 "spent: it is reported for what it recorded"
                 for a in attempts if a.ok and a.run.recorded_summary
                 and a.run.summary.get("status") == "interrupted"]
    text = publish(out, plot_title(groups), [f"Runs: {', '.join(str(p) for p in paths)}"],
                   attempts, Goal.of(attempts, target), {"command": sys.argv},
                   groups=groups if len(groups) > 1 else None, warnings=tuple(warnings),
                   caveat=caveat)
    return Plotted(text, warnings, [a for a in attempts if not a.ok])


def writable(out: Path) -> None:
    """``out`` can hold the plots, checked before any run is read and without making it (a
    refused plot leaves nothing behind): one line naming the place, not a traceback after
    the work."""
    existing = next(p for p in (out, *out.parents) if p.exists() or p == Path(p.anchor))
    why = (f"{existing} is not a directory" if not existing.is_dir() else
           f"no permission to write in {existing}"
           if not os.access(existing, os.W_OK | os.X_OK) else "")
    if why:
        raise ConfigError(f"cannot write the plots to {out}: {why}; choose a writable place "
                          "with --out DIR")


def _is_compare_dir(path: Path) -> bool:
    return (path / "results.json").is_file() and not (path / "config.json").is_file()


def _attempts_of(path: Path) -> list:
    """The attempts a path stands for: a compare directory's, or one run's, its status
    from its own files."""
    if _is_compare_dir(path):
        return _compare_attempts(path)
    run = Run.read(path)
    status, error = run.outcome()
    return [Attempt(run_label(run.record), seed=run.seed, status=status, error=error,
                    run=run, run_dir=str(path))]


def _given_once(paths: list) -> None:
    """The same directory twice, by any path to it, is refused: its runs would count
    twice (as repeats of their mode, with a spread of 0)."""
    seen: dict = {}
    for path in paths:
        real = Path(path).resolve()
        if real in seen:
            raise ConfigError(f"{seen[real]} and {path} are the same directory ({real}): "
                              "give each run once")
        seen[real] = path


def _runs_once(sourced: list) -> None:
    """A run given on its own and within a compare directory given too is refused."""
    seen: dict = {}
    for path, a in sourced:
        if a.run is None:
            continue
        real = a.run.path.resolve()
        if real in seen:
            raise ConfigError(f"the run {real} is given twice ({seen[real]} and {path}): "
                              "give each run once")
        seen[real] = path


def _tell_apart(group: list, plain: list) -> None:
    """Plain runs of one mode are different experiments, not repeats: one whose label
    another run of ``group`` shares gets the settings that differ between them ('hogwild
    (procs 8)'); where none do, its directory's name, with as many parent folders as tell
    it from the others of that label."""
    labels = {a.label for a in plain}
    for label in labels:
        same = [a for a in group if a.label == label]
        if len(same) > 1:
            _name_settings([a for a in same if id(a) in {id(b) for b in plain}], same)
    clashing = [a for a in plain if sum(b.label == a.label for b in group) > 1]
    parts = {id(a): Path(a.run_dir).resolve().parts for a in clashing}
    names = {}
    for a in clashing:
        mine = parts[id(a)]
        others = [parts[id(b)] for b in clashing if b is not a and b.label == a.label]
        depth = 1
        while depth < len(mine) and any(o[-depth:] == mine[-depth:] for o in others):
            depth += 1
        names[id(a)] = "/".join(mine[-depth:])
    for a in clashing:
        a.label = f"{a.label} ({names[id(a)]})"


def _name_settings(plain: list, same: list) -> None:
    """Each of ``plain`` labelled with the settings (``TELLING``) whose values differ
    among ``same``, the runs of its label."""
    def value(a, key):
        found = UNKNOWN if a.run is None else _setting(a.run, key, True)
        return "default" if found is None else found

    # a setting some run does not record tells nothing: those fall back to the directory
    differ = [key for key in TELLING
              if all(value(a, key) is not UNKNOWN for a in same)
              and len({str(value(a, key)) for a in same}) > 1][:LEGEND_SETTINGS]
    if not differ:
        return
    for a in plain:
        a.label += " (" + ", ".join(f"{key.replace('_', '-')} {_shown(value(a, key))}"
                                    for key in differ) + ")"


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _task(run: Run) -> tuple:
    task = run.record.get("task", {})
    return tuple(task.get(key) for key, _ in TASK_FIELDS)


def _by_value(attempts: list, value) -> dict:
    """value -> the run directories that have it, over the attempts that have a run (an
    UNKNOWN value left out)."""
    found: dict = {}
    for a in attempts:
        if a.run is not None and (v := value(a.run)) is not UNKNOWN:
            found.setdefault(v, []).append(str(a.run_dir or a.run.path))
    return found


def _describe(found: dict) -> str:
    """'16 (a, b) vs 32 (c)'."""
    return " vs ".join(f"{'none' if v is None else v} ({', '.join(names)})"
                       for v, names in found.items())


def task_groups(attempts: list, allow_mixed: bool) -> list:
    """[(task, attempts)] by task, in first-seen order: one ("", attempts) for runs of one
    task. Runs of several are refused, naming what differs and where, unless
    ``allow_mixed``; an attempt without a run (a compare's, failed) joins its neighbour's."""
    differ = [(name, found) for i, (_, name) in enumerate(TASK_FIELDS)
              if len(found := _by_value(attempts, lambda run, i=i: _task(run)[i])) > 1]
    if not differ:
        return [("", attempts)]
    differ = differ[:1] if differ[0][0] == TASK_FIELDS[0][1] else differ  # names say it
    what = "; ".join(f"{name}: {_describe(found)}" for name, found in differ)
    if not allow_mixed:
        raise ConfigError(f"these runs are of different tasks ({what}): their samples cost "
                          "different work, so one table cannot compare them or their "
                          "speed-ups; plot each task's runs on their own, or pass "
                          "--allow-mixed for one table with a task column and speed-ups "
                          "within each task")
    groups: dict = {}
    for key, a in zip(_filled([_task(a.run) if a.run else None for a in attempts]), attempts):
        groups.setdefault(key, []).append(a)
    names = [key[0] for key in groups]
    return [(_task_name(key, names), group) for key, group in groups.items()]


def _filled(keys: list) -> list:
    """Each None replaced by the nearest key before it (leading ones: the first key)."""
    last = next((k for k in keys if k is not None), None)
    filled = []
    for key in keys:
        last = key if key is not None else last
        filled.append(last)
    return filled


def _task_name(key: tuple, names: list) -> str:
    """The task's name, with its sample counts where another group has that name too."""
    name, train, test = key
    return str(name) if names.count(name) == 1 else f"{name} ({train} train / {test} test)"


def _mixed_warning(groups: list) -> list:
    if len(groups) < 2:
        return []
    return [f"--allow-mixed: these runs are of {len(groups)} tasks "
            f"({', '.join(task for task, _ in groups)}): each row says its task, speed-ups "
            "are over single of the same task, and the verdict is per task; the plots draw "
            "them on the same axes"]


def setting_warnings(attempts: list, task: str = "") -> list:
    """Settings that differ between runs of one task, each naming which runs have which
    value: the table then compares runs that ran under different conditions."""
    where = f"runs of {task}" if task else "these runs"
    return [f"{where} differ in {name}: {_describe(found)}; the table compares runs under "
            "different settings"
            for key, name, defaulted in SETTINGS
            if len(found := _by_value(attempts, lambda run, k=key, d=defaulted:
                                      _setting(run, k, d))) > 1]


def _setting(run: Run, key: str, defaulted: bool):
    """The value a run used: summary.json's where it records it (the task's default
    resolved), else config.json's; UNKNOWN where neither says (a parameter server knows
    no batch size, nor, with fixed partitions, the epochs: its workers have them).
    ``processes``: a parallel mode's workers or ranks (UNKNOWN for single)."""
    if key == "processes":
        return _processes(run)
    if run.summarized.get(key) is not None:
        return run.summarized[key]
    settings = run.record.get("config", {})
    if key == "epochs" and "consistency" in settings \
            and settings.get("data_dispatch", "static") == "static":
        return UNKNOWN  # a parameter server's fixed partitions: its workers' --epochs decide
    if key not in settings or (defaulted and settings[key] is None):
        return UNKNOWN
    return settings[key]


def _processes(run: Run):
    """The training processes of a parallel mode's run: hogwild's and ddp's procs (as
    summary.json resolved them), a parameter server's workers; UNKNOWN for single."""
    mode = run.record.get("mode")
    key = {"hogwild": "procs", "ddp": "procs", "ps": "workers"}.get(mode)
    found = None if key is None else _setting(run, key, True)
    return UNKNOWN if found is None else found


def plot_title(groups: list) -> str:
    """report.md's title and the plots': the task (each task with --allow-mixed) and the
    training processes of the parallel modes, like compare's ('asyncsgd plot:
    mnist1d-cnn, 4 processes'); counts that differ are all named ('2 and 8 processes')."""
    tasks = [task for task, _ in groups if task] or sorted(
        {_task(a.run)[0] for _, group in groups for a in group if a.run is not None} - {None})
    counts = sorted(_by_value([a for _, group in groups for a in group], _processes))
    title = "asyncsgd plot: " + (", ".join(map(str, tasks)) or "runs")
    if counts:
        many = " and ".join(map(str, counts))
        title += f", {many} process{'es' if counts != [1] else ''}"
    return title


def _compare_attempts(path: Path) -> list:
    """The attempts of an earlier compare, from its results.json and run directories."""
    try:
        record = json.loads((path / "results.json").read_text())
        runs = record["runs"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"{path}/results.json is not a compare result: {exc}") from exc
    attempts = []
    for r in runs:
        run_dir = path / Path(r["run_dir"]).name if r.get("run_dir") else None
        run = Run.read(run_dir) if run_dir and (run_dir / "config.json").is_file() else None
        attempts.append(Attempt(r["mode"], r.get("repeat", 0), r.get("seed"),
                                r.get("status", "ok"), r.get("error"), run,
                                str(run_dir) if run_dir else None, r.get("logs")))
    return attempts
