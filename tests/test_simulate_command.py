"""``asyncsgd simulate`` and ``compare --clock virtual`` around the simulator's engine: the
settings they refuse, the profile that stands for this machine, and the report of a whole
comparison on the virtual clock. The simulator starts no process, so every test runs here,
in this process."""

import json
import math
from pathlib import Path

import pytest

from asyncsgd.analysis.report import Attempt, Goal, columns, parse_table
from asyncsgd.analysis.tuning import refined
from asyncsgd.config.compare import REFINE_ROUNDS
from asyncsgd.comparison.virtual import settings_of
from asyncsgd.config import CompareConfig, SimulateConfig
from asyncsgd.config.simulate import (parse_join, parse_leave, parse_slow_workers,
                                      parse_worker_speeds)
from asyncsgd.simulator.engine import worker_speeds
from asyncsgd.core.scoring import ACCURACY
from asyncsgd.core.tasks import load_task
from asyncsgd.errors import ConfigError
from asyncsgd.run.reader import Run
from asyncsgd.simulator import profile
from conftest import one_line_error

TASK = "tasks_for_tests:blob_dataset"  # 160 training rows, a 8-32-4 MLP: steps take µs
TUNE_TARGET = 0.8
SMALL = ("--task", TASK, "--samples", 200, "--progress", "off")


@pytest.mark.parametrize("args, fragments", [
    (("--step-time", "2 parsecs"), ["--step-time", "2 parsecs"]),
    (("--link", "fast"), ["--link", "fast"]),
    (("--gradient-bytes", "lots"), ["--gradient-bytes", "lots"]),
    (("--latency", "-1ms"), ["--latency"]),
    (("--workers", 4, "--leave", "5:4"), ["--leave", "worker(s) 4", "--workers 4"]),
    (("--leave", "5"), ["--leave", "T:RANK"]),
    (("--join", "soon"), ["--join", "soon"]),
    (("--slow-workers", "2:4"), ["--slow-workers", "SHARE"]),
    (("--workers", 4, "--slowdown", "7:2"), ["rank(s) 7", "--workers"]),
    (("--modes", "ps-async+int8"), ["--modes", "ps-async+int8", "real clock"]),
])
def test_simulate_refuses_bad_settings_in_one_line(run_cli_here, tmp_path, args, fragments):
    res = run_cli_here("simulate", *SMALL, "--out", tmp_path / "sim", *args)
    one_line_error(res, *fragments)
    assert not (tmp_path / "sim").exists()  # refused before anything was written


@pytest.mark.parametrize("args, fragments", [
    (("--modes", "ps-async,ddp+powersgd"), ["ddp+powersgd", "virtual clock"]),
    (("--mode-args", "ps-async=--optimizer adam"), ["--mode-args", "--clock real"]),
    (("--shards", 2), ["--shards", "--clock virtual"]),
    (("--tensorboard",), ["--tensorboard"]),
    (("--log-to", "mlflow"), ["--log-to", "real modes"]),
])
def test_compare_virtual_refuses_what_it_cannot_simulate(run_cli_here, tmp_path, args,
                                                         fragments):
    res = run_cli_here("compare", "--clock", "virtual", *SMALL, "--modes", "ps-async",
                       "--out", tmp_path / "cmp", *args)
    one_line_error(res, *fragments)
    assert not (tmp_path / "cmp").exists()


def test_the_structured_values_parse_to_exact_parts():
    assert parse_slow_workers("0.25:4") == (0.25, 4.0)
    assert parse_slow_workers(None) == (0.0, 1.0)
    assert parse_leave("60:5, 30:3") == ((30.0, 3), (60.0, 5))
    assert parse_join("90,45") == ((45.0,), (90.0,))
    assert parse_worker_speeds("lognormal:0.5") == 0.5 and parse_worker_speeds(None) == 0.0
    for bad in ("normal:0.5", "lognormal:0", "lognormal"):
        with pytest.raises(ConfigError, match="--worker-speeds"):
            parse_worker_speeds(bad)
    for bad in ("30:3,40:3", "30:-1", "x:1"):
        with pytest.raises(ConfigError, match="--leave"):
            parse_leave(bad)


