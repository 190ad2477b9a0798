"""CURVE authentication with real processes and sockets: keygen, the refusal matrix, warnings."""

import time

import pytest
import torch
import zmq

from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import BYE, HELLO, PUSH, WELCOME, Message, Segment, encode
from asyncsgd.wire.security import ClientKeys, Gatekeeper, curve_problem
from conftest import CurveServer, finish, free_port, read_json, worker
from faults import record_figure
from tasks_for_tests import index_counter

ROWS = 96  # one worker, batch 8: 12 pushes an epoch


def test_keygen_writes_zmq_certificates_with_private_secrets(keys, run_cli):
    ours, _ = keys
    assert (ours / "server.key_secret").stat().st_mode & 0o777 == 0o600
    assert (ours / "clients" / "worker-0.key_secret").stat().st_mode & 0o777 == 0o600
    public, secret = zmq.auth.load_certificate(ours / "allowed_clients" / "worker-0.key")
    assert len(public) == 40 and secret is None
    # Adding a worker keeps the server key; repeating a name is refused.
    before = (ours / "server.key_secret").read_bytes()
    assert run_cli("keygen", ours, "--name", "late").returncode == 0
    assert (ours / "server.key_secret").read_bytes() == before
    again = run_cli("keygen", ours, "--name", "late")
    assert again.returncode == 2 and "exists" in again.stderr


def test_curve_matrix_admits_only_the_right_key(keys, cli_env, tmp_path, run_cli):
    ours, stranger = keys
    # Two workers count: the probe below (which leaves at once) and the good one.
    srv = CurveServer(cli_env, tmp_path / "run", ours, "--task", "tasks_for_tests:index_counter",
                      "--samples", ROWS, "--workers", 2)
    try:
        signature = Layout.of(index_counter(ROWS).build_model(0)).signature()
        welcome = srv.request(encode(Message(type=HELLO, worker="probe", seq=1,
                                             meta={"signature": signature})))
        assert welcome.type == WELCOME
        assert srv.request(encode(Message(type=BYE, worker="probe", seq=2))).type == BYE
        shard_port = welcome.meta["shards"][0]["port"]
        task = ["--task", "tasks_for_tests:index_counter", "--samples", ROWS]
        refused = {
            "no key": ([], "requires CURVE"),
            "wrong server key": (["--curve-server-key", stranger / "server.key",
                                  "--curve-secret", ours / "clients" / "worker-0.key_secret"],
                                 "not this server's public key"),
            "unknown client key": (["--curve-server-key", ours / "server.key",
                                    "--curve-secret", stranger / "clients" / "worker-0.key_secret"],
                                   "refused this worker's key"),
        }
        refusal_seconds = []
        for case, (flags, fragment) in refused.items():
            started = time.monotonic()
            res = run_cli("worker", "--server", srv.address, *task, "--progress", "off",
                          "--server-timeout", 30, *flags, timeout=90)
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 2, (case, res.stderr)
            assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], \
                (case, res.stderr)
            refusal_seconds.append(time.monotonic() - started)  # the worker's whole run
            assert refusal_seconds[-1] < 25, case  # refused at once, not timed out
        # The same peers talking straight to the shard get nothing through.
        for case, curve in {"no key": None,
                            "wrong server key": ClientKeys.load(
                                stranger / "server.key", ours / "clients" / "worker-0.key_secret"),
                            "unknown client key": ClientKeys.load(
                                ours / "server.key", stranger / "clients" / "worker-0.key_secret")
                            }.items():
            sock = srv.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve:
                curve.apply(sock)
            sock.connect(f"tcp://127.0.0.1:{shard_port}")
            for seq in range(1, 6):
                sock.send_multipart(encode(Message(
                    type=PUSH, worker="intruder", incarnation=1, seq=seq, shard=0,
                    segments=[Segment(0, torch.full((ROWS,), 100.0))])))
            assert not sock.poll(1500), case
            sock.close()
        stats = srv.stats()
        front, shard = stats["transport"][0], stats["transport"][1]
        assert stats["authenticated"] is True
        assert front["refused_unknown_key"] >= 1 and shard["refused_unknown_key"] >= 1
        assert front["refused"] >= 3 and shard["refused"] >= 3, stats["transport"]
        assert stats["updates"] == 0 and stats["joined"] == ["probe"]

        good = worker(cli_env, srv.address, 0, 1, *task, "--epochs", 2,
                      "--curve-server-key", ours / "server.key",
                      "--curve-secret", ours / "clients" / "worker-0.key_secret")
        (code, out, err), = finish([good])
        assert code == 0, err
        assert srv.wait()[0] == 0
    finally:
        srv.close()
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["updates"] == 2 * 12 and summary["refused_connections"] >= 6
    weight = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"]["weight.weight"]
    assert torch.equal(weight, torch.full((ROWS, 1), -2.0))  # no intruder's 100 anywhere
    record_figure("CURVE matrix", refused_workers=3, refused_direct_peers=3,
                  refused_connections=summary["refused_connections"],
                  worker_exit_on_refusal_s=round(max(refusal_seconds), 1),
                  updates_from_refused_peers=0)


