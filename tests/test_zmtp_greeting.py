"""A server's security mechanism read from its ZMTP greeting, and the clear error it gives a
client that libzmq only shows a closed socket: the race a loaded CI machine lost in all 10
of a ps-stats's tries ("closes the connection ... probably requires CURVE keys")."""

import socket
import threading
import time

import pytest
import zmq

from asyncsgd.errors import SecurityError
from asyncsgd.wire.greeting import GREETING_BYTES, SIGNATURE, server_mechanism
from asyncsgd.wire.security import ClientKeys, await_handshake
from asyncsgd.wire.stats import fetch_stats

pytestmark = pytest.mark.processes  # every test talks to a real socket


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


class HangUpServer:
    """A ZMTP 3 listener announcing ``mechanism`` that always wins the race against libzmq:
    it reads a libzmq client's whole greeting and hangs up before sending its mechanism, so
    the client sees only the socket closed. A peer that sends signature and major version
    and then waits (``server_mechanism``: its signature's padding is all zeros, libzmq's
    holds its routing id's size + 1) gets the whole greeting."""

    def __init__(self, mechanism: str):
        self.rest = (bytes([1]) + mechanism.encode().ljust(20, b"\0") + b"\1"
                     + bytes(GREETING_BYTES - 33))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.hung_up = self.greeted = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.sendall(SIGNATURE + bytes([3]))
                    head = _recv_exactly(conn, 11)
                    if len(head) < 11:
                        continue
                    if head[1:9] == bytes(8):  # the greeting probe
                        conn.sendall(self.rest)
                        self.greeted += 1
                        _recv_exactly(conn, 1)  # until it closes
                    else:
                        _recv_exactly(conn, GREETING_BYTES - 11)
                        self.hung_up += 1
                except OSError:
                    continue

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.listener.close()


@pytest.fixture
def hang_up_server():
    made = []

    def make(mechanism):
        made.append(HangUpServer(mechanism))
        return made[-1]
    yield make
    for srv in made:
        srv.close()


def client_keys() -> ClientKeys:
    server_public, _ = zmq.curve_keypair()
    return ClientKeys(server_public, *zmq.curve_keypair())


@pytest.mark.parametrize("mechanism", ["NULL", "CURVE"])
def test_a_real_server_announces_its_mechanism(mechanism):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        if mechanism == "CURVE":
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        assert server_mechanism(f"tcp://127.0.0.1:{port}", 5) == mechanism
    finally:
        sock.close(0)
        ctx.term()


def test_no_greeting_is_none_within_the_timeout():
    quiet = socket.create_server(("127.0.0.1", 0))  # accepts, never speaks ZMTP
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        started = time.monotonic()
        assert server_mechanism(f"tcp://127.0.0.1:{quiet.getsockname()[1]}", 0.5) is None
        assert 0.4 < time.monotonic() - started < 3
        assert server_mechanism(f"tcp://127.0.0.1:{closed_port}", 5) is None
    finally:
        quiet.close()


def _ps_stats(address: str, keys) -> None:
    fetch_stats(address, 30, keys)


def _worker(address: str, keys) -> None:
    ctx = zmq.Context()
    try:
        await_handshake(ctx, address, keys, 30)
    finally:
        ctx.term()


@pytest.mark.parametrize("client,mechanism,keys,told", [
    (_ps_stats, "CURVE", False, "{} requires CURVE keys: pass --curve-server-key FILE"),
    (_ps_stats, "NULL", True, "{} does not use CURVE: drop --curve-server-key"),
    (_worker, "CURVE", False, "the server at {} requires CURVE authentication: pass "
                              "--curve-server-key"),
    (_worker, "NULL", True, "the server at {} does not use CURVE but this worker does"),
])
def test_a_mismatch_libzmq_showed_only_as_a_hang_up_is_told_at_once(hang_up_server, client,
                                                                    mechanism, keys, told):
    srv = hang_up_server(mechanism)
    started = time.monotonic()
    with pytest.raises(SecurityError) as err:
        client(srv.address, client_keys() if keys else None)
    assert told.format(srv.address) in str(err.value)
    assert srv.hung_up >= 1 and srv.greeted == 1  # libzmq saw a hang-up; the probe, the name
    assert time.monotonic() - started < 10  # at the first hang-up, not after 30 s


def test_a_plain_peer_that_hangs_up_on_a_plain_client_is_not_said_to_need_keys(
        hang_up_server):
    srv = hang_up_server("NULL")
    with pytest.raises(SecurityError) as err:
        fetch_stats(srv.address, 30, None)
    assert "though its greeting names NULL security: is it an asyncsgd server?" in str(err.value)
    assert "CURVE" not in str(err.value)
    assert srv.hung_up >= 10 and srv.greeted == 1
