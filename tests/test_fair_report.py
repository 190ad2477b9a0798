"""A fair report of repeats: each figure's median and spread (min–max), bands in the
plots, a verdict that names a winner only where the spreads separate, and the first lines
that name an oversubscribed host and a learning rate shared by every mode.

Runs are fabricated in memory (``Run`` over events), so every oracle is computed by hand.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncsgd.analysis.fairness import caveat, fairness_notes, recorded_notes
from asyncsgd.analysis.plots import band, draw_all, figure_data
from asyncsgd.analysis.report import Attempt, Goal, mode_rows, table_cells, verdict
from asyncsgd.config.modes import parse_modes
from asyncsgd.core.scoring import ACCURACY
from asyncsgd.run.reader import Run

GOAL = Goal(ACCURACY, 0.75)


def _run(points, **summary) -> Run:
    """A run whose metrics.jsonl held a start, then a train and an eval event at each
    (t, samples, accuracy)."""
    events = [{"event": "start", "t": 0.0, "samples": 0}]
    for t, samples, acc in points:
        events += [{"event": "train", "t": t, "samples": samples, "worker": 0,
                    "loss": 1 - acc, "steps": 10},
                   {"event": "eval", "t": t, "samples": samples, "loss": 1 - acc,
                    "accuracy": acc}]
    return Run(Path("fabricated"), {"mode": "single", "task": {"metric": ACCURACY.describe()}},
               events, summary)


# time to 75%, samples to it, final accuracy, samples/s after start-up, start-up
RUNS = {
    "fast": [[(1, 100, 0.3), (2, 400, 0.8), (5, 1300, 0.9)],      # 2.0 s, 400, 90%, 300/s, 1
             [(1, 100, 0.3), (3, 700, 0.8), (5, 1700, 0.85)],     # 3.0 s, 700, 85%, 400/s, 1
             [(2, 200, 0.3), (2.2, 600, 0.76), (6, 2200, 0.95)]],  # 2.2 s, 600, 95%, 500/s, 2
    "single": [[(1, 100, 0.3), (4, 500, 0.8), (8, 1000, 0.85)],    # 4.0 s, 500, 900/7 /s
               [(1, 100, 0.3), (5, 800, 0.8), (8, 1000, 0.85)],    # 5.0 s, 800
               [(1, 100, 0.3), (6, 900, 0.8), (8, 1000, 0.85)]],   # 6.0 s, 900
    "mid": [[(1, 100, 0.3), (2.8, 500, 0.8)], [(1, 100, 0.3), (3.5, 500, 0.8)],
            [(1, 100, 0.3), (4.5, 500, 0.8)]],                   # 2.8, 3.5, 4.5 s
    "lean": [[(1, 50, 0.3), (7, 100, 0.8)], [(1, 50, 0.3), (7.5, 150, 0.8)],
             [(1, 50, 0.3), (7.8, 200, 0.8)]],                   # 100, 150, 200 samples
}


def _attempts(*labels, repeats=3):
    return [Attempt(label, r, r, run=_run(RUNS[label][r]))
            for r in range(repeats) for label in labels]


def _rows(*labels, goal=GOAL, repeats=3):
    return {r.label: r for r in mode_rows(_attempts(*labels, repeats=repeats), goal)}


def test_the_table_shows_each_figures_median_and_min_max_over_three_repeats():
    rows = _rows("fast", "single")
    cells = table_cells(rows["fast"], GOAL)
    assert {k: cells[k] for k in ("final acc. %", "best acc. %", "time to 75%",
                                  "samples to 75%", "samples/s", "start-up s")} == {
        "final acc. %": "90.00 (85.00–95.00)", "best acc. %": "90.00 (85.00–95.00)",
        "time to 75%": "2.2 s (2.0–3.0)", "samples to 75%": "600 (400–700)",
        "samples/s": "400 (300–500)", "start-up s": "1.0 (1.0–2.0)"}
    # speed-ups are ratios of medians: single's 5.0 s over 2.2 s, 400/s over 900/7 per s
    assert cells["speed-up (time)"] == "2.27×" and cells["speed-up (samples/s)"] == "3.11×"
    assert rows["fast"].speedup_time == 5.0 / 2.2
    ttt = rows["fast"].to_dict()["time_to_target"]
    assert {k: ttt[k] for k in ("median", "min", "max", "n")} == {
        "median": 2.2, "min": 2.0, "max": 3.0, "n": 3}
    assert ttt["mean"] == pytest.approx(2.4) and ttt["std"] == pytest.approx(0.52915, rel=1e-4)


def test_one_run_shows_its_value_alone():
    cells = table_cells(_rows("fast", repeats=1)["fast"], GOAL)
    assert (cells["time to 75%"], cells["samples/s"]) == ("2.0 s", "300")


def test_a_verdict_names_the_winner_where_the_spreads_separate():
    """fast's slowest (3.0 s) beat single's fastest (4.0 s)."""
    assert verdict(list(_rows("fast", "single").values()), GOAL) == (
        "fast reached 75% first, in 2.2 s (2.0–3.0): 2.27x sooner than the next, single "
        "(5.0 s; 4.0–6.0), with 0.75x its samples (600 vs 800).")
    # lean's most samples (200) are fewer than fast's fewest (400): it is named for them
    assert verdict(list(_rows("fast", "single", "lean").values()), GOAL).endswith(
        "(600 vs 800); the fewest samples to 75%: lean (150; 100–200).")


def test_overlapping_spreads_are_not_distinguishable():
    """fast's slowest (3.0 s) is slower than mid's fastest (2.8 s)."""
    assert verdict(list(_rows("fast", "mid", "single").values()), GOAL) == (
        "Time to 75%: fast and mid are not distinguishable at 3 seeds (2.2 s (2.0–3.0) vs "
        "3.5 s (2.8–4.5): the spreads overlap).")


def test_a_score_separates_in_its_direction_and_one_seed_is_no_verdict():
    """Without a target: fast's finals (85–95%) overlap single's (85% each time); its
    slowest samples/s (300) beat single's fastest (900/7)."""
    none = Goal(ACCURACY)
    assert verdict(list(_rows("fast", "single", goal=none).values()), none) == (
        "Final accuracy: fast and single are not distinguishable at 3 seeds (90.00% "
        "(85.00–95.00) vs 85.00% (85.00–85.00): the spreads overlap); most samples/s: fast "
        "(400 (300–500)). Give --target to compare times to a target.")
    assert verdict(list(_rows("fast", "single", repeats=1).values()), GOAL,
                   caveat="Oversubscribed.") == (
        "fast reached 75% first, in 2.0 s: 2.00x sooner than the next, single (4.0 s), with "
        "0.80x its samples (400 vs 500). One seed per mode: no spread, no verdict (--repeats "
        "3 or more gives one). Oversubscribed.")


