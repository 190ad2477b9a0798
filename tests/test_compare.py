"""``asyncsgd compare`` and ``asyncsgd plot`` with real runs, processes and files.

One short comparison (single, hogwild, ps-async, ddp, and ps-sync made to
fail with a bad extra flag) runs once for the module; its tests check the
report's table, speed-ups over single included, against every run's own
files, that every mode got the same settings (batch per process, seed,
budget), the plots, the failed mode and that nothing outlived it.
"""

import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncsgd.analysis.report import (Attempt, Goal, mode_rows, parse_table, render_table,
                                      table_cells, verdict)
from asyncsgd.comparison.cli_launcher import Child, stop_all
from asyncsgd.config.modes import parse_modes
from asyncsgd.comparison.progress import CompareProgress
from asyncsgd.config import CompareConfig
from asyncsgd.core.scoring import ACCURACY, PERPLEXITY
from asyncsgd.errors import ConfigError
from asyncsgd.run.metrics import (MetricsLog, first_progress, steady_throughput, summarize,
                                  train_curve)
from asyncsgd.run.process_group import available_cores
from asyncsgd.run.reader import Run
from asyncsgd.run.rundir import RunDir
from conftest import (TESTS, asyncsgd_cmd, free_port, marked_processes, read_events,
                      read_json)

# DDP spends 5-10 s of a loaded 2-core machine starting its ranks; the budget must leave it
# time to train after that.
BUDGET, TARGET, BATCH = 15, 0.3, 16
OK_MODES = ["single", "hogwild", "ps-async", "ddp"]
PNGS = ["accuracy_vs_time.png", "loss_vs_time.png", "loss_vs_samples.png", "throughput.png"]


