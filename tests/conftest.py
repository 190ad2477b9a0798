"""Shared helpers: run the installed CLI as a subprocess and read what it wrote."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

TESTS = Path(__file__).parent
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture
def cli_env(cache_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["ASYNCSGD_CACHE"] = str(cache_dir)
    return env


def asyncsgd_cmd(*args):
    exe = BIN / "asyncsgd"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "asyncsgd"]
    return base + [str(a) for a in args]


@pytest.fixture
def run_cli(cli_env):
    def run(*args, timeout=240, **kw):
        return subprocess.run(asyncsgd_cmd(*args), env=cli_env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    return run


def read_events(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def start_training(cmd, out, env, wait=120):
    """Start a training command in its own session; return it once it has trained a step."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        if (out / "metrics.jsonl").exists() and any(
                e["event"] == "train" for e in read_events(out)):
            return proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    pytest.fail("training never started")


def signal_group(sig):
    """An ``act`` for ``stop_tree``: ``sig`` to the whole process group, as a terminal's
    Ctrl-C reaches it."""
    return lambda proc, children: os.killpg(proc.pid, sig)


def signal_parent(sig):
    """An ``act`` for ``stop_tree``: ``sig`` to the parent only, as ``kill`` sends it."""
    return lambda proc, children: proc.send_signal(sig)


def stop_tree(proc, act, timeout=60, orphan_wait=10):
    """Do ``act(proc, descendants)`` to a running process tree (started by
    ``start_training``) and wait for the parent to exit; the group is SIGKILLed if it does
    not. Asserts no descendant outlives it. Returns (stdout, stderr, seconds from the act
    to the exit, descendants)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        act(proc, children)
        acted = time.monotonic()
        stdout, stderr = proc.communicate(timeout=timeout)
        took = time.monotonic() - acted
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=orphan_wait)
    assert not alive, f"orphans left: {alive}"
    return stdout, stderr, took, children
