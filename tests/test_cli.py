"""The installed CLI as a user meets it: help, bad input, progress, user tasks. What it refuses
before starting anything, and its help, run in this process (conftest.run_cli_here)."""

import dataclasses
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncsgd import HogwildConfig
from conftest import asyncsgd_cmd, free_port, one_line_error, read_json

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("args, fragments", [
    (["--procs", "0"], ["--procs", "0 is not in the range"]),
    (["--task", "no-such-task"], ["unknown task 'no-such-task'", "mnist1d-cnn"]),
    (["--task", "no_such_module_xyz:make"], ["cannot import module 'no_such_module_xyz'"]),
    (["--task", "tasks_for_tests:missing"], ["has no function 'missing'"]),
    (["--task", "tasks_for_tests:not_a_task"], ["returned int", "asyncsgd.Task"]),
    (["--task", "mnist-cnn", "--data-dir", "/nonexistent/mnist"],
     ["/nonexistent/mnist: no such directory"]),
    (["--task", "mnist-cnn"], ["--data-dir"]),
    (["--task", "mnist1d-cnn", "--data-dir", "/tmp"], ["only read by the tasks"]),
    (["--lr", "-1"], ["--lr"]),
    (["--target-accuracy", "85"], ["--target 85", "between 0 and 1"]),
    (["--task", "lm", "--target", "0.5"], ["perplexity is at least 1"]),
    (["--task", "mnist1d-mlp:height=3"], ["has no option height", "width=256, depth=2"]),
    (["--no-such-flag"], ["No such option '--no-such-flag'"]),
    (["--resume", "/nonexistent/run"], ["/nonexistent/run does not exist"]),
])
def test_bad_input_gives_one_clear_line(run_cli_here, args, fragments):
    one_line_error(run_cli_here("hogwild", *args, "--progress", "off"), *fragments)


@pytest.mark.parametrize("make", [False, True])
def test_a_resume_of_a_missing_or_empty_directory_is_a_usage_error(run_cli_here, tmp_path, make):
    """Exit 2 (bad usage) naming what is wrong: it does not exist, or holds no run."""
    where = tmp_path / "run"
    if make:
        where.mkdir()
    res = run_cli_here("single", "--resume", where)
    one_line_error(res, str(where), "not a run directory (no config.json)" if make
                   else "does not exist")
    assert res.returncode == 2


