"""BusyPoll, the wait before a blocking recv: on real sockets, with its rules as oracles."""

import time

import pytest
import torch
import zmq

from asyncsgd.wire.busy_poll import (BUSY_POLL_US, CONTENDED_SECONDS, MAX_SKIPS, SMOOTHING,
                                     BusyPoll, readable, wait_readable)
from asyncsgd.wire.layout import Layout
from asyncsgd.workers.client import PSClient
from tasks_for_tests import index_counter, mib_counter


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


def test_readable_and_wait_readable_say_whether_a_message_waits(pair):
    a, b = pair
    assert not readable(b)
    start = time.monotonic()
    assert not wait_readable(b, 0.05) and time.monotonic() - start >= 0.04
    assert not wait_readable(b, -1.0)  # a deadline passed: a look, no wait
    start = time.monotonic()
    assert not wait_readable(b, 0.0004) and time.monotonic() - start < 0.05  # under 1 ms
    a.send(b"x")
    assert wait_readable(b, 5.0) and readable(b)  # it stays ready until read
    assert b.recv(zmq.NOBLOCK) == b"x" and not readable(b)


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


def test_several_sockets_are_polled_until_each_has_its_message(pair):
    """A worker's shards: one poll, one budget, over every socket; it ends when the last
    has a message (and a message once seen stays until read), not at the first."""
    a, b = pair
    ctx = zmq.Context()
    c, d = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        for sock in (c, d):
            sock.setsockopt(zmq.LINGER, 0)
        c.bind("inproc://busy-poll-2")
        d.connect("inproc://busy-poll-2")
        a.send(b"first")
        poll = BusyPoll(0.002, yield_core=lambda: None, contended_seconds=60.0)
        start = time.perf_counter()
        poll.wait(b, d)  # d stays silent: the whole budget, no hit
        assert time.perf_counter() - start >= 0.002
        assert (poll.polls, poll.hits) == (1, 0)
        c.send(b"second")
        poll = BusyPoll(10.0)  # were either missed, this would poll for 10 s
        start = time.monotonic()
        poll.wait(b, d)
        assert time.monotonic() - start < 5
        assert (poll.polls, poll.hits) == (1, 1)
        assert b.recv(zmq.NOBLOCK) == b"first" and d.recv(zmq.NOBLOCK) == b"second"
    finally:
        c.close()
        d.close()
        ctx.term()


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


def test_contended_polls_in_a_row_sleep_through_1_2_4_waits_until_one_pays(pair):
    a, b = pair
    contended = [True]
    yields = []

    def core():  # contended while contended[0]; free otherwise, and then the reply lands
        yields.append(1)
        if contended[0]:
            time.sleep(0.1)
        else:
            a.send(b"reply")

    # a yield over 50 ms was contended: a free one stays below even when preempted under load
    poll = BusyPoll(10.0, yield_core=core, contended_seconds=0.05)

    def waits(n):  # n waits; how many of them yielded (polled) and did not sleep through
        before = len(yields)
        for _ in range(n):
            poll.wait(b)
        return len(yields) - before

    assert waits(2) == 1  # contended, then 1 wait slept through
    assert waits(3) == 1  # contended again, then 2 slept through
    assert waits(5) == 1  # and 4
    assert (poll.contended, poll.skip) == (3, 0)
    contended[0] = False
    assert waits(1) == 1 and poll.hits == 1  # free: it paid
    assert b.recv(zmq.NOBLOCK) == b"reply"
    contended[0] = True
    assert waits(2) == 1  # back to sleeping through 1


def test_sleeping_through_never_exceeds_max_skips(pair):
    _, b = pair
    poll = BusyPoll(10.0, yield_core=lambda: time.sleep(0.002), contended_seconds=0.001)
    for _ in range(2000):
        poll.wait(b)
    assert poll.penalty == MAX_SKIPS


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


