"""``compare --tune lr``: the candidate grid, the pick among candidates (known answers), what
the CLI refuses, and one short tuned comparison whose report names the candidate its own run
directories say was best."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from asyncsgd.analysis.report import Goal, parse_table
from asyncsgd.analysis.tuning import (Outcome, choose, edge_note, is_synchronous, lr_grid,
                                      refine, refined,
                                      render_tuning, tried_first)
from asyncsgd.comparison import tuner
from asyncsgd.config import CompareConfig
from asyncsgd.config.compare import REFINE_ROUNDS
from asyncsgd.config.modes import parse_modes
from asyncsgd.core.scoring import ACCURACY, PERPLEXITY
from asyncsgd.errors import ConfigError
from conftest import asyncsgd_cmd, one_line_error, read_events


def test_the_grid_is_x05_to_x4_and_synchronous_modes_add_linear_scaling():
    assert lr_grid(0.1, False, 4) == [0.025, 0.05, 0.1, 0.2, 0.4]  # / 2 is in the grid
    assert lr_grid(0.1, False, 64) == [0.0015625, 0.0125, 0.05, 0.1, 0.2, 0.4]  # / N, / sqrt N
    assert lr_grid(0.1, True, 2) == [0.05, 0.1, 0.2, 0.4]  # x2 is in the grid already
    assert lr_grid(0.1, True, 8) == [0.05, 0.1, 0.2, 0.4, 0.8]
    assert lr_grid(0.1, True, 3) == [0.05, 0.1, 0.2, 0.3, 0.4]  # 0.1 * 3 named as 0.3
    assert lr_grid(1.0, True, 1) == [0.5, 1.0, 2.0, 4.0]


def test_the_modes_that_average_several_workers_per_step_are_synchronous():
    names = ("single,hogwild,ps-async,ps-ssp,ps-ssp:4,ps-sync,ps-backup:1,ddp,ddp+fp16,"
             "ddp+powersgd:2,ddp-local:4,diloco:8,async-diloco:8,ps-sync+int8,ps-async+bf16")
    synchronous = {s.name for s in parse_modes(names) if is_synchronous(s)}
    assert synchronous == {"ps-sync", "ps-backup:1", "ddp", "ddp+fp16", "ddp+powersgd:2",
                           "ddp-local:4", "diloco:8", "ps-sync+int8"}


def _o(lr, time=None, samples=None, best=None, status="ok"):
    return Outcome(lr, time, samples, best, best, status)


def test_the_soonest_to_the_target_wins():
    choice = choose([_o(0.05, 9.0, 900, 0.9), _o(0.1, 7.5, 800, 0.9), _o(0.2, 8.0, 600, 0.9)])
    assert choice.lr == 0.1 and choice.criterion == "time"
    assert choice.why == "the soonest to the target (7.5 s)"
    assert [o.lr for o in choice.outcomes] == [0.05, 0.1, 0.2]  # the whole table, by lr


def test_the_samples_criterion_counts_samples_and_breaks_ties_by_time():
    outcomes = [_o(0.05, 9.0, 900), _o(0.1, 7.5, 800), _o(0.2, 8.0, 600), _o(0.4, 6.0, 600)]
    choice = choose(outcomes, "samples")
    assert choice.lr == 0.4 and choice.why == "the fewest samples to the target (600 samples)"
    # time breaks a tie in samples the other way round too
    assert choose([_o(0.1, 5.0, 800), _o(0.2, 5.0, 700)], "time").lr == 0.2


def test_a_candidate_that_reached_the_target_beats_a_better_scoring_one_that_did_not():
    """lr 0.4 scored higher (best 0.84 against 0.81, say, after diverging later) but never
    reached 0.85 in its short budget; lr 0.05 reached it: the target decides."""
    slow_but_there = Outcome(0.05, 14.0, 160_000, 0.81, 0.86)
    high_but_short = Outcome(0.4, None, None, 0.84, 0.849)
    assert choose([high_but_short, slow_but_there]).chosen is slow_but_there
    assert choose([high_but_short, slow_but_there], "samples").chosen is slow_but_there


def test_without_a_target_reached_the_best_score_wins_in_the_metrics_direction():
    outcomes = [_o(0.1, best=0.7), _o(0.2, best=0.8), _o(0.4, status="failed")]
    choice = choose(outcomes)
    assert choice.lr == 0.2 and choice.why == "no candidate reached the target: the best score"
    perplexities = [_o(0.1, best=3.0), _o(0.2, best=2.5)]
    assert choose(perplexities, higher_is_better=False).lr == 0.2
    assert choose(perplexities, higher_is_better=True).lr == 0.1
    nothing = choose([_o(0.4, status="failed"), _o(0.2, status="failed")])
    assert nothing.lr == 0.2 and nothing.why.startswith("no candidate recorded a score")


def test_a_tie_goes_to_the_smaller_lr_and_says_so():
    choice = choose([_o(0.4, 6.0, 500), _o(0.2, 6.0, 500), _o(0.1, 6.0, 700)])
    assert choice.lr == 0.2
    assert choice.why == ("the soonest to the target (6.0 s); tied with lr 0.4, the smaller "
                          "lr wins")
    unreached = choose([_o(0.4, best=0.8), _o(0.2, best=0.8)])
    assert unreached.lr == 0.2 and unreached.why.endswith("tied with lr 0.4, the smaller lr wins")
    with pytest.raises(ValueError, match="criterion 'loss'"):
        choose([_o(0.1)], "loss")


def test_the_learning_rates_section_marks_the_chosen_candidate():
    choice = choose([Outcome(0.05, None, None, 0.8, 0.82, run_dir="tuning/ddp-lr0.05"),
                     Outcome(0.1, 7.25, 80_000, 0.9, 0.91), _o(0.2, status="failed")])
    lines = render_tuning({"ddp": choice}, Goal(ACCURACY, 0.85), 15.0, 3)
    assert lines[0] == "## Learning rates"
    assert "seed 3, for up to 15 s, stopping at 85%" in lines[2]
    table = lines[lines.index("| mode | lr | time to 85% | samples to 85% | best acc. % "
                              "| chosen |"):]
    assert table[2:5] == ["| ddp | 0.05 | not reached | — | 82.00 |  |",
                          "| ddp | **0.1** | 7.2 s | 80,000 | 91.00 | **chosen** |",
                          "| ddp | 0.2 | failed | — | — |  |"]
    assert "- ddp: lr 0.1, the soonest to the target (7.2 s)." in lines
    assert choice.to_dict()["chosen"] == 0.1 and len(choice.to_dict()["candidates"]) == 3
    perplexity = render_tuning({"lm": choice}, Goal(PERPLEXITY, 2.0), 10, 0)
    assert any("time to perplexity 2 |" in ln for ln in perplexity)


def test_the_tune_budget_is_a_quarter_of_the_budget_within_10_s_and_the_budget():
    assert tuner.tune_budget(CompareConfig(budget=120)) == 30
    assert tuner.tune_budget(CompareConfig(budget=20)) == 10
    assert tuner.tune_budget(CompareConfig(budget=6)) == 6
    assert tuner.tune_budget(CompareConfig(budget=120, tune_budget=7)) == 7


BLOBS = "tasks_for_tests:blob_dataset"  # no default target


@pytest.mark.parametrize("args, fragments", [
    (["--tune", "lr"], ["--tune lr", "no default target", "give --target"]),
    (["--tune-budget", "5", "--target", "0.9"], ["--tune-budget", "add --tune lr"]),
    (["--tune", "grid"], ["'grid' is not one of 'none', 'lr'"]),
    (["--tune", "lr", "--target", "0.9", "--tune-budget", "0"], ["--tune-budget"]),
])
def test_compare_refuses_what_tune_cannot_do_before_running(run_cli_here, tmp_path, args,
                                                            fragments):
    res = run_cli_here("compare", "--task", BLOBS, "--modes", "single", *args,
                       "--out", tmp_path / "cmp", "--progress", "off")
    one_line_error(res, *fragments)
    assert not (tmp_path / "cmp").exists()


def test_the_python_api_checks_tune_as_the_option_does(tmp_path):
    import asyncsgd
    with pytest.raises(ConfigError, match="tune='grid'"):
        asyncsgd.compare(task=BLOBS, modes="single", tune="grid", out=str(tmp_path / "c"))


# The e2e test: one mode, 4 candidates of TUNE_BUDGET s each, stopping at TARGET.
TUNE_BUDGET, TARGET, BASE_LR = 3, 0.95, 0.0005


def _reached(run_dir, target):
    """(time, samples) of the first evaluation at or past ``target`` in a run's own
    metrics.jsonl, or None; and its best accuracy."""
    evals = [e for e in read_events(run_dir) if e["event"] == "eval"]
    hit = next((e for e in evals if e["accuracy"] >= target), None)
    best = max((e["accuracy"] for e in evals), default=-math.inf)
    return (None if hit is None else (hit["t"], hit["samples"])), best


def test_compare_tune_lr_runs_with_the_candidate_its_runs_say_was_best(cli_env, tmp_path):
    out = tmp_path / "cmp"
    res = subprocess.run(asyncsgd_cmd(
        "compare", "--task", BLOBS, "--samples", 2000, "--modes", "single", "--tune", "lr",
        "--tune-budget", TUNE_BUDGET, "--budget", TUNE_BUDGET, "--target", TARGET,
        "--eval-every", 0.2, "--lr", BASE_LR, "--progress", "log", "--out", out),
        env=cli_env, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    grid = [0.00025, 0.0005, 0.001, 0.002]
    figures, budget = {}, [TUNE_BUDGET]

    def tried(lrs):
        for lr in lrs:
            run_dir = out / "tuning" / f"single-lr{lr:g}"
            config = json.loads((run_dir / "config.json").read_text())["config"]
            # once one reached the target, the next run no longer than it took (+ one eval)
            assert config["lr"] == lr and config["max_seconds"] == pytest.approx(budget[0])
            assert config["target"] == TARGET  # stopped at the target
            figures[lr] = _reached(run_dir, TARGET)
            if figures[lr][0]:
                budget[0] = min(budget[0], figures[lr][0][0] + 0.2)
            assert f"tune single: lr {lr:g} " in res.stderr

    def best():
        # the soonest (then fewest samples, then smaller lr) of those that reached the
        # target, else the best score
        reached = [(hit[0], hit[1], lr) for lr, (hit, _) in figures.items() if hit]
        return min(reached)[2] if reached else max(figures, key=lambda lr: (figures[lr][1],
                                                                           -lr))

    tried(tried_first(grid, BASE_LR))  # nearest the base lr first: 0.0005, 0.001, ...
    expected = best()
    for _ in range(REFINE_ROUNDS):  # then x2 and /2 of a leader that reached the target,
        more = refined(list(figures), expected) if figures[expected][0] else []  # in gaps
        if not more:
            break
        assert f"tune single: lr {expected:g} leads; refining with lr" in res.stderr
        tried(more)
        expected = best()
    results = json.loads((out / "results.json").read_text())
    tuning = results["tuning"]["single"]
    assert tuning["chosen"] == expected and tuning["criterion"] == "time"
    assert [c["lr"] for c in tuning["candidates"]] == sorted(figures)
    assert set(grid) <= set(figures)
    for c in tuning["candidates"]:
        hit = figures[c["lr"]][0]
        assert (c["time_to_target"], c["samples_to_target"]) == (hit or (None, None))
        assert c["run_dir"] == os.path.join("tuning", f"single-lr{c['lr']:g}")
    label = f"single (lr {expected:g})"
    assert [r["mode"] for r in results["runs"]] == [label]
    real = json.loads((out / "single-r1" / "config.json").read_text())["config"]
    assert real["lr"] == expected and real["max_seconds"] == TUNE_BUDGET
    report = (out / "report.md").read_text()
    row = next(r for r in parse_table(report) if r["mode"] == label)
    # single is still the baseline: its speed-ups are 1.00x, or undefined where its 3-s run
    # missed the target or a steady rate (as under load)
    assert {row["speed-up (time)"], row["speed-up (samples/s)"]} <= {"1.00×", "—"}
    assert "## Learning rates" in report
    assert f"| single | **{expected:g}** |" in report and report.count("**chosen**") == 1
    assert f"Learning rate tuned per mode (--tune lr): single {expected:g}." in report
    assert "lr tuned per mode: see Learning rates" in report
    assert f"tune single: lr {expected:g} chosen" in res.stderr
    assert Path(out / "tuning" / "logs" / f"single-lr{expected:g}").is_dir()


@pytest.mark.parametrize("mode, server_lr, worker_lr", [
    ("single", "0.3", None), ("hogwild", "0.3", None), ("ddp+fp16", "0.3", None),
    ("ps-sync", "0.3", None), ("ps-async+int8", "0.3", "0.3"),
    ("diloco:8", "0.7", "0.3"),  # the outer Nesterov step keeps its lr; the workers' is tuned
])
def test_a_mode_run_takes_its_own_lr_over_the_comparisons(tmp_path, mode, server_lr,
                                                          worker_lr):
    from asyncsgd.comparison.mode_run import ModeRun

    def flag(flags, name):
        return flags[len(flags) - 1 - flags[::-1].index(name) + 1] if name in flags else None

    spec = parse_modes(mode)[0]
    run = ModeRun(CompareConfig(lr=0.1, procs=2), spec, 0, tmp_path, {}, None, lr=0.3,
                  name=f"{spec.slug}-lr0.3")
    assert run.run_dir == tmp_path / f"{spec.slug}-lr0.3"
    assert run.logs == tmp_path / "logs" / f"{spec.slug}-lr0.3"
    assert flag(run.command(), "--lr") == server_lr  # the last --lr is the one click keeps
    worker = run.worker_command("tcp://127.0.0.1:1", 0)
    assert flag(worker, "--local-lr") == worker_lr
    plain = ModeRun(CompareConfig(lr=0.1, procs=2), spec, 1, tmp_path, {}, None)
    assert plain.run_dir == tmp_path / f"{spec.slug}-r2"
    assert flag(plain.command(), "--lr") == ("0.7" if mode.startswith("diloco") else "0.1")


def test_a_pick_at_the_grids_edge_says_a_better_lr_may_lie_beyond():
    """ddp's candidates measured on mnist1d-cnn: the largest one won, so the report says a
    larger lr may do better; a pick inside the grid says nothing."""
    edge = choose([_o(0.05, 13.6, 311_456), _o(0.1, 7.0, 127_072), _o(0.4, 4.9, 56_704)])
    assert edge.lr == 0.4 and edge_note(edge) == (
        " (the largest lr tried: a larger one may do better; give --lr to move the grid)")
    low = choose([_o(0.05, 3.0, 10_000), _o(0.1, 7.0, 127_072)])
    assert "smallest lr tried: a smaller one" in edge_note(low)
    inside = choose([_o(0.05, 13.6, 311_456), _o(0.1, 4.0, 100_000), _o(0.4, 6.4, 193_536)])
    assert inside.lr == 0.1 and edge_note(inside) == ""


def test_a_tuner_tries_the_lrs_nearest_the_base_first():
    """So the likeliest winner sets the bar the later candidates are stopped at."""
    assert tried_first([0.05, 0.1, 0.2, 0.4, 6.4], 0.1) == [0.1, 0.2, 0.05, 0.4, 6.4]
    assert tried_first([0.25, 0.5, 1.0, 2.0], 0.5) == [0.5, 1.0, 0.25, 2.0]


def test_refinement_doubles_and_halves_the_leader_where_the_grid_leaves_a_gap():
    sync_64 = [0.05, 0.1, 0.2, 0.4, 6.4]  # ps-sync's grid at 64 workers
    assert refined(sync_64, 0.4) == [0.8]
    assert refined(sync_64 + [0.8], 0.8) == [1.6]
    assert refined(sync_64, 0.1) == []
    async_64 = [0.0015625, 0.0125, 0.05, 0.1, 0.2, 0.4]
    assert refined(async_64, 0.0125) == [0.00625, 0.025]
    assert refined([0.05, 0.1, 0.2, 0.3, 0.4], 0.05) == [0.025]  # the smallest, at the edge
    assert refined([0.1], 0.1) == [0.05, 0.2]
    assert refined([0.1, 0.3], 0.1) == [0.05, 0.2]  # 0.3 is more than x2 above
    assert refined([0.06, 0.1, 0.15], 0.1) == []  # both neighbours within x2


def test_refinement_only_around_a_leader_that_reached_the_target():
    """Around a leader that reached it: its x2 (0.8, then 1.6, which loses to 0.8). Around
    one picked by best score alone: nothing, however wide the gap."""
    def pick(outcomes):
        return choose(outcomes, "time")

    reached = {0.1: 5.0, 0.2: 4.0, 0.4: 3.0, 0.8: 2.0, 1.6: None}
    tried = []

    def trial(lrs, leader):
        tried.append(lrs)
        return [Outcome(lr, reached[lr], 1000 if reached[lr] else None, 0.9, 0.9)
                for lr in lrs]

    grid = [Outcome(lr, reached[lr], 1000, 0.9, 0.9) for lr in (0.1, 0.2, 0.4)]
    assert refine(grid, pick, trial, lambda text: None).lr == 0.8
    assert tried == [[0.8], [1.6]]
    tried.clear()
    missed = [Outcome(lr, None, None, 0.5, 0.5) for lr in (0.1, 0.2, 0.4)]
    assert refine(missed, pick, trial, lambda text: None).lr == 0.1 and tried == []
