"""Waiting for a message by polling briefly before sleeping, while that is cheap.

A process blocked in ``recv`` sleeps until libzmq's I/O thread wakes it. On this
machine (a VM whose idle vCPUs halt: ``guest_halt_poll_ns`` 0) waking is slow:
a 20 KB push+pull round trip wakes six threads, and each woken Python thread
waited ~25 us for its core (schedstat). A worker that polls its socket for the
reply, and a shard that polls for the next push, are awake when the message
lands: a 20 KB round trip took 0.20-0.21 ms instead of 0.26-0.28 ms here,
against 0.19-0.20 ms for ``experiments/ps_floor.py``, whose processes sleep.

Polling costs a core, so it is kept to where it pays and takes little from
other work:

* only while recent messages came within the budget (``max_seconds``): a
  1 MB round trip (~1 ms), or four workers sharing two cores, wait longer and
  sleep as before;
* each poll offers the core to any other thread that wants it
  (``sched_yield``); a yield that took long (another thread ran: the core is
  wanted) ends the polling, and the caller sleeps in ``recv`` as before.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import zmq

CONTENDED_SECONDS = 30e-6  # a yield this long handed the core to another thread
SMOOTHING = 0.25  # weight of the newest wait in the running estimate


class BusyPoll:
    """Polls a socket for up to ``max_seconds`` before its caller's blocking ``recv``.

    ``wait(sock)`` returns when a message is ready, or when polling stops
    paying; the caller then receives as usual (at once, or sleeping in recv).
    ``max_seconds`` 0 never polls. ``yield_core`` (``os.sched_yield``) and
    ``contended_seconds`` (how long a yield that handed the core away takes):
    parameters, so that tests can stand in a free or a contended core.
    """

    def __init__(self, max_seconds: float, yield_core: Callable[[], None] = os.sched_yield,
                 contended_seconds: float = CONTENDED_SECONDS):
        if max_seconds < 0:
            raise ValueError(f"busy-poll budget must be >= 0 s, got {max_seconds!r}")
        self.max_seconds = max_seconds
        self.yield_core, self.contended_seconds = yield_core, contended_seconds
        self.expected = 0.0  # running estimate of the wait for a message, seconds
        self.polls = self.hits = self.contended = 0  # waits polled, answered, cut short

    def wait(self, sock: zmq.Socket) -> None:
        """Poll ``sock`` until a message is ready, the budget is spent, or the core is
        wanted elsewhere; returns at once when polling is off or not paying now."""
        if not self.max_seconds or self.expected > self.max_seconds:
            return
        self.polls += 1
        end = time.perf_counter() + self.max_seconds
        while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            before = time.perf_counter()
            if before >= end:
                return
            self.yield_core()
            if time.perf_counter() - before > self.contended_seconds:
                self.contended += 1
                return
        self.hits += 1

    def waited(self, seconds: float) -> None:
        """Note how long the latest wait for a message lasted (polled or slept)."""
        self.expected += SMOOTHING * (seconds - self.expected)