def test_compare_virtual_keeps_compares_settings_with_procs_as_workers():
    cfg = settings_of(CompareConfig(task=TASK, modes="ps-async,ddp", procs=8, budget=12.0,
                                    target=0.5, repeats=3, seed=4, link="1gbit",
                                    slowdown="1:4", eval_every=0.5, lr=0.2))
    assert isinstance(cfg, SimulateConfig)
    assert (cfg.workers, cfg.modes, cfg.budget, cfg.target, cfg.repeats, cfg.seed, cfg.link,
            cfg.slowdown, cfg.eval_every, cfg.lr) == (8, "ps-async,ddp", 12.0, 0.5, 3, 4,
                                                      "1gbit", "1:4", 0.5, 0.2)
    assert cfg.stop_at_target is False and cfg.step_time is None  # compare's; the profile


def test_the_profile_is_positive_and_finite(cache_dir):
    task = load_task(TASK, samples=200, cache_dir=str(cache_dir))
    costs = profile.profile(task, batch_size=16)
    params = sum(p.numel() for p in task.build_model().parameters())
    assert costs.gradient_bytes == 4 * params == 4 * (8 * 32 + 32 + 32 * 4 + 4)
    for value in (costs.step.median, costs.apply_per_byte, costs.link.bandwidth,
                  costs.link.latency):
        assert 0 < value and math.isfinite(value)
    assert costs.step.sigma == 0
    lines = profile.describe(costs)
    assert len(lines) == 4 and not any("given" in line for line in lines)
    assert "given" in profile.describe(costs, frozenset({"apply"}))[0]


def test_a_table_of_virtual_runs_says_virtual_seconds():
    goal = Goal(ACCURACY, 0.85, clock="virtual")
    names = columns(goal)
    assert "samples/virtual s" in names and "start-up virtual s" in names
    assert columns(Goal(ACCURACY, 0.85))[-4:-1] == ["start-up s", "staleness p50 / p99",
                                                    "coverage spread"]
    assert goal.seconds(0.01234) == "0.0123" and Goal(ACCURACY).seconds(12.34) == "12.3"


def test_runs_of_both_clocks_are_refused_in_one_table(tmp_path):
    attempts = []
    for clock in ("real", "virtual"):
        run = Run(tmp_path / clock, {"clock": clock, "task": {"metric": None}}, [], {})
        attempts.append(Attempt(clock, run=run))
    with pytest.raises(ConfigError, match="real clock and the virtual one"):
        Goal.of(attempts, None)
    assert Goal.of(attempts[1:], None).clock == "virtual"
    assert Goal.of(attempts[:1], None).clock == "real"


def _clock(path: Path) -> tuple:
    return tuple(json.loads((path / name).read_text()).get("clock")
                 for name in ("config.json", "summary.json"))


def test_simulate_writes_a_compare_report_on_the_virtual_clock(run_cli_here, tmp_path):
    out = tmp_path / "sim"
    res = run_cli_here("simulate", *SMALL, "--modes", "ps-async,ps-sync", "--repeats", 2,
                       "--workers", 3, "--target", 0.5, "--budget", 5, "--out", out)
    assert res.returncode == 0, res.stderr
    report = (out / "report.md").read_text()
    assert "virtual clock" in report.splitlines()[0]
    assert "virtual s" in report and "samples/virtual s" in parse_table(report)[0]
    results = json.loads((out / "results.json").read_text())
    assert [(r["mode"], r["seed"], r["status"]) for r in results["runs"]] == [
        ("ps-async", 0, "ok"), ("ps-async", 1, "ok"), ("ps-sync", 0, "ok"), ("ps-sync", 1, "ok")]
    for name in ("ps-async-r1", "ps-sync-r1", "ps-async-r2", "ps-sync-r2"):
        assert _clock(out / name) == ("virtual", "virtual"), name
    assert json.loads((out / "simulate.json").read_text())["costs"]["profiled"] == [
        "apply", "bytes", "link", "step"]
    assert (out / "accuracy_vs_time.png").is_file()
    assert "report: " in res.stdout


