"""The parameter server across hosts: server and workers in separate network namespaces.

Each "host" is a network namespace with its own address on a bridge (tests/netns.py);
nothing crosses but TCP between 10.213.x.y addresses. Skipped, saying why, where
namespaces cannot be made (not root, no iproute2).
"""

import pytest

from conftest import asyncsgd_cmd, read_json
from netns import Hosts, can_make_namespaces, list_namespaces

_OK, _WHY = can_make_namespaces()
if not _OK:
    pytest.skip(f"network namespaces unavailable: {_WHY}", allow_module_level=True)


def test_two_workers_on_other_hosts_train_through_the_server(tmp_path, cli_env):
    with Hosts(["server", "worker0", "worker1"], subnet="10.213.9") as hosts:
        address = f"tcp://{hosts.address('server')}:5555"
        server = hosts.popen("server", asyncsgd_cmd(
            "ps-server", "--task", "mnist1d-cnn", "--shards", 2, "--bind", address,
            "--workers", 2, "--out", tmp_path / "run", "--progress", "off", "--eval-every", 0.5),
            env=cli_env, stdout=-1, stderr=-1, text=True)
        # Another host shares no memory: insisting on it is a clear error, before any hello.
        insists = hosts.popen("worker0", asyncsgd_cmd(
            "worker", "--server", address, "--transport", "shared", "--threads", 1,
            "--progress", "off"), env=cli_env, stdout=-1, stderr=-1, text=True)
        _, err = insists.communicate(timeout=120)
        assert insists.returncode != 0 and "is not an address of this host" in err, err
        workers = [hosts.popen(f"worker{r}", asyncsgd_cmd(
            "worker", "--server", address, "--rank", r, "--world", 2, "--epochs", 8,
            "--threads", 1, "--progress", "off", "--server-timeout", 60),
            env=cli_env, stdout=-1, stderr=-1, text=True) for r in range(2)]
        try:
            for w in workers:
                out, err = w.communicate(timeout=180)
                assert w.returncode == 0, err
                assert "504 steps" in out  # 2000 samples a worker, batch 32: 63 steps x 8 epochs
            out, err = server.communicate(timeout=60)
            assert server.returncode == 0, err
        finally:
            for p in [server, *workers]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        ours = {hosts.switch_ns, *hosts.namespaces.values()}
        assert ours <= set(list_namespaces())
    assert not ours & set(list_namespaces()), "the hosts' namespaces outlived the test"
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["stopped_by"] == "workers_done"
    assert len(summary["workers_joined"]) == 2
    assert summary["final_metric"] > 0.3  # chance is 0.1
    assert summary["updates"] == 2 * 2 * 504  # every push reached both shards
