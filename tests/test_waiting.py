"""A worker waiting for a server that does not answer says so (wire/waiting.py): a line a
second in, then one every five seconds, and not a line for a server that answers."""

import logging

import pytest
import zmq
from conftest import free_port

from asyncsgd.wire.security import await_handshake
from asyncsgd.wire.waiting import EVERY, GRACE, Waiting

T0 = 100.0
WHERE = "tcp://127.0.0.1:5599"


def test_the_first_line_comes_after_the_grace_then_one_every_five_seconds():
    waiting = Waiting(WHERE, 60.0, T0)
    assert (GRACE, EVERY) == (1.0, 5.0)
    assert waiting.due(T0) is None and waiting.due(T0 + 0.5) is None
    assert waiting.until_due(T0 + 0.5) == 0.5
    first = waiting.due(T0 + 1.0)
    assert first == ("waiting for the server at tcp://127.0.0.1:5599 (nothing answers there "
                     "yet); giving up after 60 s (--server-timeout)")
    assert waiting.until_due(T0 + 1.0) == 5.0
    assert waiting.due(T0 + 5.5) is None
    assert waiting.due(T0 + 6.0) == ("still waiting for the server at tcp://127.0.0.1:5599: "
                                     "6 s of 60 s")
    assert waiting.due(T0 + 19.0) == ("still waiting for the server at tcp://127.0.0.1:5599: "
                                      "19 s of 60 s"), "a late call says one line, not three"
    assert waiting.due(T0 + 23.0) is None and waiting.due(T0 + 24.0) is not None


@pytest.mark.processes  # a socket, for 1.4 s
def test_a_handshake_with_nobody_listening_says_it_waits_before_giving_up(caplog):
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncsgd.wire.security"):
            assert not await_handshake(ctx, f"tcp://127.0.0.1:{free_port()}", None, 1.4)
    finally:
        ctx.term()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("waiting for the server at tcp://127.0.0.1:")
