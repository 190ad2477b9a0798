"""BusyPoll, the wait before a blocking recv: on real sockets, with its rules as oracles."""

import time

import pytest
import zmq

from asyncsgd.wire.busy_poll import CONTENDED_SECONDS, SMOOTHING, BusyPoll


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for sock in (a, b):
        sock.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://busy-poll")
    b.connect("inproc://busy-poll")
    try:
        yield a, b
    finally:
        a.close()
        b.close()
        ctx.term()


def test_a_waiting_message_ends_the_poll_at_once(pair):
    a, b = pair
    a.send(b"reply")
    poll = BusyPoll(10.0)  # were the message missed, this would poll for 10 s
    start = time.monotonic()
    poll.wait(b)
    assert time.monotonic() - start < 5
    assert (poll.polls, poll.hits) == (1, 1)
    assert b.recv(zmq.NOBLOCK) == b"reply"


def test_silence_polls_no_longer_than_the_budget(pair):
    _, b = pair
    # a core nobody else wants (even when this test is preempted on a loaded machine)
    poll = BusyPoll(0.002, yield_core=lambda: None, contended_seconds=60.0)
    start = time.perf_counter()
    poll.wait(b)
    elapsed = time.perf_counter() - start
    assert 0.002 <= elapsed < 5
    assert (poll.polls, poll.hits, poll.contended) == (1, 0, 0)


def test_a_wanted_core_ends_the_poll_after_one_yield(pair):
    _, b = pair
    yields = []

    def contended():  # another thread ran meanwhile: the yield came back late
        yields.append(1)
        time.sleep(10 * CONTENDED_SECONDS)

    poll = BusyPoll(10.0, yield_core=contended)
    poll.wait(b)
    assert len(yields) == 1
    assert (poll.polls, poll.hits, poll.contended) == (1, 0, 1)


def test_off_or_slow_replies_never_poll(pair):
    a, b = pair
    a.send(b"reply")

    def never():
        raise AssertionError("polled")

    off = BusyPoll(0.0, yield_core=never)
    off.wait(b)
    assert off.polls == 0
    slow = BusyPoll(0.001, yield_core=never)
    slow.waited(0.01)  # replies take longer than the budget: sleeping costs nothing extra
    slow.wait(b)
    assert slow.polls == 0


def test_the_estimate_follows_the_waits_and_turns_polling_back_on(pair):
    _, b = pair
    poll = BusyPoll(0.001, yield_core=lambda: None, contended_seconds=60.0)
    poll.waited(1.0)
    assert poll.expected == pytest.approx(SMOOTHING)
    poll.waited(1.0)
    assert poll.expected == pytest.approx(SMOOTHING + SMOOTHING * (1 - SMOOTHING))
    while poll.expected > poll.max_seconds:  # fast replies again
        poll.waited(0.0001)
    poll.wait(b)
    assert poll.polls == 1


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="busy-poll budget"):
        BusyPoll(-1e-6)
