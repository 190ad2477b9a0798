"""Which security mechanism a ZeroMQ server speaks, read from its ZMTP greeting.

libzmq tells a client that its mechanism differs only if the server's greeting beats the
server's hang-up, a race often lost under load; so on the first hang-up the client reads
the greeting itself, over a plain TCP connection (``server_mechanism``).
"""

from __future__ import annotations

import socket
import time
from typing import Optional

from .transport import parse_endpoint

SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
MAJOR_VERSION = 3
GREETING_BYTES = 64
MECHANISM = slice(12, 32)
KNOWN = ("NULL", "PLAIN", "CURVE", "GSSAPI")
GREETING_SECONDS = 2.0  # far above what a live server takes, even under load
GREETING_TRIES = 3  # a client asks at each of its first hang-ups until one answers


def misfit(keys: bool) -> str:
    """The server mechanism a client with (or without) CURVE keys cannot talk to."""
    return "NULL" if keys else "CURVE"


class HangUps:
    """The server's mechanism as a client learns it at its handshake hang-ups: asked at
    each of the first ``GREETING_TRIES`` until the greeting answers, never past the
    client's ``deadline`` (``time.monotonic()``)."""

    def __init__(self, endpoint: str, deadline: float):
        self.endpoint, self.deadline = endpoint, deadline
        self.count = 0
        self.mechanism: Optional[str] = None

    def hung_up(self) -> Optional[str]:
        """Count one hang-up; the server's mechanism, when known."""
        self.count += 1
        if self.mechanism is None and self.count <= GREETING_TRIES:
            self.mechanism = server_mechanism(self.endpoint, min(
                GREETING_SECONDS, self.deadline - time.monotonic()))
        return self.mechanism


def server_mechanism(endpoint: str, timeout: float) -> Optional[str]:
    """The mechanism (``NULL``, ``PLAIN``, ``CURVE``, ``GSSAPI``) the ZMTP 3 server at
    ``endpoint`` (``tcp://HOST:PORT``) announces; None when no such greeting comes within
    ``timeout`` seconds (nothing listening, not ZeroMQ, an older ZMTP, or too slow).

    ZMTP 3 (ZeroMQ RFC 23): each side sends its 10-byte signature, then its major
    version, then the rest of its 64-byte greeting (minor version, the mechanism's name
    in 20 NUL-padded bytes, as-server, filler). This sends signature and major version
    only, so the server sends its whole greeting and waits for the rest of ours: it never
    compares mechanisms, and counts one failed handshake when this closes."""
    host, port = parse_endpoint(endpoint, "--server")
    deadline = time.monotonic() + timeout
    # libzmq without ZMQ_IPV6 (as asyncsgd's sockets are) connects over IPv4 only, unless
    # given an IPv6 literal: ask the address it reached
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect((host.strip("[]"), port))
            sock.sendall(SIGNATURE + bytes([MAJOR_VERSION]))
            greeting = b""
            while len(greeting) < GREETING_BYTES:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sock.settimeout(left)
                chunk = sock.recv(GREETING_BYTES - len(greeting))
                if not chunk:
                    return None
                greeting += chunk
    except (OSError, ValueError):  # refused, reset, timed out, unresolvable, a bad name
        return None
    if greeting[0] != SIGNATURE[0] or greeting[9] != SIGNATURE[9] or greeting[10] < 3:
        return None
    name = greeting[MECHANISM].rstrip(b"\0").decode("ascii", "replace")
    return name if name in KNOWN else None
