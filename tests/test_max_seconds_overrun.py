"""--max-seconds holds with a slow evaluation (friction 10: an lm run given 40 s took 48.5):
the final evaluation's time is set aside before the stop, a periodic one that would end past
the deadline is left to it, and the model is not evaluated twice at the same samples."""

from conftest import read_events, read_json

EVAL_SECONDS, LIMIT = 1.5, 4.0


def test_a_slow_evaluation_does_not_carry_the_run_past_max_seconds(tmp_path, run_cli_here):
    res = run_cli_here("single", "--task", "tasks_for_tests:slow_eval_counter",
                       "--max-seconds", LIMIT, "--eval-every", 0.5, "--threads", 1,
                       "--progress", "off", "--out", tmp_path / "run",
                       env={"ASYNCSGD_TEST_EVAL_SECONDS": str(EVAL_SECONDS)})
    assert res.returncode == 0, res.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["stopped_by"] == "max_seconds"
    # before: the deadline, then the final evaluation (>= 5.5 s); now within a step of it
    assert summary["train_seconds"] < LIMIT + 0.5, summary["train_seconds"]
    evals = [e["samples"] for e in read_events(tmp_path / "run") if e["event"] == "eval"]
    assert len(evals) == len(set(evals)), evals  # no sample count evaluated twice
