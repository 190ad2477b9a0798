"""``asyncsgd ps-stats`` against real servers and sockets on 127.0.0.1: the summary, --json,
and the one-line errors for a CURVE mismatch and for a port nobody answers on."""

import json
import re
import socket
import subprocess
import time

import zmq

from asyncsgd.analysis.ps_stats import staleness_line
from conftest import CurveServer, asyncsgd_cmd, finish, free_port, one_line_error, wait_for, worker

TASK = ["--task", "tasks_for_tests:dense_pair", "--samples", 160]  # one worker: 20 pushes
NEED_KEYS = ("requires CURVE keys: pass --curve-server-key FILE and --curve-secret FILE "
             "(asyncsgd keygen writes them)")


def _summary(run_cli, address, *flags):
    res = run_cli("ps-stats", "--server", address, *flags, timeout=60)
    assert res.returncode == 0 and not res.stderr, res.stderr
    return res.stdout.splitlines()


def test_ps_stats_summarises_what_one_worker_did(server, cli_env, run_cli):
    """Before any worker: nothing counted. After one worker's 20 pushes to each of 2 shards
    (each pull right after its push: staleness 0): 40 updates, all of staleness 0."""
    srv = server(*TASK, "--shards", 2, "--no-exit-when-done")
    wait_for(lambda: len(srv.stats()["shard_stats"]) == 2, 30, "the evaluator's first read")
    ports = ", ".join(map(str, srv.stats()["shard_ports"]))
    fixed = [f"server       {srv.address} (no CURVE: unauthenticated)",
             "task         tasks_for_tests:dense_pair",
             f"consistency  async, 2 shards (ports {ports})"]
    refusals = ["refused      0 connections at the ZeroMQ/CURVE handshake, 0 workers with "
                "another model or data",
                "errors       0 requests rejected, 0 duplicate pushes (re-sent, not applied "
                "twice)"]
    before = _summary(run_cli, srv.address)
    assert before[:3] == fixed and before[4:] == [
        "workers      0 joined, 0 live, 0 left", "staleness    no pushes yet", *refusals]
    assert re.fullmatch(r"updates      0 applied \(shard 0: 0, shard 1: 0\), 0 pushes, "
                        r"\d+ pulls received", before[3]), before[3]  # the evaluator pulls

    (code, out, err), = finish([worker(cli_env, srv.address, 0, 1, *TASK, "--epochs", 1)])
    assert code == 0 and "20 steps, 20 pushes" in out, err
    wait_for(lambda: srv.stats()["updates"] == 40, 30, "the evaluator's next read of the shards")
    after = _summary(run_cli, srv.address)
    name, = srv.stats()["joined"]
    assert len(after) == 9 and after[:3] == fixed and after[6:] == [
        "staleness    p50 0, p99 0, max 0 (versions behind, over 40 pushes)", *refusals]
    assert re.fullmatch(r"updates      40 applied \(shard 0: 20, shard 1: 20\), 40 pushes, "
                        r"\d+ pulls received", after[3]), after[3]
    assert after[4] == "workers      1 joined, 0 live, 1 left"
    assert re.fullmatch(rf"  {re.escape(name)} +20 pushes, left, last seen [\d.]+ s ago",
                        after[5]), after[5]

    res = run_cli("ps-stats", "--server", srv.address, "--json", timeout=60)
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert res.stdout == json.dumps(stats, indent=2, sort_keys=True) + "\n"
    assert {"updates", "staleness", "live", "joined", "left", "workers", "transport",
            "shard_stats", "refused_connections", "authenticated"} <= stats.keys()
    assert stats["updates"] == 40 and stats["staleness"] == [40] + [0] * 63
    assert stats["workers"][name]["pushes"] == 20 and stats["live"] == []


def test_staleness_percentiles_come_from_the_histogram():
    """Bucket i counts pushes i versions behind; the last bucket holds 63 and more."""
    assert staleness_line([5, 3, 0, 2]) == ("p50 0, p99 3, max 3 (versions behind, over "
                                            "10 pushes)")
    capped = [0] * 64
    capped[1], capped[63] = 98, 2
    assert staleness_line(capped) == "p50 1, p99 >=63, max >=63 (versions behind, over 100 pushes)"
    assert staleness_line([0] * 64) == "no pushes yet"


