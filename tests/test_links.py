"""Shaped links (``--link RATE``): hosts in network namespaces whose links a tbf qdisc limits.

Real namespaces, veth pairs, qdiscs, sockets and processes. Tests that make namespaces
skip, saying why, where they cannot be made (not root, no iproute2, no tbf); the refusal
itself is checked as an unprivileged user (``setpriv``) where root can become one.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from asyncsgd.errors import ConfigError
from asyncsgd.run.link import Link, parse_rate
from conftest import TESTS, asyncsgd_cmd, marked_processes, read_json
from netns import Hosts, can_shape_links, list_namespaces

OK, WHY = can_shape_links()
needs_namespaces = pytest.mark.skipif(not OK, reason=f"shaped links unavailable: {WHY}")

# The receiver counts bytes from 0.3 s after the first one (past tbf's burst and TCP's slow
# start) to the last; it prints bits of payload per second.
RECEIVE = r"""
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 7000)); srv.listen(1); srv.settimeout(30)
print("ready", flush=True)
conn, _ = srv.accept(); conn.settimeout(30)
buf = bytearray(1 << 20); total = 0; first = None; mark = None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    now = time.monotonic(); total += n
    first = first or now
    if mark is None and now - first >= 0.3:
        mark = (now, total)
print((total - mark[1]) * 8 / (now - mark[0]), flush=True)
"""
SEND = r"""
import socket, sys, time
conn = socket.create_connection((sys.argv[1], 7000), timeout=30)
data = b"x" * (1 << 20); end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    conn.sendall(data)
conn.close()
"""
SECONDS = 2.5
# tbf counts whole frames: TCP's payload is 1448 of each 1514-byte frame, 95.6% of the rate.
PAYLOAD = 1448 / 1514


def _duplex(hosts, a, b):
    """Bits of payload per second a -> b and b -> a, both sending at once for SECONDS."""
    receivers = {dst: hosts.popen(dst, [sys.executable, "-c", RECEIVE, hosts.address(dst)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for dst in (a, b)}
    for proc in receivers.values():
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=10)
    senders = [hosts.popen(src, [sys.executable, "-c", SEND, hosts.address(dst), SECONDS],
                           stderr=subprocess.PIPE, text=True) for src, dst in ((a, b), (b, a))]
    for proc in senders:
        _, err = proc.communicate(timeout=SECONDS + 30)
        assert proc.returncode == 0, err
    rates = {}
    for dst, proc in receivers.items():
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        rates[f"{b if dst == a else a}->{dst}"] = float(out)
    return rates


@pytest.mark.processes
@needs_namespaces
@pytest.mark.parametrize("rate", ["100mbit", "20mbit"])
def test_the_link_is_shaped_to_its_rate_both_ways(rate):
    """Measured here (2 cores, load ~2.5): 100mbit gave 95.6 Mbit/s of payload each way at
    once, 20mbit 19.1: 95.6% of the rate, as frame overhead predicts."""
    link = Link.parse(rate)
    with Hosts(["a", "b"], subnet="10.213.11", link=link) as hosts:
        measured = _duplex(hosts, "a", "b")
        traffic = hosts.traffic()
        ours = {hosts.switch_ns, *hosts.namespaces.values()}
    print(f"{rate}: " + ", ".join(f"{k} {v / 1e6:.1f} Mbit/s" for k, v in measured.items()))
    for direction, bps in measured.items():
        assert abs(bps / link.bits_per_second - 1) <= 0.2, (direction, bps)
        assert abs(bps / (link.bits_per_second * PAYLOAD) - 1) <= 0.2, (direction, bps)
    # Both qdiscs of each host's link carried the stream: its eth0 out, its switch port in.
    expected = link.bits_per_second / 8 * SECONDS * 0.7
    for host in ("a", "b"):
        assert traffic[host]["sent"] > expected and traffic[host]["received"] > expected
    assert not ours & set(list_namespaces()), "namespaces outlived the test"


def test_rates_parse_and_bad_ones_say_what_is_accepted():
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1gbit") == 1e9 and parse_rate("2.5Gbit") == 2.5e9
    assert parse_rate("500kbit") == 500e3
    assert Link.parse(None) is None
    assert Link.parse("100mbit").tbf() == ["tbf", "rate", "100000000bit", "burst", "16384",
                                          "latency", "10ms"]
    assert Link.parse("1gbit").burst == 125_000  # 1 ms of the rate above 16 KiB
    for bad, says in [("100", "write a number and kbit, mbit or gbit"),
                      ("100mbps", "bytes per second"), ("fast", "100mbit, 1gbit"),
                      ("10kbit", "outside 100kbit..100gbit")]:
        with pytest.raises(ConfigError, match=says):
            parse_rate(bad)


def test_a_bad_rate_is_one_line(run_cli_here, tmp_path):
    res = run_cli_here("compare", "--link", "100mbps", "--out", tmp_path / "cmp")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "mbit for megabits" in lines[0], res.stderr
    assert not (tmp_path / "cmp").exists()


def _as_nobody():
    """argv prefix running a command as uid/gid 65534 (no capabilities), or skip."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run a command as an unprivileged user")
    return [setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups"]


@pytest.mark.processes
def test_without_root_link_is_refused_in_one_line(tmp_path):
    as_nobody = _as_nobody()
    probe = subprocess.run(as_nobody + [sys.executable, "-c", "import asyncsgd"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"uid 65534 cannot run this interpreter: {probe.stderr.strip()[-200:]}")
    out = tmp_path / "cmp"
    for args, who in [(["compare", "--link", "100mbit", "--modes", "ps-async,ddp", "--out",
                        out], "--link"),
                      (["hosts", "up", "a", "b", "--link", "100mbit"], "asyncsgd hosts up")]:
        res = subprocess.run(as_nobody + [sys.executable, "-m", "asyncsgd", *args],
                             capture_output=True, text=True, timeout=120, cwd="/",
                             stdin=subprocess.DEVNULL)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, res.stderr
        assert lines[0].startswith(f"error: {who} needs root to create network namespaces "
                                   "(running as uid 65534); run as root"), lines[0]
    assert not out.exists()  # refused before anything was written


# ---- compare --link -------------------------------------------------------------------------

@pytest.mark.processes
@needs_namespaces
def test_compare_runs_ps_and_ddp_across_shaped_hosts(cache_dir, tmp_path):
    out, mark = tmp_path / "cmp", uuid.uuid4().hex
    env = dict(os.environ, ASYNCSGD_CACHE=str(cache_dir), ASYNCSGD_TEST_MARK=mark,
               PYTHONPATH=str(TESTS))
    started = time.monotonic()
    res = subprocess.run(asyncsgd_cmd(
        # One epoch ends each run; the budget only bounds a run on a loaded machine.
        "compare", "--link", "100mbit", "--modes", "ps-async,ddp", "--procs", 2, "--epochs", 1,
        "--budget", 60, "--batch-size", 16, "--eval-every", 0.5, "--grace", 60, "--progress", "log",
        "--out", out), env=env, capture_output=True, text=True, timeout=240,
        stdin=subprocess.DEVNULL)
    took = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    assert marked_processes(mark) == [], "processes outlived compare"
    results = read_json(out / "results.json")
    assert {r["mode"]: r["status"] for r in results["runs"]} == {"ps-async": "ok", "ddp": "ok"}
    link = results["link"]
    assert link["rate"] == "100mbit" and link["tbf"][:3] == ["tbf", "rate", "100000000bit"]
    runs = link["runs"]
    assert set(runs) == {"ps-async r1", "ddp r1"}
    assert set(runs["ps-async r1"]) == {"server", "worker0", "worker1"}
    assert set(runs["ddp r1"]) == {"rank0", "rank1"}
    # Every host sent and received over its shaped link: pushes and pulls, all-reduces.
    for label, hosts in runs.items():
        for host, seen in hosts.items():
            assert seen["sent"] > 1e6 and seen["received"] > 1e6, (label, host, seen)
            assert seen["address"].startswith("10.213.7."), seen
    # The server listened on its namespace's address, and the workers dialled it there.
    server = read_json(out / "ps-async-r1" / "config.json")["config"]
    assert server["bind"].startswith(f"tcp://{runs['ps-async r1']['server']['address']}:")
    # ddp ran one process per rank (rank 0 wrote the run), not ranks spawned by one parent.
    logs = out / "logs" / "ddp-r1"
    assert sorted(p.name for p in logs.glob("rank-*.err")) == ["rank-0.err", "rank-1.err"]
    assert read_json(out / "ddp-r1" / "config.json")["config"]["backend"] == "gloo"
    report = (out / "report.md").read_text()
    assert report.startswith("# asyncsgd compare: mnist1d-cnn, 2 processes, 100mbit links")
    assert "Links: 100mbit each way (tbf" in report and "single and hogwild" in report
    made = {h["namespace"] for hosts in runs.values() for h in hosts.values()}
    assert not made & set(list_namespaces()), "namespaces outlived compare"
    print(f"compare --link took {took:.1f} s; bytes sent: " + json.dumps(
        {label: {h: s["sent"] for h, s in hosts.items()} for label, hosts in runs.items()}))


# ---- asyncsgd hosts up / list / down ---------------------------------------------------------

@needs_namespaces
def test_hosts_up_stand_shaped_until_hosts_down(run_cli):
    from asyncsgd.run.standing_hosts import standing
    if standing():
        pytest.skip(f"hosts made by 'asyncsgd hosts up' stand already: {standing()}")
    try:
        res = run_cli("hosts", "up", "tsrv", "tw0", "--link", "50mbit", timeout=60)
        assert res.returncode == 0, res.stderr
        assert "ip netns exec asgd-tsrv" in res.stdout and "10.213.50.2" in res.stdout
        assert "ps-server --bind tcp://10.213.50.1:5555 --workers 1" in res.stdout
        assert "MASTER_ADDR=10.213.50.1" in res.stdout and "GLOO_SOCKET_IFNAME=eth0" in res.stdout
        assert {"asgd-tsrv", "asgd-tw0", "asgd-switch"} <= set(list_namespaces())
        again = run_cli("hosts", "up", "other", timeout=60)
        assert again.returncode == 2 and "hosts stand already" in again.stderr
        listed = run_cli("hosts", "list", timeout=60).stdout.splitlines()
        assert [ln.split()[:4] for ln in listed] == [
            ["tsrv", "10.213.50.1", "50", "Mbit/s"], ["tw0", "10.213.50.2", "50", "Mbit/s"]]
        # a process left running in a host is killed by down, not orphaned in a namespace
        sleeper = subprocess.Popen(["ip", "netns", "exec", "asgd-tw0", "sleep", "300"])
    finally:
        down = run_cli("hosts", "down", timeout=60)
    assert down.returncode == 0, down.stderr
    assert sleeper.wait(timeout=10) != 0
    assert "deleted asgd-tsrv, asgd-tw0, asgd-switch" in down.stdout
    assert not standing()