def _serve_briefly(run_cli, tmp_path, bind, *extra):
    return run_cli("ps-server", "--bind", bind, "--max-seconds", 0.5, "--out", tmp_path / "run",
                   "--progress", "off", *extra, timeout=120)


def test_plain_server_beyond_loopback_warns_loudly(run_cli, tmp_path, keys):
    res = _serve_briefly(run_cli, tmp_path, f"tcp://0.0.0.0:{free_port()}")
    assert res.returncode == 0, res.stderr
    assert "WITHOUT authentication" in res.stderr and "asyncsgd keygen" in res.stderr
    quiet = _serve_briefly(run_cli, tmp_path / "b", f"tcp://127.0.0.1:{free_port()}")
    assert quiet.returncode == 0 and "WITHOUT" not in quiet.stderr
    ours, _ = keys
    curve = _serve_briefly(run_cli, tmp_path / "c", f"tcp://0.0.0.0:{free_port()}",
                           "--curve-secret", ours / "server.key_secret",
                           "--allowed-clients", ours / "allowed_clients")
    assert curve.returncode == 0 and "WITHOUT" not in curve.stderr, curve.stderr


@pytest.mark.parametrize("flags, fragment", [
    (["--curve-secret", "{k}/server.key_secret"], "go together"),
    (["--curve-secret", "{k}/missing", "--allowed-clients", "{k}/allowed_clients"],
     "no such file"),
    (["--curve-secret", "{k}/server.key", "--allowed-clients", "{k}/allowed_clients"],
     "holds no secret key"),
    (["--curve-secret", "{k}/server.key_secret", "--allowed-clients", "{k}/clients"],
     "holds no *.key public keys"),
])
def test_bad_key_flags_are_one_clear_line(run_cli_here, tmp_path, keys, flags, fragment):
    flags = [f.format(k=keys[0]) for f in flags]
    res = run_cli_here("ps-server", *flags, "--out", tmp_path / "run")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and fragment in lines[0], res.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_old_or_curveless_libzmq_is_refused_with_the_reason():
    assert curve_problem((4, 3, 5), True) == ""
    assert "CVE-2020-15166" in curve_problem((4, 3, 2), True)
    assert "without CURVE" in curve_problem((4, 3, 5), False)
    assert curve_problem() == ""  # this machine's libzmq is fine


def test_a_gatekeeper_watching_nothing_yet_does_not_spin():
    """Between its start and the first ``watch`` (a bind in between), the gatekeeper's
    thread has nothing to poll; an empty zmq Poller returns at once, so polling it would
    spin, holding the GIL: it waits instead. A spinning thread would take ~1 s of CPU in
    this second (0.25 s even beside 8 busy processes on 2 cores)."""
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, None)
    try:
        start = time.process_time()
        time.sleep(1.0)
        used = time.process_time() - start
    finally:
        gate.close()
        ctx.term()
    assert used < 0.05, f"{used:.3f} s of CPU in 1 s with nothing to watch"
