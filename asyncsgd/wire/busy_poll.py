"""Busy polling: wait for a message by polling briefly before sleeping in ``recv``.

Waking a sleeping thread is slow where idle vCPUs halt, so a worker awaiting its reply and a
shard awaiting the next push poll first, but only while that is cheap (``BusyPoll`` says
when). Figures: experiments/README.md, "Busy polling".
"""

from __future__ import annotations

import os
import time
from typing import Callable

import zmq

# Microseconds a worker polls for a reply, and a shard for its next message, before sleeping
# (--busy-poll-us); what it bought: experiments/README.md, "Busy polling".
BUSY_POLL_US = 400
MAX_BUSY_POLL_US = 10_000  # well below a heartbeat and a shard's 0.1 s tick
# A yield this long handed the core to another process; shorter ones were mostly our own
# libzmq I/O thread delivering the message (experiments/README.md, "Busy polling").
CONTENDED_SECONDS = 100e-6
MAX_POLLED_BYTES = 256 * 1024  # after a larger message the next wait sleeps (see BusyPoll)
SMOOTHING = 0.25  # weight of the newest wait in the running estimate
MAX_SKIPS = 64  # waits slept through after contended polls in a row, at most
# The Cython getter and plain ints: pyzmq's Socket.getsockopt(zmq.EVENTS) & zmq.POLLIN makes
# an enum of the result (1.7 against 1.1 us; Socket.poll builds a Poller: 1.6 against 0.9 us
# for zmq_poll), paid at every look while polling and between a reply's parts
_GET = zmq.backend.Socket.get
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def readable(sock: zmq.Socket) -> bool:
    """Whether a message is ready on ``sock`` now."""
    return bool(_GET(sock, _EVENTS) & _POLLIN)


def wait_readable(sock: zmq.Socket, seconds: float) -> bool:
    """Wait up to ``seconds`` (at least 0) for a message on ``sock``; whether one is ready."""
    return bool(zmq.zmq_poll([(sock, _POLLIN)], max(0, int(seconds * 1000))))


class BusyPoll:
    """Polls sockets for up to ``max_seconds`` before its caller's blocking ``recv``.

    ``wait(*socks)`` returns when a message is ready on each, or when polling stops
    paying; the caller then receives as usual (at once, or sleeping in recv).
    ``max_seconds`` 0 never polls. Polling costs a core, so it stops paying:

    * while recent waits outlast ``max_seconds`` (a worker among several sharing
      the cores waits longer, and sleeps);
    * after a message larger than ``max_bytes``: both processes' libzmq I/O
      threads copy a large one for most of the wait, and a poller takes their core;
    * when a ``sched_yield`` took long (another thread wanted the core). A poller
      that yielded is runnable, not asleep, so a message landing meanwhile waits
      a scheduler slice for it; the next waits therefore sleep, one after a
      contended poll, two after two in a row, up to ``MAX_SKIPS``, until a poll
      that yielded finds its message. On a busy machine polling fades out.

    ``yield_core`` (``os.sched_yield``) and ``contended_seconds``
    (how long a yield that handed the core away takes): parameters, so that
    tests can stand in a free or a contended core.
    """

    def __init__(self, max_seconds: float, yield_core: Callable[[], None] = os.sched_yield,
                 contended_seconds: float = CONTENDED_SECONDS,
                 max_bytes: int = MAX_POLLED_BYTES):
        if max_seconds < 0:
            raise ValueError(f"busy-poll budget must be >= 0 s, got {max_seconds!r}")
        self.max_seconds, self.max_bytes = max_seconds, max_bytes
        self.large = False  # whether the latest message was larger than max_bytes
        self.yield_core, self.contended_seconds = yield_core, contended_seconds
        self.expected = 0.0  # running estimate of the wait for a message, seconds
        self.polls = self.hits = self.contended = 0  # waits polled, answered, cut short
        self.penalty = 0  # waits the latest contended poll slept through (0: it paid since)
        self.skip = 0  # waits still to sleep through

    def wait(self, *socks: zmq.Socket) -> None:
        """Poll until every one of ``socks`` has a message ready (a worker's shards, each
        in turn: a message once ready stays so until read), the budget is spent, or the
        core is wanted elsewhere; returns at once when polling is off or not paying now.
        One budget and one count for them all: the wait is one exchange's."""
        if not self.max_seconds or self.large or self.expected > self.max_seconds:
            return
        if self.skip:
            self.skip -= 1
            return
        self.polls += 1
        end = time.perf_counter() + self.max_seconds
        yielded = False
        for sock in socks:
            while not _GET(sock, _EVENTS) & _POLLIN:
                before = time.perf_counter()
                if before >= end:
                    return
                self.yield_core()
                if time.perf_counter() - before > self.contended_seconds:
                    self.contended += 1
                    self.penalty = min(MAX_SKIPS, 2 * self.penalty or 1)
                    self.skip = self.penalty
                    return
                yielded = True
        self.hits += 1
        if yielded:  # polling paid, on a core nobody else wanted
            self.penalty = 0

    def waited(self, seconds: float, nbytes: int = 0) -> None:
        """Note how long the latest wait for a message lasted (polled or slept), and the
        size of the message it got (its frames' bytes: 0 when none came)."""
        self.expected += SMOOTHING * (seconds - self.expected)
        self.large = nbytes > self.max_bytes
