"""--epochs not given (friction 4): a run that --target or --max-seconds ends goes on until
that ends it, where 20 epochs used to stop it short; a run given neither keeps 20; a worker
not given them trains its server's."""

from asyncsgd.config import (DEFAULT_EPOCHS, NO_EPOCH_LIMIT, CompareConfig, DDPConfig,
                             HogwildConfig, JobConfig, ServerConfig, SingleConfig, WorkerConfig)
from conftest import finish, one_line_error, read_json, worker


def test_the_epochs_a_run_gets_when_none_are_given():
    assert SingleConfig().epochs == DEFAULT_EPOCHS == 20
    assert SingleConfig(max_seconds=5).epochs == NO_EPOCH_LIMIT
    assert HogwildConfig(target=0.9).epochs == NO_EPOCH_LIMIT
    assert DDPConfig(target=0.9, epochs=3).epochs == 3  # given: kept
    assert ServerConfig().epochs == 20 and ServerConfig(target=0.9).epochs == NO_EPOCH_LIMIT
    assert WorkerConfig().epochs is None  # its server's, from the welcome
    assert WorkerConfig(max_seconds=5).epochs == NO_EPOCH_LIMIT
    assert JobConfig().epochs is None  # decided by its server's and workers' settings
    assert CompareConfig().epochs is None  # compare's budget ends its runs


def test_a_schedule_over_the_runs_epochs_needs_a_length_when_none_are_given(run_cli_here):
    one_line_error(run_cli_here("single", "--max-seconds", 5, "--lr-schedule", "linear"),
                   "--lr-schedule linear", "linear:5000", "--epochs")


def test_single_with_max_seconds_trains_past_twenty_epochs(tmp_path, run_cli_here):
    """16 rows in batches of 16: an epoch a step, so 20 epochs are 20 steps, done in far
    less than the 3 s that end this run."""
    res = run_cli_here("single", "--task", "tasks_for_tests:dense_rows", "--samples", 16,
                       "--batch-size", 16, "--max-seconds", 3, "--threads", 1,
                       "--progress", "off", "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["stopped_by"] == "max_seconds", summary["stopped_by"]
    assert summary["steps"] > DEFAULT_EPOCHS


def test_a_worker_not_given_epochs_trains_its_servers(server, cli_env):
    """The server's --epochs 2 reach its worker in the welcome: 2 passes over 40 rows."""
    task = ["--task", "tasks_for_tests:dense_counter", "--samples", 40]
    srv = server(*task, "--epochs", 2)
    (code, _, err), = finish([worker(cli_env, srv.address, 0, 1, *task)])
    assert code == 0, err
    assert srv.wait()[0] == 0
    assert read_json(srv.out / "summary.json")["samples"] == 2 * 40
