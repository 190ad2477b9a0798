"""The front's roster stays within ROSTER names whatever hellos arrive: those that left or
went silent are forgotten first, then the least recently seen. Pure ``Front`` (its socket is
never used), with the clock given."""

import torch

from asyncsgd.config import ServerConfig
from asyncsgd.servers.front import ROSTER, Front
from asyncsgd.servers.sessions import Sessions
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import BYE, HEARTBEAT, HELLO, WELCOME, Key, Message

TIMEOUT = 10.0  # ServerConfig's heartbeat timeout


def _front():
    layout = Layout.of(torch.nn.Linear(2, 1))
    return Front(ServerConfig(), layout, {}, sock=None, endpoint="", gate=None,
                 sessions=Sessions.new())


def _say(front, kind, worker, now):
    meta = {Key.SIGNATURE: front.signature} if kind == HELLO else {}
    return front._handle(Message(type=kind, worker=worker, seq=1, meta=meta), now)


def test_fresh_ids_in_one_live_period_leave_the_roster_at_its_bound():
    front = _front()
    for n in range(10_000):
        assert _say(front, HELLO, f"id-{n}", 0.001 * n).type == WELCOME
    assert len(front.joined) == ROSTER and len(front.left) == 0
    assert set(front.joined) == {f"id-{n}" for n in range(10_000 - ROSTER, 10_000)}
    assert front.forgot_live and not front.everyone_left()  # a forgotten one may still push
    assert front.arrivals == 10_000


def test_the_gone_are_forgotten_before_the_live_and_the_least_recently_seen_first():
    front = _front()
    for n in range(ROSTER):  # all live: within the timeout of each other
        _say(front, HELLO, f"w{n}", 100 + n / 1000)
    _say(front, BYE, "w200", 105.0)
    _say(front, HELLO, "new-a", 105.0)  # the only one gone: it left
    assert "w200" not in front.joined and "w200" not in front.left and not front.forgot_live
    _say(front, HELLO, "w5", 105.0)  # already there: forgets nobody
    assert len(front.joined) == ROSTER and "new-a" in front.joined
    for name in front.joined:
        if name not in ("w1", "new-a"):
            _say(front, HEARTBEAT, name, 112.0)
    _say(front, HELLO, "new-b", 112.0)  # w1 went silent (12 s > TIMEOUT): it goes
    assert "w1" not in front.joined and "new-a" in front.joined
    assert front.forgot_live  # without a goodbye: it may still come to a shard
    _say(front, HELLO, "new-c", 112.0)  # none gone: the least recently seen live one
    assert "new-a" not in front.joined and len(front.joined) == ROSTER


def test_everyone_left_holds_when_the_forgotten_had_left():
    front = _front()
    for n in range(ROSTER + 50):  # each leaves before the next arrives
        _say(front, HELLO, f"w{n}", float(n))
        _say(front, BYE, f"w{n}", float(n))
    assert len(front.joined) == ROSTER and front.everyone_left() and not front.forgot_live