def test_unwritable_out_is_one_clear_line(run_cli_here, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    one_line_error(run_cli_here("hogwild", "--out", blocker / "run", "--epochs", "1"),
                   "cannot write the run directory", "--out")


def test_out_holding_a_run_is_refused(run_cli_here, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    one_line_error(run_cli_here("hogwild", "--out", tmp_path), "already holds a run", "--resume")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_is_one_clear_line(run_cli_here):
    one_line_error(run_cli_here("hogwild", "--device", "cuda", "--epochs", "1"),
                   "no CUDA GPU", "--device cpu")


def _option_entries(help_text):
    """{flag: its whole help entry} from the option sections (the groups of a settings
    command, after its description)."""
    entries, current = {}, None
    for line in re.split(r"^\S[^\n]*:$", help_text, maxsplit=1, flags=re.M)[1].splitlines():
        m = re.match(r"^  (?:-\w, )?(--[a-z][a-z-]*)", line)
        if m:
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def test_help_documents_every_option_with_its_default(run_cli_here):
    res = run_cli_here("hogwild", "--help")
    assert res.returncode == 0
    entries = _option_entries(res.stdout)
    for f in dataclasses.fields(HogwildConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in entries, flag
        if f.type not in (bool, "bool"):
            assert "[default:" in entries[flag], f"{flag} shows no default: {entries[flag]}"
        assert len(f.metadata["help"]) > 12
    assert "asyncsgd hogwild --task mnist1d-cnn --procs 8" in res.stdout


def test_tasks_lists_the_builtin_tasks(run_cli_here):
    res = run_cli_here("tasks")
    assert res.returncode == 0
    for name in ("mnist1d-cnn", "mnist1d-mlp", "sparse-logreg", "mnist-cnn", "mnist-mlp"):
        assert name in res.stdout


def test_log_progress_and_final_accuracy_printed(run_cli, tmp_path):
    res = run_cli("hogwild", "--procs", "2", "--epochs", "3", "--out", tmp_path / "run",
                  "--progress", "log", "--start-method", "forkserver")
    assert res.returncode == 0, res.stderr
    assert re.search(r"\[hogwild\] \d\d:\d\d [\d,]+/12,000 samples \| [\d,]+ samples/s", res.stderr)
    match = re.search(r"final test accuracy: ([\d.]+)%", res.stdout)
    summary = read_json(tmp_path / "run" / "summary.json")
    assert match and abs(float(match.group(1)) - 100 * summary["final_metric"]) < 0.01
    assert f"run directory: {tmp_path / 'run'}" in res.stdout


def test_readme_user_task_example_runs(run_cli, tmp_path, cli_env):
    """The worked example in docs/tasks.md is real code that trains."""
    readme = (ROOT / "docs" / "tasks.md").read_text()
    block = re.search(r"```python\n# my_task\.py\n(.*?)```", readme, re.S)
    assert block, "docs/tasks.md lacks the my_task.py example"
    (tmp_path / "my_task.py").write_text(block.group(1))
    cli_env["PYTHONPATH"] = f"{tmp_path}:{cli_env['PYTHONPATH']}"
    command = re.search(r"asyncsgd hogwild --task my_task:make_task[^\n`]*", readme).group(0)
    args = command.split()[1:] + ["--out", str(tmp_path / "run"), "--progress", "off"]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["task"] == "my-task" and summary["final_metric"] > 0.8


def test_tensorboard_writes_event_files(run_cli, tmp_path):
    pytest.importorskip("tensorboard")
    res = run_cli("hogwild", "--procs", "1", "--epochs", "1", "--tensorboard",
                  "--out", tmp_path / "run", "--progress", "off")
    assert res.returncode == 0, res.stderr
    files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert files and files[0].stat().st_size > 100


@pytest.mark.parametrize("command, args, child_lines", [
    ("hogwild", ["--procs", 2, "--epochs", 1],
     [r"asyncsgd\.modes\.hogwild: worker 0: \d+ thread", r"asyncsgd\.modes\.hogwild: worker 1: "]),
    ("ddp", ["--procs", 2, "--epochs", 1],
     [r"asyncsgd\.modes\.ddp: rank 0 of 2 joined", r"asyncsgd\.modes\.ddp: rank 1 of 2 joined"]),
    ("ps-server", ["--shards", 2, "--max-seconds", 2, "--bind", "tcp://127.0.0.1:0"],
     [r"servers\.shard_process: shard 0 serving \[0, ",
      r"servers\.shard_process: shard 1 serving"]),
])
def test_verbose_logging_reaches_every_child_process(run_cli, tmp_path, command, args,
                                                     child_lines):
    """-v gives the spawned processes (Hogwild workers, DDP ranks, shards) the parent's level
    and format: their info lines appear, each named by its module as the parent's are."""
    res = run_cli("-v", command, *args, "--out", tmp_path / "run", "--progress", "off")
    assert res.returncode == 0, res.stderr
    for line in child_lines:
        assert re.search(line, res.stderr), (line, res.stderr)


def test_without_verbose_children_log_only_warnings(run_cli, tmp_path):
    res = run_cli("hogwild", "--procs", 2, "--epochs", 1, "--out", tmp_path / "run",
                  "--progress", "off")
    assert res.returncode == 0, res.stderr
    assert "worker 0:" not in res.stderr and "asyncsgd.modes.hogwild" not in res.stderr


@pytest.mark.parametrize("delay", [0.2, 0.4, 0.7, 1.0])
def test_ctrl_c_while_a_command_starts_is_never_lost(cli_env, delay):
    """Ctrl-C while the command still imports torch: torch and numpy swallow a
    KeyboardInterrupt raised inside their imports (main's worker then ran on and ended
    with 'no answer from the server' after --server-timeout). It ends the command as
    Ctrl-C does, at once: 130, or killed by SIGINT if it came before Python started ours."""
    proc = subprocess.Popen(asyncsgd_cmd("worker", "--server", f"tcp://127.0.0.1:{free_port()}",
                                         "--server-timeout", 30, "--progress", "off"),
                            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert time.monotonic() - sent < 20, err  # not the 30 s of --server-timeout
    assert "no answer from the server" not in err, err


LOUD_TASK = '''
import logging

import torch

from asyncsgd import Split, Task

log = logging.getLogger("loud_task")


def make_model():
    return torch.nn.Linear(4, 2)


def make_task(samples=None):
    log.info("built at info")
    log.debug("built at debug")
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    return Task(name="loud", model_fn=make_model, train=Split((x[:48],), y[:48]),
                test=Split((x[48:],), y[48:]), lr=0.1, batch_size=16)
'''


@pytest.mark.parametrize("before, after, info, debug", [
    ([], [], False, False),
    (["-v"], [], True, False),
    ([], ["-v"], True, False),
    ([], ["--verbose"], True, False),
    (["-v"], ["-v"], True, True),  # the counts add up
    ([], ["-vv"], True, True),
])
def test_verbose_is_taken_before_and_after_the_command(tmp_path, cli_env, run_cli, before,
                                                        after, info, debug):
    (tmp_path / "loud_task.py").write_text(LOUD_TASK)
    cli_env["PYTHONPATH"] = f"{tmp_path}:{cli_env['PYTHONPATH']}"
    res = run_cli(*before, "single", *after, "--task", "loud_task:make_task", "--epochs", 1,
                  "--threads", 1, "--out", tmp_path / "run", "--progress", "off")
    assert res.returncode == 0, res.stderr
    assert ("loud_task: built at info" in res.stderr) == info, res.stderr
    assert ("loud_task: built at debug" in res.stderr) == debug, res.stderr


@pytest.mark.parametrize("args", [["tasks", "-v"], ["worker", "-v", "--help"],
                                  ["hosts", "-v", "--help"], ["hosts", "down", "--help", "-v"]])
def test_every_command_takes_verbose(run_cli_here, args):
    res = run_cli_here(*args)
    assert res.returncode == 0, res.stderr
    assert "No such option" not in res.stderr


def test_resuming_another_modes_run_refuses_before_any_warning(tmp_path, run_cli):
    """A Hogwild run's saved settings (procs, lock...) are no single/ddp/ps-server settings:
    the refusal comes first, as the only line, not after warnings about them."""
    run = tmp_path / "run"
    res = run_cli("hogwild", "--task", "mnist1d-mlp", "--samples", 500, "--procs", 1,
                  "--epochs", 1, "--out", run, "--progress", "off")
    assert res.returncode == 0, res.stderr
    for command, mode in (("single", "single"), ("ddp", "ddp"), ("ps-server", "ps")):
        res = run_cli(command, "--resume", run, "--progress", "off", timeout=120)
        one_line_error(res, f"{run} is a hogwild run, not a {mode} run",
                       f"'asyncsgd hogwild --resume {run}'")
        assert res.returncode == 2


@pytest.mark.parametrize("command, flag, says, never", [
    ("hogwild", "--seed", ["process r seeds torch with seed + r"], []),
    ("single", "--seed", ["initial weights, the data order"], ["process r", "seed + r"]),
    ("ddp", "--seed", ["rank r seeds torch with seed + r"], ["process r"]),
    ("ps-server", "--seed", ["initial weights", "split the training data with seed 0"],
     ["seed + r"]),
    ("worker", "--seed", ["data order", "The partition always uses seed 0"],
     ["the server's seed 0"]),
    ("hogwild", "--momentum", ["each process keeps its own momentum buffer"], []),
    ("single", "--momentum", ["0: plain SGD"], ["Hogwild", "process"]),
    ("ddp", "--momentum", ["0: plain SGD"], ["Hogwild", "process"]),
    ("ps-server", "--momentum", ["--optimizer momentum", "asks for momentum",
                                 "[default: 0.9;"], ["Hogwild"]),
    ("hogwild", "--threads", ["CPU cores // --procs"], ["single"]),
    ("single", "--threads", ["not busy with other work"], ["processes"]),
    ("ddp", "--threads", ["CPU cores // the ranks on this host"], ["single"]),
    ("ps-server", "--threads", ["each shard", "(--shards + 1)"], ["single", "processes"]),
    ("ps-server", "--device", ["only cpu", "worker --device cuda"], []),
    ("worker", "--device", ["computed", "copied onto it"], []),
    ("single", "--epochs", ["Passes over the training data"], ["process"]),
    ("single", "--eval-every", ["between steps"], ["beside training"]),
    ("ps-server", "--eval-every", ["shards keep serving"], ["between steps"]),
    ("worker", "--busy-poll-us", ["the shards' replies", "0: always sleep", "[default: 400"],
     ["next message"]),
    ("ps-server", "--busy-poll-us", ["next message", "0: always sleep", "[default: 400"],
     ["reply"]),
    ("ps-job", "--busy-poll-us", ["Shards poll", "workers for their shards'", "[default: 400"],
     []),
])
def test_each_commands_help_is_true_for_it(run_cli_here, command, flag, says, never):
    res = run_cli_here(command, "--help")
    assert res.returncode == 0, res.stderr
    entry = _option_entries(res.stdout)[flag]
    for text in says:
        assert text in entry, entry
    for text in never:
        assert text not in entry, entry


def test_the_cli_module_and_the_exports_do_not_import_torch(cli_env):
    """`asyncsgd --help` and option errors answer before torch is imported: the API behind
    the commands is imported only once a command runs."""
    probe = ("import sys, asyncsgd, asyncsgd.cli; asyncsgd.HogwildConfig; asyncsgd.ConfigError;"
             " print(sorted(m for m in ('torch', 'asyncsgd.api', 'asyncsgd.ps') "
             "if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], env=cli_env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


LAMBDA_TASK = '''
import torch
import torch.nn as nn
from asyncsgd.core.tasks import Split, Task


def make_task(samples=None):
    x = torch.randn(64, 8)
    y = (x.sum(1) > 0).long()
    return Task(name="lambda-model", model_fn=lambda: nn.Linear(8, 2),
                train=Split((x[:48],), y[:48]), test=Split((x[48:],), y[48:]))
'''


@pytest.mark.parametrize("mode", ["hogwild", "ddp"])
def test_an_unpicklable_model_fn_is_one_line_and_leaves_nothing_behind(tmp_path, cli_env, mode):
    """Spawned processes receive the task by pickle: a lambda model_fn is refused before the
    run directory exists (not a 47-line traceback from the first child), and the same --out
    then takes a run."""
    (tmp_path / "lambda_task.py").write_text(LAMBDA_TASK)
    env = {**cli_env, "PYTHONPATH": os.pathsep.join([str(tmp_path), cli_env["PYTHONPATH"]])}
    out = tmp_path / "runs" / "first"
    res = subprocess.run(asyncsgd_cmd(mode, "--task", "lambda_task:make_task", "--procs", "2",
                                      "--epochs", "1", "--progress", "off", "--out", out),
                         env=env, capture_output=True, text=True, timeout=240)
    one_line_error(res, "task lambda-model cannot be sent", "lambda", "top level")
    assert not (tmp_path / "runs").exists()
    again = subprocess.run(asyncsgd_cmd(mode, "--task", "tasks_for_tests:dense_counter",
                                        "--procs", "2", "--epochs", "1", "--progress", "off",
                                        "--out", out),
                           env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr
    assert (out / "summary.json").exists()


def test_the_early_fork_server_preloads_the_module_of_hogwilds_workers():
    """The command starts the fork server before it imports torch, naming the workers'
    module itself: it must be the one ``WorkerGroup`` preloads (the target's)."""
    from asyncsgd import cli
    from asyncsgd.modes import hogwild
    from asyncsgd.run.fork_server import FROZEN, PAUSED, preload
    assert cli.HOGWILD_WORKERS == hogwild._worker.__module__
    # the server skips a preload it cannot import without a word: each must exist, and the
    # one that pauses the collector must come first, the one that freezes and resumes it
    # last (neither may be imported in this process)
    names = preload([cli.HOGWILD_WORKERS])
    assert names[0] == PAUSED and names[-1] == FROZEN
    assert all(importlib.util.find_spec(name) is not None for name in names)


def _processes_marked(mark: str) -> list:
    """Pids of the live processes whose environment holds ``mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return found


def test_a_hogwild_command_that_fails_before_its_workers_leaves_no_fork_server(tmp_path,
                                                                                cli_env):
    """The fork server the command started early (before importing torch) ends with a
    command that failed before any worker, still importing torch or not."""
    mark = f"ASYNCSGD_TEST_MARK={os.getpid()}-{time.monotonic_ns()}"
    env = {**cli_env, mark.split("=")[0]: mark.split("=")[1]}
    res = subprocess.run(asyncsgd_cmd("hogwild", "--task", "tasks_for_tests:not_a_task",
                                      "--progress", "off", "--out", tmp_path / "x",
                                      "--start-method", "forkserver"),
                         env=env, capture_output=True, text=True, timeout=120)
    one_line_error(res, "returned int")
    servers = [pid for pid in _processes_marked(mark)
               if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert servers == []  # not left importing torch (a second or more) after the command
    deadline = time.monotonic() + 5  # multiprocessing's resource tracker ends at EOF
    while (left := _processes_marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


def test_a_task_that_fails_to_load_leaves_no_run_directory(run_cli_here, tmp_path):
    res = run_cli_here("single", "--task", "tasks_for_tests:not_a_task", "--progress", "off",
                  "--out", tmp_path / "runs" / "x")
    assert res.returncode != 0
    assert not (tmp_path / "runs").exists()


def test_a_second_ctrl_c_stops_single_inside_a_long_step(cli_env, tmp_path):
    """The first Ctrl-C lets the step finish (a consistent checkpoint); a second one stops
    a step that takes long (here 20 s) at once, and the run is still saved."""
    out = tmp_path / "run"
    env = {**cli_env, "ASYNCSGD_TEST_STEP_SLEEP": "20"}
    proc = subprocess.Popen(
        asyncsgd_cmd("single", "--task", "tasks_for_tests:dropout_regression", "--samples",
                     "160", "--threads", "1", "--progress", "off", "--out", out),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL)
    try:
        deadline, metrics = time.monotonic() + 120, out / "metrics.jsonl"
        # the evaluation at the start comes just before the first (20 s) step
        while time.monotonic() < deadline and not (
                metrics.exists() and '"eval"' in metrics.read_text()):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None  # the first one waits for the step
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert time.monotonic() - sent < 15, err  # not the rest of the 20 s step
    assert read_json(out / "summary.json")["status"] == "interrupted"


@pytest.mark.parametrize("mode", ["single", "hogwild"])
def test_a_target_the_metric_cannot_reach_leaves_no_run_directory(run_cli_here, tmp_path,
                                                                  mode):
    res = run_cli_here(mode, "--target", "5", "--epochs", "1", "--progress", "off",
                  "--out", tmp_path / "runs" / "x")
    one_line_error(res, "--target")
    assert not (tmp_path / "runs").exists()


def test_an_eof_error_inside_a_command_is_a_fault_not_an_interruption(run_cli_here,
                                                                     monkeypatch):
    """click turns an EOFError raised by a command into Abort, as it does Ctrl-C: a pipe
    that closed under the command (a shard that died before it listened) was reported as
    "interrupted" with the exit status of Ctrl-C. It reaches the caller as an EOFError."""
    import asyncsgd.ps

    def closed(**_):
        raise EOFError("a pipe closed")

    monkeypatch.setattr(asyncsgd.ps, "serve", closed)
    with pytest.raises(EOFError, match="a pipe closed"):
        run_cli_here("ps-server", "--task", "tasks_for_tests:dense_counter")