def test_compare_clock_virtual_runs_in_the_simulator(run_cli_here, tmp_path):
    out = tmp_path / "cmp"
    res = run_cli_here("compare", "--clock", "virtual", *SMALL, "--modes", "ps-async,ddp",
                       "--procs", 2, "--budget", 2, "--target", 0.5, "--stop-at-target",
                       "--out", out)
    assert res.returncode == 0, res.stderr
    assert (out / "compare.json").is_file() and (out / "ps-async-r1" / "config.json").is_file()
    assert _clock(out / "ddp-r1") == ("virtual", "virtual")
    assert "virtual clock" in (out / "report.md").read_text().splitlines()[0]


def test_simulate_tune_lr_runs_each_mode_with_its_soonest_candidate(run_cli_here, tmp_path):
    """Every candidate is simulated into tuning/, the grid and then the refinement around
    its leader; the chosen lr is the one whose own run directory reached the target
    soonest (an oracle read from those directories), the real runs use it, and the
    report's first line names it."""
    out = tmp_path / "sim"
    # a given step time and evaluation interval: the profile's, measured as the command
    # starts, varies with the machine's load, and with it which candidate leads
    res = run_cli_here("simulate", *SMALL, "--modes", "ps-sync", "--workers", 3, "--target",
                       0.8, "--budget", 5, "--tune", "lr", "--lr", 0.0005, "--step-time",
                       "1ms", "--eval-every", 0.05, "--out", out)
    assert res.returncode == 0, res.stderr
    results = json.loads((out / "results.json").read_text())
    tuning = results["tuning"]["ps-sync"]
    times = {}

    def tried(lrs):
        for lr in lrs:
            evals = [json.loads(line) for line in (out / "tuning" / f"ps-sync-lr{lr:g}" /
                                                   "metrics.jsonl").read_text().splitlines()]
            hit = [(e["t"], e["samples"]) for e in evals
                   if e["event"] == "eval" and e["accuracy"] >= TUNE_TARGET]
            times[lr] = hit[0] if hit else (float("inf"), 0)
        # the soonest, then the fewest samples, then the smaller lr
        return min((t, samples, lr) for lr, (t, samples) in times.items())

    best = tried([0.00025, 0.0005, 0.001, 0.0015, 0.002])  # x0.5..x4 and x3 workers
    for _ in range(REFINE_ROUNDS):  # then x2 and /2 of the leader where the grid has a gap
        more = refined(list(times), best[2])
        if not more:
            break
        best = tried(more)
    assert [c["lr"] for c in tuning["candidates"]] == sorted(times)
    assert best[0] < float("inf") and tuning["chosen"] == best[2]
    assert tuning["budget"] == 5 / 4  # the candidates' budget: a quarter of --budget
    # the grid's largest led, so the leader was refined over 3 rounds, x2 each time
    assert sorted(times) == [0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.004, 0.008, 0.016]
    # a candidate stopped by the race at the leader's first evaluation still recorded the
    # samples it had trained (not 0)
    assert all(samples > 0 for t, samples in times.values() if t < float("inf"))
    run = json.loads((out / "ps-sync-r1" / "config.json").read_text())
    assert run["config"]["lr"] == tuning["chosen"]
    report = (out / "report.md").read_text().splitlines()
    assert report[2] == f"Learning rate tuned per mode (--tune lr): ps-sync {tuning['chosen']:g}."


def test_worker_speeds_are_drawn_once_per_worker_by_the_seed():
    import math
    import random
    rng = random.Random("speeds-7")
    assert worker_speeds(3, 0.5, 7) == [rng.lognormvariate(0.0, 0.5) for _ in range(3)]
    assert worker_speeds(3, 0.0, 7) == [1.0, 1.0, 1.0]
    speeds = worker_speeds(4000, 0.5, 1)  # a lognormal of median 1 and sigma 0.5
    logs = sorted(math.log(s) for s in speeds)
    assert abs(logs[len(logs) // 2]) < 0.05 and abs(logs[int(0.8413 * 4000)] - 0.5) < 0.05
