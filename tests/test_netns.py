"""The tests/netns.py helper: several hosts as network namespaces on one bridge.

Skipped as a whole where namespaces cannot be made (not root, no iproute2, no veth/bridge).
All traffic stays on 10.213.x.y addresses inside namespaces created here.
"""

import selectors
import subprocess
import sys
import time

import pytest

from netns import Hosts, can_make_namespaces, ip_binary, list_namespaces

_OK, _WHY = can_make_namespaces()
if not _OK:
    pytest.skip(f"network namespaces unavailable: {_WHY}", allow_module_level=True)

TIMEOUT = 20

# Echo server: bind to argv[1] on a free port, print the port, echo one connection until EOF.
ECHO_SERVER = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0))
s.listen(1)
s.settimeout(30)
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
conn.settimeout(30)
while True:
    data = conn.recv(65536)
    if not data:
        break
    conn.sendall(data)
conn.close()
"""

# Client: connect to argv[1]:argv[2], send argv[3], half-close, print what comes back.
# Prints "REFUSED" on ECONNREFUSED.
CLIENT = r"""
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
except ConnectionRefusedError:
    print("REFUSED", flush=True)
    sys.exit(0)
c.settimeout(10)
c.sendall(sys.argv[3].encode())
c.shutdown(socket.SHUT_WR)
out = b""
while True:
    chunk = c.recv(65536)
    if not chunk:
        break
    out += chunk
print("ECHO:" + out.decode(), flush=True)
"""


def _start_echo_server(hosts, name):
    server = hosts.popen(name, [sys.executable, "-c", ECHO_SERVER, hosts.address(name)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # read the port line; poll so a dead/stuck server cannot hang the test
    deadline = time.monotonic() + TIMEOUT
    sel = selectors.DefaultSelector()
    sel.register(server.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = server.stdout.readline()
                if line.strip():
                    return server, int(line)
                break
            if server.poll() is not None:
                break
    finally:
        sel.close()
    server.kill()
    _, err = server.communicate(timeout=TIMEOUT)
    raise AssertionError(f"echo server in {name!r} did not start (rc={server.returncode}): {err}")


def _client(hosts, name, addr, port, payload="x"):
    return hosts.run(name, [sys.executable, "-c", CLIENT, addr, str(port), payload],
                     capture_output=True, text=True, timeout=TIMEOUT)


def _stop(proc):
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        try:
            proc.communicate(timeout=TIMEOUT)
        except Exception:
            pass


def test_hosts_have_distinct_addresses_and_tcp_echo_works():
    server = None
    with Hosts(["a", "b", "c"]) as hosts:
        addrs = [hosts.address(n) for n in ("a", "b", "c")]
        assert len(set(addrs)) == 3
        assert addrs == ["10.213.7.1", "10.213.7.2", "10.213.7.3"]
        # the address really is on eth0 inside each host's namespace
        for n in ("a", "b", "c"):
            out = hosts.run(n, [ip_binary(), "-o", "-4", "addr", "show", "dev", "eth0"],
                            capture_output=True, text=True, check=True).stdout
            assert f"inet {hosts.address(n)}/24" in out, out
        try:
            server, port = _start_echo_server(hosts, "a")
            payload = "hello from b " * 100
            res = _client(hosts, "b", hosts.address("a"), port, payload)
            assert res.returncode == 0, res.stderr
            assert res.stdout.strip() == "ECHO:" + payload.strip(), res.stdout[:200]
            server.wait(timeout=TIMEOUT)          # it exits after its one connection
            assert server.returncode == 0, server.stderr.read()
        finally:
            _stop(server)


def test_closed_port_is_refused_quickly_and_loopback_is_private():
    server = None
    with Hosts(["a", "b"], subnet="10.213.8") as hosts:
        try:
            # nothing listens on port 9 in a's fresh namespace: RST comes back from a's kernel
            t0 = time.monotonic()
            res = _client(hosts, "b", hosts.address("a"), 9)
            elapsed = time.monotonic() - t0
            assert res.returncode == 0, res.stderr
            assert res.stdout.strip() == "REFUSED", res.stdout
            assert elapsed < 5, f"refusal took {elapsed:.1f}s"

            # a server in a is reachable at a's address but not on b's own loopback
            server, port = _start_echo_server(hosts, "a")
            res = _client(hosts, "b", "127.0.0.1", port)
            assert res.stdout.strip() == "REFUSED", (res.stdout, res.stderr)
            res = _client(hosts, "b", hosts.address("a"), port, "still there")
            assert res.stdout.strip() == "ECHO:still there", (res.stdout, res.stderr)
        finally:
            _stop(server)


def test_namespaces_are_deleted_on_exit():
    with Hosts(["a", "b", "c"]) as hosts:
        ours = [hosts.switch_ns, *hosts.namespaces.values()]
        assert len(set(ours)) == 4
        present = set(list_namespaces())
        assert set(ours) <= present
        sleeper = hosts.popen("a", ["sleep", "300"], stdout=subprocess.DEVNULL)
    listed = subprocess.run([ip_binary(), "netns", "list"], capture_output=True, text=True,
                            timeout=TIMEOUT, check=True).stdout
    for ns in ours:
        assert ns not in listed.split(), listed
    # processes still running inside a host are killed on exit
    assert sleeper.poll() is not None


def test_failed_setup_cleans_up_and_reports_the_command():
    # make the second host's `ip addr add` fail, after the switch and host a exist
    hosts = Hosts(["a", "b"], subnet="10.213.9")
    hosts._addr["b"] = "10.213.9.999"
    with pytest.raises(RuntimeError) as info:
        with hosts:
            pass
    msg = str(info.value)
    assert "addr add 10.213.9.999/24" in msg and "stderr:" in msg, msg
    ours = {hosts.switch_ns, *hosts.namespaces.values()}
    assert not ours & set(list_namespaces())   # (other test runs may have their own meanwhile)
    with pytest.raises(KeyError, match="no host"):
        hosts.address("nobody")


def test_bad_arguments():
    with pytest.raises(ValueError):
        Hosts([])
    with pytest.raises(ValueError):
        Hosts(["a", "a"])
    with pytest.raises(ValueError):
        Hosts(["a"], subnet="10.213.7.0/24")
