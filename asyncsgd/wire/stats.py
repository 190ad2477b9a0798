"""Ask a running parameter server for its counters (``asyncsgd ps-stats``).

ZeroMQ never tells a sender that its handshake failed (the request just waits), so
``fetch_stats`` watches its socket's monitor and says what went wrong (``_Handshake``).
"""

from __future__ import annotations

import time
from typing import Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import AsyncSGDError, SecurityError
from .greeting import HangUps, misfit
from .protocol import ERROR, STATS, Key, Message
from .security import HANDSHAKE_EVENTS, MECHANISM_MISMATCH, PROBE_FAILURES
from .transport import dealer, parse_endpoint, recv, send

WATCHED = HANDSHAKE_EVENTS | zmq.EVENT_CONNECTED
NEED_KEYS = ("pass --curve-server-key FILE and --curve-secret FILE (asyncsgd keygen "
             "writes them)")


STALENESS_BUCKETS = 64  # a STATS reply's staleness histogram: >= 63 counts in the last


def percentile(hist: list, q: float) -> Optional[int]:
    """The value at quantile ``q`` of a STATS reply's histogram, whose bucket i counts
    value i (staleness; the last bucket counts that value and above)."""
    total = sum(hist)
    if not total:
        return None
    seen = 0
    for value, count in enumerate(hist):
        seen += count
        if seen >= q * total:
            return value
    return len(hist) - 1


def fetch_stats(server: str, timeout: float = 5.0, curve=None) -> dict:
    """The front's counters; ``curve`` (``security.ClientKeys``) for a CURVE server.

    Raises ``SecurityError`` when the handshake fails (CURVE keys missing, wrong or
    unexpected), ``AsyncSGDError`` when nothing answers within ``timeout`` seconds.
    """
    parse_endpoint(server, "--server")
    ctx = zmq.Context()
    sock = dealer(ctx, server, curve=curve, connect_now=False)
    monitor = None
    try:
        monitor = sock.get_monitor_socket(WATCHED)  # before connecting: no event missed
        sock.connect(server)
        send(sock, Message(type=STATS, seq=1))
        reply = _await_reply(sock, monitor, _Handshake(server, timeout, curve is not None))
        if reply.type == ERROR:
            raise AsyncSGDError(f"{server} answered with an error: {reply.meta.get(Key.ERROR)}")
        return reply.meta
    finally:
        if monitor is not None:
            sock.disable_monitor()
            monitor.close(0)
        sock.close(0)
        ctx.term()


def _await_reply(sock: zmq.Socket, monitor: zmq.Socket, handshake: "_Handshake") -> Message:
    """The reply on ``sock``, or the error that ``handshake`` reads from the monitor."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        left = handshake.deadline - time.monotonic()
        if left <= 0:
            raise handshake.timed_out()
        ready = dict(poller.poll(int(left * 1000) + 1))
        if sock in ready:
            return recv(sock)
        if monitor in ready:
            event = parse_monitor_message(monitor.recv_multipart())
            handshake.see(event["event"], event["value"])


class _Handshake:
    """What the monitor told about the connection, and the error it amounts to.

    How libzmq shows each failure (experiments/README.md, "Failed handshakes"):

    - no keys, CURVE server (or keys, plain server): a mechanism mismatch within a few
      connections, after the socket was closed first; under load the closures can win
      every time, so at the first ones ``greeting.server_mechanism`` reads the server's
      mechanism from its ZMTP greeting and a mismatch is told at once;
    - a client key the server does not admit: HANDSHAKE_FAILED_AUTH, once;
    - the wrong server public key: only hang-ups (FAILED_NO_DETAIL), never a
      mismatch, so ``PROBE_FAILURES`` of them end the wait well before the timeout;
    - a closed port: CLOSED and CONNECT_RETRIED, never CONNECTED;
    - a TCP listener that is not ZeroMQ: CONNECTED, then nothing.
    """

    def __init__(self, server: str, timeout: float, keys: bool):
        self.server, self.timeout, self.keys = server, timeout, keys
        self.connected = self.succeeded = False
        self.deadline = time.monotonic() + timeout
        self.hang_ups = HangUps(server, self.deadline)

    def see(self, event: int, value: int) -> None:
        """Note one event; raise at once when it settles what is wrong."""
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.succeeded = True
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise SecurityError(
                f"{self.server} refused this client's CURVE key (status {value}): pass a "
                "--curve-secret whose public key is in the server's --allowed-clients "
                "('asyncsgd keygen DIR --name NAME' adds one)")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == MECHANISM_MISMATCH:
            raise SecurityError(self._mismatch())
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            # a mismatch libzmq showed only as a hang-up? the server's greeting says
            if self.hang_ups.hung_up() == misfit(self.keys):
                raise SecurityError(self._mismatch())
            if self.hang_ups.count >= PROBE_FAILURES:  # experiments/README.md, "Failed handshakes"
                raise SecurityError(self._hung_up())

    def _mismatch(self) -> str:
        if self.keys:
            return (f"{self.server} does not use CURVE: drop --curve-server-key and "
                    "--curve-secret (or start the server with --curve-secret and "
                    "--allowed-clients)")
        return f"{self.server} requires CURVE keys: {NEED_KEYS}"

    def _hung_up(self) -> str:
        mechanism = self.hang_ups.mechanism
        if mechanism not in (None, "CURVE"):  # plain (or PLAIN, GSSAPI), yet hangs up
            return (f"{self.server} closes the connection during the handshake "
                    f"({self.hang_ups.count} tries) though its greeting names {mechanism} "
                    "security: is it an asyncsgd server?")
        if self.keys:
            return (f"{self.server} closes the connection during the CURVE handshake "
                    f"({self.hang_ups.count} tries): --curve-server-key is probably not this "
                    "server's public key (the server.key 'asyncsgd keygen' wrote with its "
                    "--curve-secret)")
        return (f"{self.server} closes the connection during the handshake ({self.hang_ups.count} "
                f"tries): it probably requires CURVE keys: {NEED_KEYS}")

    def timed_out(self) -> AsyncSGDError:
        """The error for no reply within the timeout, by how far the connection got."""
        wait = f"within {self.timeout:g} s"
        if self.hang_ups.count:
            return SecurityError(self._hung_up())
        if self.succeeded:
            return AsyncSGDError(f"no answer from {self.server} {wait} though it accepted the "
                                 "connection; is 'asyncsgd ps-server' running there (and not "
                                 "overloaded: try a longer --timeout)?")
        if self.connected:
            return AsyncSGDError(f"no answer from {self.server} {wait}: it accepted a TCP "
                                 "connection but never completed the ZeroMQ handshake; is "
                                 "'asyncsgd ps-server' running there, or another program?")
        return AsyncSGDError(f"no answer from {self.server} {wait}: nothing accepted a "
                             "connection; is 'asyncsgd ps-server' running there?")