def _env(cache_dir, mark):
    env = dict(os.environ, ASYNCSGD_CACHE=str(cache_dir), ASYNCSGD_TEST_MARK=mark)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(cache_dir, *args, timeout=300):
    mark = uuid.uuid4().hex
    started = time.monotonic()
    res = subprocess.run(asyncsgd_cmd(*args), env=_env(cache_dir, mark), capture_output=True,
                         text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    res.seconds = time.monotonic() - started
    res.leftovers = marked_processes(mark)
    return res


@pytest.fixture(scope="module")
def compared(cache_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "cmp"
    res = _run(cache_dir, "compare", "--task", "mnist1d-cnn", "--modes",
               ",".join(OK_MODES + ["ps-sync"]), "--procs", 2, "--budget", BUDGET,
               "--batch-size", BATCH, "--target", TARGET, "--eval-every", 0.5,
               "--grace", 90, "--tensorboard",
               "--mode-args", "ps-sync=--no-such-flag", "--progress", "log", "--out", out)
    return res, out


def _pct(x):
    return f"{x * 100:.2f}"


def _time_and_rate(run_dir, target):
    """(time to target or None, steady samples/s, first event with progress) from the
    run's metrics.jsonl alone."""
    events = read_events(run_dir)
    evals = [e for e in events if e["event"] == "eval"]
    ttt = next((e["t"] for e in evals if e["accuracy"] >= target), None)
    progress = [e for e in events if e["samples"] > events[0]["samples"]]
    assert progress, f"{run_dir} trained on nothing"
    first = progress[0]
    last = max(events, key=lambda e: e["t"])
    return ttt, (last["samples"] - first["samples"]) / (last["t"] - first["t"]), first


def expected_row(run_dir, target):
    """A run's row computed straight from its files, independently of asyncsgd.report."""
    summary = read_json(Path(run_dir) / "summary.json")
    evals = [e for e in read_events(run_dir) if e["event"] == "eval"]
    ttt, rate, first = _time_and_rate(run_dir, target)
    p50, p99 = summary.get("staleness_p50"), summary.get("staleness_p99")
    return {
        "final acc. %": _pct(summary["final_metric"]),
        "best acc. %": _pct(max(e["accuracy"] for e in evals)),
        f"time to {target * 100:g}%": f"{ttt:.1f} s" if ttt is not None else "not reached",
        "samples/s": f"{rate:,.0f}",
        "start-up s": f"{first['t']:.1f}",
        "staleness p50 / p99": "—" if p50 is None else f"{p50} / {p99}",
        "runs ok": "1/1",
    }


def test_compare_reports_what_the_runs_recorded(compared):
    res, out = compared
    assert res.returncode == 1, res.stderr  # one mode failed
    rows = {r["mode"]: r for r in parse_table((out / "report.md").read_text())}
    assert list(rows) == OK_MODES + ["ps-sync"]
    base_time, base_rate, _ = _time_and_rate(out / "single-r1", TARGET)
    for mode in OK_MODES:
        expected = expected_row(out / f"{mode}-r1", TARGET)
        assert {k: rows[mode][k] for k in expected} == expected, mode
        ttt, rate, _ = _time_and_rate(out / f"{mode}-r1", TARGET)
        assert rows[mode]["speed-up (samples/s)"] == f"{rate / base_rate:.2f}×", mode
        assert rows[mode]["speed-up (time)"] == (
            f"{base_time / ttt:.2f}×" if ttt is not None and base_time is not None else "—")
    assert rows["single"]["speed-up (samples/s)"] == "1.00×"
    for mode in ("single", "hogwild", "ddp"):
        assert rows[mode]["staleness p50 / p99"] == "—"
    # The terminal shows the same table.
    table = [ln for ln in (out / "report.md").read_text().split("\n\n")
             if ln.startswith("| mode ")][0]
    assert table in res.stdout
    results = read_json(out / "results.json")
    by_mode = {r["mode"]: r for r in results["runs"]}
    hog = read_json(out / "hogwild-r1" / "summary.json")
    assert by_mode["hogwild"]["final_metric"] == hog["final_metric"]


def test_every_mode_ran_alike_and_one_after_another(compared):
    res, out = compared
    configs = {m: read_json(out / f"{m}-r1" / "config.json") for m in OK_MODES}
    assert {m: c["mode"] for m, c in configs.items()} == {
        "single": "single", "hogwild": "hogwild", "ps-async": "ps", "ddp": "ddp"}
    assert configs["ps-async"]["config"]["consistency"] == "async"
    for c in configs.values():
        assert c["config"]["seed"] == 0 and c["config"]["max_seconds"] == BUDGET
        assert c["config"]["task"] == "mnist1d-cnn" and c["task"]["train_samples"] == 4000
    for m in ("single", "hogwild", "ddp"):  # the same batch in every process
        assert configs[m]["config"]["batch_size"] == BATCH, m
    assert configs["hogwild"]["config"]["procs"] == 2
    assert configs["ddp"]["config"]["procs"] == 2
    assert configs["ps-async"]["config"]["workers"] == 2
    # single is one of the parallel processes alone: the same cores // 2 threads.
    for m in ("single", "hogwild", "ddp"):
        assert configs[m]["config"]["threads"] == max(1, available_cores() // 2), m
    summaries = {m: read_json(out / f"{m}-r1" / "summary.json") for m in OK_MODES}
    by_mode = {r["mode"]: r for r in read_json(out / "results.json")["runs"]}
    assert summaries["single"]["batch_size"] == summaries["single"]["global_batch_size"] == BATCH
    assert summaries["ddp"]["batch_size"] == BATCH
    assert summaries["ddp"]["global_batch_size"] == 2 * BATCH  # one batch per rank, averaged
    walls = [(read_events(out / f"{m}-r1")[0]["wall"], read_events(out / f"{m}-r1")[-1]["wall"])
             for m in OK_MODES]
    for (_, end), (start, _) in zip(walls, walls[1:]):
        assert end < start  # one after another, never overlapping
    for m, summary in summaries.items():  # stopped by the budget, a little after it
        assert summary["stopped_by"] == "max_seconds", m
        # The budget counts from the command's start, so training gets what start-up left
        # of it; a run can only stop once it runs: DDP's ranks first check the clock after
        # joining their group (5-20 s on a loaded machine).
        started = first_progress(read_events(out / f"{m}-r1"))["t"]
        assert 0 < summary["train_seconds"] < max(BUDGET, started) + 10, (m, started)
        assert BUDGET <= by_mode[m]["wall_seconds"] < BUDGET + 15, (m, by_mode[m])
    workers = sorted((out / "logs" / "ps-async-r1").glob("worker-*.out"))
    assert len(workers) == 2 and all("the server ended training" in w.read_text()
                                     for w in workers)


def test_a_failed_mode_is_reported_and_the_others_ran(compared):
    res, out = compared
    report = (out / "report.md").read_text()
    row = next(r for r in parse_table(report) if r["mode"] == "ps-sync")
    assert row["final acc. %"] == "failed" and row["runs ok"] == "0/1"
    failures = report.split("## Failed runs")[1].split("##")[0]
    assert "**ps-sync**" in failures and "No such option '--no-such-flag'" in failures
    assert "logs/ps-sync-r1" in failures
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 1 of 5 run(s) failed: ps-sync") and "--no-such-flag" in last
    assert "[1/5] single" in res.stderr and "[5/5] ps-sync FAILED" in res.stderr
    assert res.leftovers == []


# The kernel records a process's start in 10 ms ticks (down); a fork takes what it takes.
TICK, FORK = 0.02, 0.5


def test_every_time_counts_from_the_launch_of_the_modes_first_process(compared):
    """Start-up and times to target include starting Python, importing torch and loading
    the task, in every mode: each run's clock starts when compare launched its first
    process (results.json's ``launched``: the Unix time just before; for ps-async the
    server, whose workers compare launched right after it: no sample is trained before
    they push, so their start-up is in the start-up too)."""
    _, out = compared
    results = read_json(out / "results.json")
    rows = {r["mode"]: r for r in parse_table((out / "report.md").read_text())}
    by_mode = {r["mode"]: r for r in results["runs"]}
    for mode in OK_MODES:
        launched = results["launched"][f"{mode}-r1"]
        events = read_events(out / f"{mode}-r1")
        start = events[0]
        assert start["event"] == "start" and start["clock"] == "command", mode
        # Its Unix time less its t is the launch: never before it (an event's wall is read
        # after its t), and after it by a fork's time for the typical event. One event may be
        # later still: a process descheduled between reading t and wall (1.3 s in one CI run).
        offsets = sorted(e["wall"] - e["t"] for e in events)
        assert launched - TICK <= offsets[0], (mode, offsets[0] - launched)
        assert offsets[len(offsets) // 2] <= launched + FORK, (mode, offsets, launched)
        # what the process took before the run's bookkeeping began is in its t: at least
        # the time from the launch to then, less what a fork may take
        assert start["t"] >= start["wall"] - launched - FORK, mode
        first = first_progress(events)
        assert by_mode[mode]["startup_seconds"] == first["t"] >= start["t"], mode
        assert rows[mode]["start-up s"] == f"{first['t']:.1f}", mode
        hit = next((e for e in events if e["event"] == "eval" and e["accuracy"] >= TARGET),
                   None)
        assert hit is not None, mode
        assert by_mode[mode]["time_to_target"] == hit["t"] >= first["t"], mode
        assert launched - TICK <= hit["wall"] - hit["t"], mode
    report = (out / "report.md").read_text()
    assert "Every time is counted from the launch of the run's first process" in report


def test_tensorboard_of_every_mode_has_its_evaluations_by_samples_and_whole_seconds(compared):
    """--tensorboard: each run's events in its own directory, ``test/accuracy`` at every
    evaluation's samples and ``test/accuracy_vs_seconds`` at whole seconds of its t (since
    the launch), the last evaluation in each second (the final one is always there)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    res, out = compared
    assert f"tensorboard --logdir {out}" in res.stderr
    for mode in OK_MODES:
        board = EventAccumulator(str(out / f"{mode}-r1" / "tensorboard"))
        board.Reload()
        evals = [e for e in read_events(out / f"{mode}-r1") if e["event"] == "eval"]
        by_samples = [(s.step, s.value) for s in board.Scalars("test/accuracy")]
        assert [s for s, _ in by_samples] == [e["samples"] for e in evals], mode
        assert [v for _, v in by_samples] == pytest.approx([e["accuracy"] for e in evals],
                                                           abs=1e-6)
        lasts = {int(e["t"]): e["accuracy"] for e in evals}
        by_second = [(s.step, s.value) for s in board.Scalars("test/accuracy_vs_seconds")]
        assert [s for s, _ in by_second] == list(lasts), mode
        assert [v for _, v in by_second] == pytest.approx(list(lasts.values()), abs=1e-6)
        assert by_second[-1][1] == pytest.approx(evals[-1]["accuracy"], abs=1e-6)


def test_compare_progress_shows_each_runs_time_since_its_launch_and_etas(compared):
    """The log lines: a run's time since its launch and its ETA (the budget: no --epochs)
    add up to the budget, in whole seconds down; the comparison's ETA adds the runs after
    it (the first run's: exactly its own plus 4 budgets, nothing having finished yet)."""
    res, _ = compared
    lines = re.findall(r"^\[(\d)/5 (\S+)\] (\d\d):(\d\d) [\d,]+ samples \| [\d,]+ samples/s"
                       r" \| ETA (\d\d):(\d\d)(.*)$", res.stderr, re.M)
    assert {m[1] for m in lines} >= set(OK_MODES), res.stderr
    for index, mode, mm, ss, eta_mm, eta_ss, rest in lines:
        elapsed, eta = int(mm) * 60 + int(ss), int(eta_mm) * 60 + int(eta_ss)
        assert elapsed + eta in (BUDGET - 1, BUDGET) or (eta == 0 and elapsed >= BUDGET - 1)
        whole = re.search(r"compare ETA (\d\d):(\d\d)$", rest)
        assert bool(whole) == (index != "5"), (index, rest)
        if index == "1":
            assert int(whole[1]) * 60 + int(whole[2]) == eta + 4 * BUDGET, rest


def test_the_comparisons_eta_adds_what_finished_runs_took_beyond_their_budget(tmp_path):
    stream = io.StringIO()
    shown = CompareProgress(3, "log", stream, Goal(ACCURACY, None))
    cfg = CompareConfig(budget=10)
    run = SimpleNamespace(cfg=cfg, spec=SimpleNamespace(name="single"), seed=0, repeat=0)
    shown.starting(run, "single with 1 process")
    assert shown.compare_eta(4.5) == "compare ETA 00:24"  # 4.5 + 2 x 10, nothing known
    done = _fake_run(tmp_path / "single", "single", 0, [(1, 100, 0.5)])
    shown.finished(Attempt("single", run=done, seconds=13.0))  # 3 s past its budget
    shown.starting(run, "hogwild with 2 processes")
    assert shown.compare_eta(4.5) == "compare ETA 00:20"  # 4.5 + 3, then 10 + 3
    assert shown.compare_eta(None) == ""
    shown.finished(Attempt("hogwild", status="failed", error="x", seconds=1.0))  # not counted
    shown.starting(run, "ddp with 2 processes")
    assert shown.compare_eta(4.5) == ""  # the last run: its own ETA says it all
    assert "[3/3 ddp]" not in stream.getvalue() and "[2/3] hogwild FAILED" in stream.getvalue()


def _check_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert 200 <= width <= 1200 and 150 <= height <= 900, (path, width, height)
    assert len(data) < 300_000
    import matplotlib.image
    assert matplotlib.image.imread(str(path)).shape[:2] == (height, width)


def test_compare_draws_valid_pngs_linked_from_the_report(compared):
    res, out = compared
    report = (out / "report.md").read_text()
    for name in PNGS + ["accuracy_vs_bytes.png"]:  # the PS runs counted their traffic
        _check_png(out / name)
        assert f"]({name})" in report


def test_plot_draws_any_run_directories(compared, cache_dir, tmp_path):
    _, out = compared
    other = tmp_path / "my-hogwild"
    _fake_run(other, "hogwild", seed=3, points=[(0.5, 100, 0.2), (2.5, 900, 0.6)])
    config = read_json(other / "config.json")  # one task per table: the compare's
    config["task"] = read_json(out / "hogwild-r1" / "config.json")["task"]
    (other / "config.json").write_text(json.dumps(config))
    res = _run(cache_dir, "plot", out / "hogwild-r1", out / "ps-async-r1", other,
               "--out", tmp_path / "plots", "--target", TARGET)
    assert res.returncode == 0, res.stderr
    rows = {r["mode"]: r for r in parse_table((tmp_path / "plots" / "report.md").read_text())}
    # Two hogwild runs are different experiments, told apart by the one setting both record
    # and that differs (friction 12: not by their directories' names)
    assert set(rows) == {"hogwild (seed 0)", "ps-async", "hogwild (seed 3)"}
    for name, run_dir in (("hogwild (seed 0)", out / "hogwild-r1"),
                          ("ps-async", out / "ps-async-r1")):
        expected = expected_row(run_dir, TARGET)
        assert {k: rows[name][k] for k in expected} == expected
    assert rows["hogwild (seed 3)"]["samples/s"] == "400"  # (900 - 100) / (2.5 - 0.5)
    assert rows["hogwild (seed 3)"][f"time to {TARGET * 100:g}%"] == "2.5 s"
    for name in PNGS:
        _check_png(tmp_path / "plots" / name)
    assert "| mode" in res.stdout


def test_plot_of_a_compare_directory_keeps_its_modes_and_failures(compared, cache_dir,
                                                                  tmp_path):
    _, out = compared
    res = _run(cache_dir, "plot", out, "--out", tmp_path / "again", "--target", TARGET)
    assert res.returncode == 0, res.stderr
    again = parse_table((tmp_path / "again" / "report.md").read_text())
    assert again == parse_table((out / "report.md").read_text())


def _fake_run(path, mode, seed, points, metric=ACCURACY, **summary_extra):
    """A run directory written through the library's own writers: (t, samples, score)
    evaluations of ``metric``, a train event (loss 1 - score) at each."""
    run = RunDir.create(str(path), mode)
    run.write_config(mode, {"seed": seed}, {"name": "synthetic", "metric": metric.describe()},
                     argv=[])
    metrics = MetricsLog(run, metric=metric)
    metrics.write("start", 0.0, 0)
    for t, samples, score in points:
        metrics.write("train", t, samples, worker=0, loss=1 - score, steps=10, epoch=0)
        metrics.write("eval", t, samples, loss=1 - score, **{metric.name: score})
    metrics.close()
    run.write_summary(summarize(list(run.events()), mode=mode, task="synthetic", target=None,
                                stopped_by="max_seconds", metric=metric, **summary_extra))
    return Run.read(path)


def test_repeats_fold_into_median_and_spread_with_speedups_over_single(tmp_path):
    def attempt(label, repeat, points, **extra):
        run = _fake_run(tmp_path / f"{label}-{repeat}", label, repeat, points, **extra)
        return Attempt(label, repeat, repeat, run=run)

    attempts = [
        attempt("single", 0, [(1, 100, 0.1), (3, 500, 0.5)]),            # 200/s, target at 3
        attempt("single", 1, [(1, 100, 0.1), (5, 1300, 0.5)]),           # 300/s, target at 5
        attempt("hogwild", 0, [(1, 100, 0.5), (2, 700, 0.6)]),           # 600/s, target at 1
        attempt("hogwild", 1, [(1, 100, 0.2), (2, 1100, 0.4)]),          # 1000/s, never
        attempt("ps-async", 0, [(1, 10, 0.1), (2, 20, 0.2)], staleness_p50=1, staleness_p99=4),
        Attempt("ps-async", 1, 1, status="failed", error="worker-0 exited with code 1"),
    ]
    half = Goal.of(attempts, 0.5)
    assert half.metric.name == "accuracy"  # read back from the runs' config.json
    rows = {r.label: r for r in mode_rows(attempts, half)}
    hog = rows["hogwild"]
    assert hog.stats["samples_per_second"].median == hog.stats["samples_per_second"].mean == 800
    assert hog.speedup_throughput == 800 / 250
    assert hog.speedup_time == 4.0 / 1.0  # single's median time to target over hogwild's
    cells = table_cells(hog, half)
    assert cells["samples/s"] == "800 (600–1,000)"
    assert cells["time to 50%"] == "1.0 s (1/2 reached)"
    assert cells["speed-up (time)"] == "4.00×" and cells["speed-up (samples/s)"] == "3.20×"
    assert cells["final acc. %"] == "50.00 (40.00–60.00)"
    assert table_cells(rows["single"], half)["speed-up (samples/s)"] == "1.00×"
    ps = table_cells(rows["ps-async"], half)
    assert ps["runs ok"] == "1/2" and ps["staleness p50 / p99"] == "1 / 4"
    assert ps["time to 50%"] == "not reached" and ps["speed-up (time)"] == "—"
    # single: a median 4 s and 900 samples to 50%; hogwild: 1 s and 100 samples, in one run
    assert cells["samples to 50%"] == "100"
    assert table_cells(rows["single"], half)["samples to 50%"] == "900 (500–1,300)"
    # hogwild missed 50% in a run: its worst time is unbounded, so it wins nothing
    assert verdict(list(rows.values()), half) == (
        "Time to 50%: hogwild and single are not distinguishable at 2 seeds (1.0 s (1/2 "
        "reached) vs 4.0 s (3.0–5.0): the spreads overlap). Not reached within the budget: "
        "ps-async.")
    most = Goal.of(attempts, 0.99)
    assert verdict(mode_rows(attempts, most), most) == (
        "No mode reached 99% within the budget; the closest was single "
        "(best 50.00% (50.00–50.00)).")


def test_the_table_shows_each_modes_coverage_spread_from_its_summary(tmp_path):
    """summary.json's coverage: the median spread over repeats with their min–max, a dash
    for a mode whose runs report none; results.json keeps each run's whole coverage."""
    def attempt(label, repeat, spread=None):
        cover = None if spread is None else {"granularity": "sample", "min": 1.0,
                                             "max": spread, "mean": 1.5, "spread": spread}
        extra = {} if cover is None else {"coverage": cover}
        run = _fake_run(tmp_path / f"{label}-{repeat}", label, repeat, [(1, 100, 0.5)],
                        **extra)
        return Attempt(label, repeat, repeat, run=run)

    attempts = [attempt("hogwild", 0, 4.0), attempt("hogwild", 1, 3.5),
                attempt("hogwild", 2, 3.9), attempt("hogwild+dynamic", 0, 1.0),
                attempt("ps-async", 0)]
    goal = Goal.of(attempts, None)
    rows = {r.label: table_cells(r, goal) for r in mode_rows(attempts, goal)}
    assert rows["hogwild"]["coverage spread"] == "3.90× (3.50×–4.00×)"
    assert rows["hogwild+dynamic"]["coverage spread"] == "1.00×"
    assert rows["ps-async"]["coverage spread"] == "—"
    assert "coverage spread" in render_table(list(mode_rows(attempts, goal)), goal)
    record = attempts[0].to_dict(goal)
    assert record["coverage_spread"] == 4.0 and record["coverage"]["max"] == 4.0
    assert attempts[-1].to_dict(goal)["coverage"] is None


def test_a_lower_is_better_metric_ranks_and_times_downwards(tmp_path):
    """Perplexity: the target is reached from above, the best value is the lowest, and the
    columns and verdict say the metric's name."""
    def attempt(label, points):
        run = _fake_run(tmp_path / label, label, 0, points, metric=PERPLEXITY)
        return Attempt(label, 0, 0, run=run)

    attempts = [attempt("single", [(1, 100, 9.0), (4, 400, 2.5), (6, 600, 1.9)]),   # 2.0 at 6
                attempt("ps-async", [(1, 100, 8.0), (2, 300, 1.95), (3, 500, 2.4)]),  # 2.0 at 2
                attempt("ddp", [(1, 100, 6.0), (6, 600, 3.0)])]                      # never
    goal = Goal.of(attempts, 2.0)
    assert goal.metric.name == "perplexity" and not goal.metric.higher_is_better
    rows = {r.label: r for r in mode_rows(attempts, goal)}
    ps = table_cells(rows["ps-async"], goal)
    assert ps["time to perplexity 2"] == "2.0 s" and ps["samples to perplexity 2"] == "300"
    assert ps["final perplexity"] == "2.4" and ps["best perplexity"] == "1.95"
    assert rows["ps-async"].speedup_time == 6.0 / 2.0
    assert table_cells(rows["ddp"], goal)["time to perplexity 2"] == "not reached"
    assert verdict(list(rows.values()), goal) == (
        "ps-async reached perplexity 2 first, in 2.0 s: 3.00x sooner than the next, single "
        "(6.0 s), with 0.50x its samples (300 vs 600). Not reached within the budget: ddp. "
        "One seed per mode: no spread, no verdict (--repeats 3 or more gives one).")
    none = Goal.of(attempts, None)
    assert verdict(mode_rows(attempts, none), none).startswith(
        "Best final perplexity: single (1.9); most samples/s:")
    with pytest.raises(ConfigError, match="perplexity is at least 1"):
        Goal.of(attempts, 0.5)
    with pytest.raises(ConfigError, match="different metrics"):
        Goal.of([*attempts, Attempt("hogwild", 0, 0, run=_fake_run(
            tmp_path / "hogwild", "hogwild", 0, [(1, 100, 0.5)]))], None)


def test_train_curve_merges_the_workers_of_one_report():
    events = [{"event": "start", "t": 0, "samples": 0},
              {"event": "train", "t": 1.0, "samples": 64, "worker": 0, "loss": 2.0, "steps": 1},
              {"event": "train", "t": 1.1, "samples": 64, "worker": 1, "loss": 1.0, "steps": 3},
              {"event": "eval", "t": 1.2, "samples": 64, "loss": 0.5, "accuracy": 0.5},
              {"event": "train", "t": 2.0, "samples": 128, "worker": 0, "loss": 0.5, "steps": 2}]
    assert train_curve(events) == [(1.1, 64, 1.25), (2.0, 128, 0.5)]
    assert steady_throughput(events) == (128 - 64) / (2.0 - 1.0)
    assert steady_throughput(events[:1]) is None


def test_modes_parse_into_commands():
    specs = parse_modes("single, hogwild,ps-ssp,ps-ssp:5,ps-sync,ddp")
    assert [(s.command, s.consistency) for s in specs] == [
        ("single", None), ("hogwild", None), ("ps-server", "ssp:2"), ("ps-server", "ssp:5"),
        ("ps-server", "sync"), ("ddp", None)]
    with pytest.raises(ConfigError, match="unknown mode 'ps-ssp:x'"):
        parse_modes("ps-ssp:x")
    backups = parse_modes("ps-backup,ps-backup:2")
    assert [(s.consistency, s.backup_workers, s.slug) for s in backups] == [
        ("sync", 1, "ps-backup"), ("sync", 2, "ps-backup-2")]
    with pytest.raises(ConfigError, match="unknown mode 'ps-backup:0'"):
        parse_modes("ps-backup:0")


def test_communication_modes_parse_into_their_flags():
    specs = {s.name: s for s in parse_modes(
        "diloco,diloco:16,async-diloco:4,ddp+fp16,ddp+powersgd:2,ddp-local:4,"
        "ps-async+int8,ps-sync+bf16,diloco:4+topk:0.1,ps-dc-asgd,ps-dc-asgd+bf16")}
    assert (specs["ps-dc-asgd"].command, specs["ps-dc-asgd"].consistency,
            specs["ps-dc-asgd"].flags) == ("ps-server", "async", ("--dc-asgd", "0.04"))
    assert specs["ps-dc-asgd+bf16"].flags == ("--dc-asgd", "0.04")
    assert (specs["diloco"].consistency, specs["diloco"].optimizer,
            specs["diloco"].worker_flags) == ("sync", "nesterov", ("--local-steps", "8"))
    assert specs["diloco:16"].worker_flags == ("--local-steps", "16")
    assert (specs["async-diloco:4"].consistency, specs["async-diloco:4"].optimizer) == (
        "async", "delayed-nesterov")
    assert specs["ddp+powersgd:2"].flags == ("--comm-hook", "powersgd:2")
    assert specs["ddp-local:4"].flags == ("--local-steps", "4")
    assert specs["ps-async+int8"].worker_flags == ("--compress", "int8")
    assert (specs["ps-sync+bf16"].consistency, specs["ps-sync+bf16"].worker_flags) == (
        "sync", ("--push-dtype", "bf16", "--pull-dtype", "bf16"))
    assert specs["diloco:4+topk:0.1"].worker_flags == ("--local-steps", "4",
                                                        "--compress", "topk:0.1")
    for bad in ("diloco:0", "ddp+zstd", "ddp-local:x", "ps-async+zstd", "ps-async+topk:0",
                "hogwild+int8", "ddp+int8"):
        with pytest.raises(ConfigError, match=f"unknown mode '{re.escape(bad)}'"):
            parse_modes(bad)


@pytest.mark.processes
@pytest.mark.slow
def test_communication_modes_run(cache_dir, tmp_path):
    """DiLoCo, asynchronous Local SGD, PyTorch's hooks and compressed pushes run from
    compare like any mode: each run's settings say what ran (the shards' rule, the hook,
    post-local SGD, the workers' wire formats)."""
    out = tmp_path / "cmp"
    # One epoch ends each run (in a few seconds on 2 idle cores); the budget only bounds a
    # run on a loaded machine, where start-up alone once took all of an 8 s budget.
    res = _run(cache_dir, "compare", "--task", "mnist1d-cnn", "--modes",
               "diloco:4,async-diloco:4,ddp+fp16,ddp-local:4,ps-async+int8", "--procs", 2,
               "--epochs", 1, "--budget", 60,
               "--grace", 90, "--progress", "off", "--out", out)
    assert res.returncode == 0, res.stderr
    assert not res.leftovers
    configs = {d: read_json(out / d / "config.json")["config"]
               for d in ("diloco-4-r1", "async-diloco-4-r1", "ddp+fp16-r1", "ddp-local-4-r1")}
    assert (configs["diloco-4-r1"]["optimizer"], configs["diloco-4-r1"]["lr"],
            configs["diloco-4-r1"]["consistency"]) == ("nesterov", 0.7, "sync")
    assert configs["async-diloco-4-r1"]["optimizer"] == "delayed-nesterov"
    assert configs["ddp+fp16-r1"]["comm_hook"] == "fp16"
    assert configs["ddp-local-4-r1"]["local_steps"] == 4
    wire = read_json(out / "ps-async+int8-r1" / "summary.json")["wire"]
    assert len(wire) == 2 and all(w == {"push": "int8", "pull": "float32"}
                                  for w in wire.values()), wire
    for rank in range(2):  # a DiLoCo worker pushes once every 4 steps; a push in flight
        # when training ended is not counted, and the last round may end unpushed
        text = (out / "logs" / "diloco-4-r1" / f"worker-{rank}.out").read_text()
        steps, pushes = map(int, re.search(r"(\d+) steps, (\d+) pushes", text).groups())
        assert steps // 4 - 1 <= pushes <= -(-steps // 4) and pushes > 0, text


@pytest.mark.parametrize("args, fragments", [
    (["--modes", "hogwild,warp-drive"], ["unknown mode 'warp-drive'", "ps-async"]),
    (["--modes", ","], ["--modes is empty"]),
    (["--modes", "hogwild,hogwild"], ["listed twice", "--repeats"]),
    (["--budget", "0"], ["--budget", "0"]),
    (["--budget", "-5"], ["--budget"]),
    (["--repeats", "0"], ["--repeats"]),
    (["--mode-args", "ps-sync=--lock"], ["--mode-args", "MODE one of"]),
    (["--task", "no-such-task"], ["unknown task 'no-such-task'"]),
])
def test_bad_compare_flags_are_one_clear_line(run_cli_here, tmp_path, args, fragments):
    res = run_cli_here("compare", "--modes", "hogwild", *args, "--out", tmp_path / "x")
    _one_clear_line(res, fragments)
    assert not (tmp_path / "x").exists()  # nothing ran, nothing was written


def test_compare_refuses_a_used_out_directory(run_cli_here, tmp_path):
    (tmp_path / "old.txt").write_text("")
    _one_clear_line(run_cli_here("compare", "--modes", "hogwild", "--out", tmp_path),
                    ["exists and is not empty", "--out"])


@pytest.mark.parametrize("args, fragments", [
    ([], ["Missing argument 'RUN_DIR...'"]),
    (["/nonexistent/run"], ["/nonexistent/run does not exist"]),
])
def test_bad_plot_input_is_one_clear_line(run_cli_here, tmp_path, args, fragments):
    res = run_cli_here("plot", *args, "--out", tmp_path / "p")
    _one_clear_line(res, fragments)
    assert res.returncode == 2  # bad usage, as click's own


def _one_clear_line(res, fragments):
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.processes
def test_a_run_past_its_budget_is_stopped_and_leaves_nothing(cache_dir, tmp_path):
    # The extra flag comes last and overrides the budget: the run would go on for 10 minutes.
    res = _run(cache_dir, "compare", "--modes", "hogwild", "--procs", 2, "--budget", 1,
               "--grace", 4, "--mode-args", "hogwild=--max-seconds 600", "--progress", "off",
               "--out", tmp_path / "cmp", timeout=120)
    assert res.returncode == 1
    assert "still running 5 s after it started (--budget 1 + --grace 4); stopped" in res.stderr
    assert res.seconds < 60
    assert res.leftovers == []
    summary = read_json(tmp_path / "cmp" / "hogwild-r1" / "summary.json")
    assert summary["status"] == "interrupted"  # SIGINT first: the run was saved
    row = parse_table((tmp_path / "cmp" / "report.md").read_text())[0]
    assert row["mode"] == "hogwild" and row["final acc. %"] == "failed"


@pytest.mark.processes
def test_sigterm_stops_the_comparison_and_reports_the_runs_so_far(cache_dir, tmp_path):
    mark, out = uuid.uuid4().hex, tmp_path / "cmp"
    proc = subprocess.Popen(
        asyncsgd_cmd("compare", "--modes", "hogwild,ps-async", "--procs", 2, "--budget", 120,
                     "--eval-every", 0.5, "--progress", "log", "--out", out),
        env=_env(cache_dir, mark), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not (out / "hogwild-r1" / "metrics.jsonl").is_file() or not any(
                e["event"] == "eval" and e["samples"] > 0 for e in read_events(out / "hogwild-r1")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143, err  # 128 + SIGTERM
    assert "interrupted; the report of the runs so far" in err
    assert marked_processes(mark) == []
    assert read_json(out / "hogwild-r1" / "summary.json")["status"] == "interrupted"
    rows = parse_table((out / "report.md").read_text())
    assert [(r["mode"], r["final acc. %"]) for r in rows] == [("hogwild", "interrupted")]
    assert not (out / "ps-async-r1").exists()  # never started


# A process that notes each SIGINT / SIGTERM it is sent in a file; it ignores those named in
# argv[1] and dies of the others, as their default action is.
STUBBORN = """
import signal, sys, time
ignore, log = sys.argv[1].split(","), open(sys.argv[2], "a", buffering=1)
def noted(signum, frame):
    log.write(signal.Signals(signum).name + "\\n")
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, noted if sig.name in ignore else signal.SIG_DFL)
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.processes
@pytest.mark.parametrize("ignores, received, killed_by, waited", [
    ("", [], -signal.SIGINT, 0),                                # SIGINT is enough
    ("SIGINT", ["SIGINT"], -signal.SIGTERM, 1),                 # then SIGTERM after the grace
    ("SIGINT,SIGTERM", ["SIGINT", "SIGTERM"], -signal.SIGKILL, 1 + 5),  # then SIGKILL
])
def test_compare_stops_a_run_with_sigint_then_sigterm_then_sigkill(tmp_path, ignores, received,
                                                                   killed_by, waited):
    """What compare does to a run past its budget and --grace (here 1 s): SIGINT so that it
    saves, SIGTERM once the grace is over, SIGKILL 5 s later."""
    log = tmp_path / "signals"
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN, ignores, str(log)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        started = time.monotonic()
        stop_all([Child("stubborn", proc.args, proc, tmp_path / "out", tmp_path / "err")],
                 grace=1)
        took = time.monotonic() - started
        stopped_by_compare = proc.poll()  # read before the clean-up below may kill it
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert stopped_by_compare == killed_by
    assert (log.read_text().split() if log.exists() else []) == received
    assert waited <= took < waited + 10, took


@pytest.mark.parametrize("server_code", [0, 3])
def test_a_worker_outliving_a_cleanly_ended_server_is_stopped_not_a_failure(
        tmp_path, monkeypatch, cli_env, server_code):
    """A worker still running LINGER_SECONDS after the server ended is stopped: the run
    stands when the server ended cleanly (its run met its stop condition), and fails with
    the server's error when it did not. Real processes: the 'server' a Python that exits
    with ``server_code``, the worker 'asyncsgd worker' retrying a server that is gone."""
    from asyncsgd.comparison import mode_run as compare_module
    monkeypatch.setattr(compare_module, "LINGER_SECONDS", 2.0)
    for name, value in cli_env.items():  # the worker is this checkout's CLI
        monkeypatch.setenv(name, str(value))
    stream = io.StringIO()
    cfg = CompareConfig(modes="ps-async", budget=60, procs=1)
    run = compare_module.ModeRun(cfg, parse_modes("ps-async")[0], 0, tmp_path, {},
                                 CompareProgress(1, "log", stream, Goal(ACCURACY, None)))
    logs = tmp_path / "logs"
    server = Child("server", ["exit"], subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.stderr.write('bye'); sys.exit({server_code})"],
        stderr=subprocess.DEVNULL), logs / "s.out", logs / "s.err")
    worker = Child.start("worker", ["--server", f"tcp://127.0.0.1:{free_port()}",
                                    "--server-timeout", 300, "--progress", "off"], logs)
    run.children = [server, worker]
    try:
        began = time.monotonic()
        error = run._watch(server)
        assert time.monotonic() - began < 60
    finally:
        stop_all(run.children)
    assert worker.returncode is not None  # stopped either way, never left behind
    if server_code == 0:
        assert error is None and "worker was still running 2 s after the server ended" \
            in stream.getvalue(), stream.getvalue()
    else:
        assert error is not None and error.startswith("server exited with code 3"), error


def test_a_run_of_compare_is_out_of_ctrl_c_reach_yet_scheduled_with_its_caller(
        tmp_path, monkeypatch, cli_env):
    """Each process compare starts has a process group of its own (Ctrl-C on the terminal
    reaches only compare, which then stops its runs so that they save) but stays in the
    caller's session: Linux schedules a session as one group (autogroup), and a ps-server
    and workers in sessions of their own would pay for it where Hogwild's workers do not
    (experiments/README.md, "Sessions and autogroup", has the figures)."""
    for name, value in cli_env.items():
        monkeypatch.setenv(name, str(value))
    child = Child.start("worker", ["--server", f"tcp://127.0.0.1:{free_port()}",
                                   "--server-timeout", 300, "--progress", "off"],
                        tmp_path / "logs")
    try:
        deadline = time.monotonic() + 60
        cmdline = Path(f"/proc/{child.proc.pid}/cmdline")
        while cmdline.read_bytes().split(b"\0")[1:2] != [b"-m"]:  # the trampoline runs -c
            assert child.returncode is None and time.monotonic() < deadline, child.error()
            time.sleep(0.05)
        assert os.getpgid(child.proc.pid) == child.proc.pid != os.getpgrp()
        assert os.getsid(child.proc.pid) == os.getsid(0)
        # Empty for a process in the default autogroup (pid 1's, and CI's runner's);
        # a child inherits its parent's, so then both are.
        if Path("/proc/self/autogroup").exists():
            assert Path(f"/proc/{child.proc.pid}/autogroup").read_text().split()[:1] == \
                Path("/proc/self/autogroup").read_text().split()[:1]
    finally:
        stop_all([child])
    assert child.returncode is not None


def test_a_run_that_trained_no_samples_is_not_trained_and_not_in_the_verdict(tmp_path):
    """Friction 5: a server that took its whole budget to start wrote a run of 0 samples;
    the table said 'ok 1/1' and the verdict ranked it. It is no result: 'not trained',
    with why, in the table, the failed runs and results.json."""
    ok = _fake_run(tmp_path / "single", "single", 0, [(1, 100, 0.4), (2, 300, 0.6)])
    idle = _fake_run(tmp_path / "ps", "ps-async", 0, [(19.5, 0, 0.1)])
    attempts = [Attempt("single", 0, 0, run_dir=str(ok.path)),
                Attempt("ps-async", 0, 0, run_dir=str(idle.path))]
    for a in attempts:
        a.read_back()
    assert attempts[0].status == "ok"
    assert attempts[1].status == "not trained" and not attempts[1].ok
    assert "trained no samples: stopped by max_seconds" in attempts[1].error
    goal = Goal.of(attempts, 0.5)
    rows = {r.label: r for r in mode_rows(attempts, goal)}
    cells = table_cells(rows["ps-async"], goal)
    assert cells["runs ok"] == "0/1" and cells["final acc. %"] == "not trained"
    assert "ps-async" not in verdict(list(rows.values()), goal).split("Not reached")[0]
    assert attempts[1].to_dict(goal)["status"] == "not trained"
    assert Run.read(idle.path).outcome()[0] == "not trained"  # plot reads it so too