def test_after_a_large_message_the_next_wait_sleeps(pair):
    """Polling pays for small messages only (busy_poll.py: at 500 KB and 1 MB a polling
    shard made a round trip slower): a message over max_bytes turns it off for the next
    wait, a small one back on."""
    a, b = pair

    def never():
        raise AssertionError("yielded: polled for a message that was not there")

    poll = BusyPoll(10.0, yield_core=never, max_bytes=1000)
    a.send(b"reply")
    poll.waited(0.0001, 1001)
    poll.wait(b)
    assert poll.polls == 0
    poll.waited(0.0001, 1000)
    poll.wait(b)
    assert (poll.polls, poll.hits) == (1, 1)


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


def test_a_real_server_and_client_poll_by_default_and_not_when_told(server):
    """Polling changes when a message is read, never what: exact parameters either way. The
    first wait always polls (nothing has been slow yet), so the counters prove the knob
    reached both sides."""
    srv = server("--task", "tasks_for_tests:index_counter", "--samples", 1000,
                 "--eval-every", 1000, "--no-exit-when-done")  # the first client's bye
    layout = Layout.of(index_counter(1000).build_model())       # does not end the run
    polls = _polls_of_exact_steps(srv.address, layout, shards=1)
    assert polls["polls"] >= 1 and polls["sleeps"] == 0
    shard, = srv.stats()["shard_stats"]
    assert shard["busy_polls"] >= 1


def test_a_worker_of_two_shards_polls_for_both_replies_and_stays_exact(server):
    """Each step's two replies are awaited on the shards' own sockets (polled first, as
    with one shard; before issue 42 a 2-shard worker never polled, it waited in zmq_poll
    over every socket): exact parameters, and the knob reaches the wait."""
    srv = server("--task", "tasks_for_tests:index_counter", "--samples", 1000, "--shards", 2,
                 "--eval-every", 1000, "--no-exit-when-done")
    layout = Layout.of(index_counter(1000).build_model())
    polls = _polls_of_exact_steps(srv.address, layout, shards=2)
    assert 1 <= polls["polls"] <= 20 and polls["sleeps"] == 0, polls


def test_a_real_server_and_client_do_not_poll_for_large_messages(server):
    """A 1 MiB model and a budget of 10 ms, far above every wait (main: the client polled
    in 5 of 20 round trips): after the first large message neither side polls again
    (each may have polled before it, for the start's small pull), and the parameters
    stay exact."""
    budget = 10_000
    srv = server("--task", "tasks_for_tests:mib_counter", "--samples", 100, "--shards", 1,
                 "--eval-every", 1000, "--no-exit-when-done", "--busy-poll-us", budget)
    layout = Layout.of(mib_counter(100).build_model())
    params, total = torch.zeros(layout.total), torch.zeros(layout.total)
    with PSClient(srv.address, "large", layout.signature(), rank=0, world=1,
                  server_timeout=20, transport="tcp", busy_poll_us=budget) as client:
        for step in range(20):
            grad = torch.full((layout.total,), float(step % 3 - 1))
            client.push_pull(grad, params)
            total += grad
            assert torch.equal(params, -total), f"step {step}: not exact"
        polls = client.busy_poll.polls
    assert polls <= 1, polls
    shard, = srv.stats()["shard_stats"]
    assert shard["busy_polls"] <= 2, shard["busy_polls"]


def _polls_of_exact_steps(address: str, layout, shards: int) -> dict:
    """The busy polls of two workers of ``address`` (one polling, one not) over 20 push+pull
    steps each, whose parameters stay exactly minus the gradients' sum."""
    params, total = torch.zeros(layout.total), torch.zeros(layout.total)
    polls = {}
    for worker, budget in (("polls", BUSY_POLL_US), ("sleeps", 0)):
        with PSClient(address, worker, layout.signature(), rank=0, world=1,
                      server_timeout=20, transport="tcp", busy_poll_us=budget) as client:
            assert len(client.shards) == shards
            for step in range(20):
                grad = torch.randint(-4, 5, (layout.total,)).float()
                client.push_pull(grad, params)
                total += grad
                assert torch.equal(params, -total), f"{worker}, step {step}: not exact"
            polls[worker] = client.busy_poll.polls
    return polls