def test_ps_stats_against_a_curve_server_names_what_is_wrong(keys, cli_env, tmp_path):
    """No keys: the server's mechanism mismatch, at once. An unknown client key and the
    wrong server key each get their own fix. The right keys: the summary."""
    ours, stranger = keys
    srv = CurveServer(cli_env, tmp_path / "run", ours, *TASK)
    try:
        secret = ours / "clients" / "worker-0.key_secret"
        cases = {  # flags -> what the one line says
            (): f"{srv.address} {NEED_KEYS}",
            ("--curve-server-key", ours / "server.key",
             "--curve-secret", stranger / "clients" / "worker-0.key_secret"):
                "refused this client's CURVE key",
            ("--curve-server-key", stranger / "server.key", "--curve-secret", secret):
                "--curve-server-key is probably not this server's public key",
        }
        started = time.monotonic()
        procs = [subprocess.Popen(asyncsgd_cmd("ps-stats", "--server", srv.address,
                                               "--timeout", 30, *flags),
                                  env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, stdin=subprocess.DEVNULL) for flags in cases]
        for (code, out, err), fragment in zip(finish(procs, timeout=60), cases.values()):
            one_line_error(subprocess.CompletedProcess([], code, out, err), fragment)
            assert code == 2 and not out
        # None waited for its 30 s timeout: the wrong server key is told after 10 failed
        # handshakes (1.2 s measured), the others at the first; the rest is start-up.
        assert time.monotonic() - started < 20, "the errors waited for the timeout"

        res = subprocess.run(asyncsgd_cmd("ps-stats", "--server", srv.address,
                                          "--curve-server-key", ours / "server.key",
                                          "--curve-secret", secret),
                             env=cli_env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert lines[0] == f"server       {srv.address} (CURVE: authenticated, encrypted)"
        refused = int(re.search(r"^refused +(\d+) connections", res.stdout, re.M).group(1))
        assert refused >= 3  # each refused ps-stats above was counted
    finally:
        srv.close()


def test_ps_stats_with_keys_to_a_plain_zeromq_server_says_it_has_no_curve(keys, run_cli):
    ours, _ = keys
    ctx = zmq.Context()
    plain = ctx.socket(zmq.ROUTER)  # a real ZeroMQ server without CURVE
    port = plain.bind_to_random_port("tcp://127.0.0.1")
    try:
        res = run_cli("ps-stats", "--server", f"tcp://127.0.0.1:{port}",
                      "--curve-server-key", ours / "server.key",
                      "--curve-secret", ours / "clients" / "worker-0.key_secret", timeout=60)
        one_line_error(res, f"tcp://127.0.0.1:{port} does not use CURVE: drop "
                            "--curve-server-key and --curve-secret")
    finally:
        plain.close(0)
        ctx.term()


def test_ps_stats_where_nobody_answers_is_one_line(run_cli):
    closed = f"tcp://127.0.0.1:{free_port()}"
    res = run_cli("ps-stats", "--server", closed, "--timeout", 1, timeout=60)
    one_line_error(res, f"no answer from {closed} within 1 s: nothing accepted a connection; "
                        "is 'asyncsgd ps-server' running there?")
    assert res.returncode == 1
    with socket.socket() as listener:  # accepts TCP, never speaks ZeroMQ
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        silent = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        res = run_cli("ps-stats", "--server", silent, "--timeout", 1, timeout=60)
    one_line_error(res, f"no answer from {silent} within 1 s: it accepted a TCP connection but "
                        "never completed the ZeroMQ handshake")


def test_ps_stats_help_shows_examples(run_cli_here):
    res = run_cli_here("ps-stats", "--help")
    assert res.returncode == 0
    assert "--json | jq .updates" in res.stdout and "--curve-server-key keys/server.key" \
        in res.stdout
