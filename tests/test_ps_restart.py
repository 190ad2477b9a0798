"""A parameter server killed whole (SIGKILL to its process group) while workers train, then
started again with --resume on the same address: the workers rejoin it and finish. Not
started again: they give up after --server-timeout, backing off meanwhile.

``tasks_for_tests:dense_pair`` over two shards, SGD lr 1: each shard owns one weight, and
every push it applies subtracts the batch size (8). Its final weight is exactly
-8 x (pushes - its lost updates): the acknowledged updates its restored checkpoint
missed, which the resumed shard reports.
"""

import shutil
import signal
import socket
import time

import psutil
import pytest

from asyncsgd.run.checkpoint import load_checkpoint
from conftest import (CurveServer, Server, assert_no_shm_leak, finish, periodic_checkpoint,
                      read_json, shard_stats, shm_entries, signal_group, stop_tree, wait_for,
                      worker)
from faults import record_figure

TASK = "tasks_for_tests:dense_pair"
ROWS, EPOCHS, BATCH = 2000, 12, 8
PUSHES = ROWS // 2 // BATCH * EPOCHS  # per worker: two workers, a half of the rows each


def occupy(ports: list) -> list:
    """Listening sockets on ``ports``, as if another program took them meanwhile."""
    socks = []
    for port in ports:
        sock = socket.socket()
        # The killed shards' connections may linger in TIME_WAIT; a listener still can't.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
        socks.append(sock)
    return socks


def _keys(run_cli, tmp_path):
    res = run_cli("keygen", tmp_path / "keys", "--clients", 2, timeout=60)
    assert res.returncode == 0, res.stderr
    return tmp_path / "keys"


# Each of the three choices is independent of the others in the code (the shards' ports, the
# sockets' keys, the workers' transport): two runs take every value of each, where four
# took one change from a baseline each.
@pytest.mark.parametrize("ports,curve,transport", [
    ("free", True, "shared"), ("taken", False, "tcp")])
def test_workers_rejoin_a_server_killed_whole_and_resumed(cli_env, run_cli, tmp_path, ports,
                                                          curve, transport):
    """With CURVE on, the fresh front and shard sockets of a rejoin carry the keys too;
    through shared memory, the resumed shards make new areas and the workers attach again."""
    out = tmp_path / "run"
    keys = _keys(run_cli, tmp_path) if curve else None

    def start(*args, **kw):
        return CurveServer(cli_env, out, keys, *args, **kw) if curve else \
            Server(cli_env, out, *args, **kw)

    def worker_keys(rank):
        return ["--curve-server-key", keys / "server.key", "--curve-secret",
                keys / "clients" / f"worker-{rank}.key_secret"] if curve else []

    shm_before = shm_entries()
    first = start("--task", TASK, "--samples", ROWS, "--shards", 2, "--workers", 2,
                  "--checkpoint-every", 0.5, own_group=True)
    resumed, blockers, procs = None, [], []
    try:
        old_ports = first.stats()["shard_ports"]
        procs = [worker(cli_env, first.address, r, 2, "--task", TASK, "--samples", ROWS,
                        "--epochs", EPOCHS, "--heartbeat", 0.2, "--transport", transport,
                        *worker_keys(r))
                 for r in range(2)]

        def both_trained():  # each worker past its handshake and 100 pushes
            train = shard_stats(first, old_ports[1]).get("train", {})
            return len(train) == 2 and min(steps for _, steps, _ in train.values()) >= 100

        wait_for(lambda: all(periodic_checkpoint(out, i) for i in range(2)) and
                 both_trained(),
                 120, "checkpoints and 100 pushes of each worker")
        stop_tree(first.proc, signal_group(signal.SIGKILL))  # asserts no shard outlives it
        # Its resource tracker died with it: nothing of it may be left in /dev/shm for one.
        assert_no_shm_leak(shm_before)
        killed = [load_checkpoint(shutil.copy(out / f"shard-{i}.pt", tmp_path / f"killed-{i}.pt"))
                  ["shard"]["version"] for i in range(2)]
        assert all(p.poll() is None for p in procs)  # still waiting for their server
        if ports == "taken":
            blockers = occupy(old_ports)
        resumed = start("--resume", out, port=first.port, own_group=True)
        front = resumed.stats()
        new_ports = front["shard_ports"]
        restored = [shard_stats(resumed, p)["restored"]["version"] for p in new_ports]
        shards = psutil.Process(resumed.proc.pid).children(recursive=True)
        results = finish(procs, timeout=120)
        code, _, err = resumed.wait()
        assert code == 0, err
        gone, alive = psutil.wait_procs(shards, timeout=10)
        assert not alive, f"orphans left: {alive}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for sock in blockers:
            sock.close()
        for srv in (first, resumed):
            if srv is not None:
                srv.close()

    for code, out_text, err_text in results:
        assert code == 0, err_text
        assert f"{PUSHES} steps, {PUSHES} pushes" in out_text, out_text
        assert err_text.count("rejoined the restarted server") == 1, err_text
        assert "Traceback" not in err_text
    assert restored == killed  # each shard came back from the checkpoint it had at the kill
    assert front["authenticated"] is curve
    if ports == "free":
        assert new_ports == old_ports  # the resumed shards listen where they did
    else:
        assert all(a != b for a, b in zip(new_ports, old_ports))
        assert all(f"(were {old_ports})" in err_text for _, _, err_text in results)

    summary = read_json(out / "summary.json")
    weights = load_checkpoint(out / "checkpoint.pt")["model"]["w"]
    lost = [load_checkpoint(out / f"shard-{i}.pt")["shard"]["counters"]["lost_updates"]
            for i in range(2)]
    assert summary["lost_updates"] == sum(lost)
    assert summary["updates"] == 2 * (2 * PUSHES) - sum(lost)
    for i in range(2):
        # Every push applied once: none twice through the re-sends, none lost unreported.
        assert weights[i].item() == -BATCH * (2 * PUSHES - lost[i]), (i, lost)
        assert 0 <= lost[i] <= 2 * PUSHES - killed[i]
    record_figure(f"whole server SIGKILL + --resume (shard ports {ports}"
                  f"{', CURVE' if curve else ''})",
                  lost_updates=lost, checkpoint_versions=killed)


