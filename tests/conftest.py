"""Shared helpers: run the installed CLI as a subprocess and read what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

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
