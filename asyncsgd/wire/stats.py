"""Ask a running parameter server for its counters (``asyncsgd ps-stats``)."""

from __future__ import annotations

import zmq

from ..errors import AsyncSGDError
from .protocol import ERROR, STATS, Key, Message
from .transport import dealer, parse_endpoint, recv, send


def fetch_stats(server: str, timeout: float = 5.0, curve=None) -> dict:
    """The front's counters; ``curve`` (``security.ClientKeys``) for a CURVE server."""
    parse_endpoint(server, "--server")
    ctx = zmq.Context()
    sock = dealer(ctx, server, curve=curve)
    try:
        send(sock, Message(type=STATS, seq=1))
        if not sock.poll(int(timeout * 1000)):
            raise AsyncSGDError(f"no answer from {server} within {timeout:g} s; is "
                                "'asyncsgd ps-server' running there?")
        reply = recv(sock)
        if reply.type == ERROR:
            raise AsyncSGDError(f"{server} answered with an error: {reply.meta.get(Key.ERROR)}")
        return reply.meta
    finally:
        sock.close(0)
        ctx.term()
