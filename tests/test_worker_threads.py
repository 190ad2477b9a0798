"""A worker's default --threads on hosts staged in network namespaces (friction 1): the
staged hosts share this machine's cores, so each worker counts every --world worker and the
server's shards, as beside a server on its own host."""

import subprocess
import sys

import pytest

from asyncsgd.config import WorkerConfig
from asyncsgd.run.namespaces import in_staged_host
from asyncsgd.workers.worker import local_processes
from netns import Hosts, can_make_namespaces


@pytest.fixture
def no_launcher(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)


def test_a_staged_worker_shares_the_cores_with_every_worker_and_shard(no_launcher):
    cfg = WorkerConfig()
    assert local_processes(cfg, 2, server_local=False, shards=1) == (1, 0), "another host"
    assert local_processes(cfg, 2, server_local=True, shards=1) == (2, 1)
    assert local_processes(cfg, 2, server_local=False, shards=1, staged=True) == (2, 1)
    told = WorkerConfig(local_workers=1)
    assert local_processes(told, 2, server_local=False, shards=1, staged=True) == (1, 1)


@pytest.mark.processes  # one namespace, one interpreter in it
def test_a_process_knows_it_runs_in_a_staged_host():
    ok, why = can_make_namespaces()
    if not ok:
        pytest.skip(why)
    assert not in_staged_host()
    probe = "from asyncsgd.run.namespaces import in_staged_host; print(in_staged_host())"
    with Hosts(["a"]) as hosts:
        said = hosts.run("a", [sys.executable, "-c", probe], capture_output=True, text=True)
    assert (said.returncode, said.stdout.strip()) == (0, "True"), said.stderr
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          text=True).stdout.strip() == "False"