def test_worker_gives_up_on_a_server_killed_for_good(cli_env, tmp_path):
    srv = Server(cli_env, tmp_path / "run", "--task", TASK, "--samples", ROWS, "--shards", 2,
                 own_group=True)
    proc = None
    try:
        ports = srv.stats()["shard_ports"]
        proc = worker(cli_env, srv.address, 0, 1, "--task", TASK, "--samples", ROWS,
                      "--epochs", 1000, "--heartbeat", 0.2, "--server-timeout", 4)
        wait_for(lambda: shard_stats(srv, ports[0])["version"] >= 50, 60, "50 updates")
        killed = time.monotonic()
        stop_tree(srv.proc, signal_group(signal.SIGKILL))
        (code, _, err), = finish([proc], timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        srv.close()
    assert code == 1, err
    *earlier, last = err.strip().splitlines()
    assert last.startswith("error: shard(s) [") and "silent for 4 s; giving up" in last, err
    waits = [float(line.split("retrying in ")[1].split(" s")[0]) for line in earlier
             if line.startswith("asyncsgd.workers.client: server unavailable")]
    assert waits[:2] == [0.2, 0.4] and waits == sorted(waits), waits  # exponential backoff
    # Not before --server-timeout of silence (it began at the kill); the rest is the worker's
    # exit on a maybe loaded machine.
    assert 3.9 <= took < 4 + 10, took


@pytest.mark.parametrize("restarted_with, message", [
    (["--task", TASK, "--samples", ROWS, "--shards", 1],
     "restarted with shard ranges [(0, 2)], but this worker joined it with [(0, 1), (1, 2)]"),
    (["--task", "tasks_for_tests:dense_counter", "--samples", ROWS],
     "refused this worker's rejoin: this server trains task tasks_for_tests:dense_counter: "
     "w has shape [2] on the worker but [1] on the server"),
])
def test_workers_refuse_a_server_restarted_with_another_layout_or_model(cli_env, tmp_path,
                                                                        restarted_with, message):
    """A server killed whole and started afresh on the same address with other --shards, or
    another model: its welcome (or its refusal) ends the worker with one clear error."""
    first = Server(cli_env, tmp_path / "first", "--task", TASK, "--samples", ROWS,
                   "--shards", 2, own_group=True)
    other, proc = None, None
    try:
        ports = first.stats()["shard_ports"]
        proc = worker(cli_env, first.address, 0, 1, "--task", TASK, "--samples", ROWS,
                      "--epochs", 1000, "--heartbeat", 0.2, "--server-timeout", 60)
        wait_for(lambda: shard_stats(first, ports[0])["version"] >= 20, 60, "20 updates")
        stop_tree(first.proc, signal_group(signal.SIGKILL))
        other = Server(cli_env, tmp_path / "other", *restarted_with, port=first.port,
                       own_group=True)
        (code, _, err), = finish([proc], timeout=120)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for srv in (first, other):
            if srv is not None:
                srv.close()
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, err
    assert "Traceback" not in err