def test_a_mode_with_repeats_is_drawn_as_its_median_in_a_min_max_band(tmp_path):
    # three curves share x in [1, 2]; each is interpolated at every x any has there
    curves = [[(0, 0), (2, 2)], [(1, 10), (3, 30)], [(0, 5), (4, 5)]]
    assert band(curves) == ([1, 2], [5, 5], [1, 2], [10, 20])
    assert band([[(0, 1), (1, 1)], [(2, 1), (3, 1)]]) == ((), (), (), ())
    runs = [_run(points) for points in RUNS["mid"]]
    one = _run(RUNS["fast"][0])
    drawn = figure_data([("mid", runs), ("fast", [one])], GOAL)["accuracy_vs_time.png"]
    # mid's evaluations share [1, 2.8]: at 1 all score 30%; at 2.8 80, 30 + 50 * 1.8 / 2.5
    # and 30 + 50 * 1.8 / 3.5
    label, colour, xs, median, lo, hi = drawn[0]
    assert (label, colour, xs) == ("mid", 0, [1, 2.8])
    assert median == pytest.approx([30, 66]) and hi == pytest.approx([30, 80])
    assert lo == pytest.approx([30, 30 + 50 * 1.8 / 3.5])
    assert drawn[1] == ("fast", 1, [1, 2, 5], [a * 100 for a in (0.3, 0.8, 0.9)])
    written = draw_all([("mid", runs), ("fast", [one])], tmp_path, GOAL)
    assert [name for name, _ in written] == ["accuracy_vs_time.png", "loss_vs_time.png",
                                             "loss_vs_samples.png", "throughput.png"]


MODES = parse_modes("single,hogwild,ps-async,ps-sync,ddp")


def test_an_oversubscribed_comparison_says_so_first_and_in_its_verdict():
    notes = fairness_notes(4, 2, MODES, None, lr=0.1, shards="auto")
    assert notes == [
        "Oversubscribed: 4 training processes on 2 cores (the workers or ranks of each "
        "parallel mode; the ps-* modes also run a parameter server, with --shards auto shard "
        "process(es)), so they take turns on the cores. Lock-step modes (ps-sync, ddp) wait "
        "at every step for their slowest process, often one the scheduler has set aside: "
        "their times pay for the scheduler, not for the algorithm. Figures that hold beyond "
        "this host need --procs 2 or fewer.",
        "One learning rate for every mode: lr 0.1. Synchronous modes that average one "
        "gradient per process into each step (ps-sync, ddp) take one step per 4 batches "
        "where the others take one per batch, so they need a larger lr (linear scaling: lr "
        "x 4); at one lr they are disadvantaged. --tune lr gives each mode its own."]
    assert caveat(4, 2, MODES) == ("Oversubscribed (4 training processes on 2 cores): the "
                                   "lock-step modes (ps-sync, ddp) paid for the scheduler, "
                                   "not for the algorithm.")
    assert fairness_notes(4, 2, MODES, None, real_clock=False)[0].startswith("One learning")


def test_a_comparison_within_its_cores_names_only_its_learning_rates():
    assert fairness_notes(2, 2, MODES, {"ddp": 0.4, "ps-sync": 0.2, "ps-async": 0.1}) == [
        "Learning rate tuned per mode (--tune lr): ddp 0.4, ps-sync 0.2, ps-async 0.1."]
    assert caveat(2, 2, MODES) == ""
    assert fairness_notes(2, 4, parse_modes("hogwild,ps-sync,diloco:8"), None,
                          own_lr=("ps-sync",)) == [
        "One learning rate for every mode: the task's, except ps-sync, whose --mode-args set "
        "their own. --tune lr gives each mode its own."]


def test_plot_names_oversubscription_where_the_runs_recorded_it():
    def run(mode, cpus, clock=None, **settings):
        record = {"mode": mode, "config": settings, "host": {"cpus": cpus}}
        return SimpleNamespace(record={**record, **({"clock": clock} if clock else {})})

    lines, said = recorded_notes([
        ("single", run("single", 2)), ("hogwild", run("hogwild", 2, procs=4)),
        ("ps-sync", run("ps", 2, workers=4, consistency="sync", shards=1)),
        ("ps-async", run("ps", 2, "virtual", workers=4)),  # the virtual clock: no cores
        ("ddp", run("ddp", None, procs=4))])              # no CPUs recorded
    assert lines == [fairness_notes(4, 2, parse_modes("hogwild,ps-sync"), None,
                                    shards=1)[0]]
    assert said == caveat(4, 2, parse_modes("hogwild,ps-sync"))
    assert recorded_notes([("hogwild", run("hogwild", 8, procs=4))]) == ([], "")
