"""Waiting for a message by polling briefly before sleeping, while that is cheap.

A process blocked in ``recv`` sleeps until libzmq's I/O thread wakes it. On this
machine (a VM whose idle vCPUs halt: ``guest_halt_poll_ns`` 0) waking is slow:
a 20 KB push+pull round trip wakes six threads, and each woken Python thread
waited ~25 us for its core (schedstat). A worker that polls its socket for the
reply, and a shard that polls for the next push, are awake when the message
lands: a 20 KB round trip took 0.215 ms instead of 0.228 ms in
``experiments/ps_throughput.py`` (2026-11-27 and -26), against 0.19 ms for
``experiments/ps_floor.py``, whose processes sleep; in a harness timing only
these two, 0.23 ms instead of 0.29 ms (the floor 0.22-0.24 ms).

Polling costs a core, so it is kept to where it pays and takes little from
other work:

* only while recent messages came within the budget (``max_seconds``): a
  worker among four sharing two cores waits longer and sleeps as before;
* only while the latest message was small (``max_bytes``, 256 KiB): a large
  one keeps both processes' libzmq I/O threads copying it for most of the
  wait, and a poller takes the core they need. A shard that polled made a
  one-trainer round trip faster at 20, 100 and 250 KB (0.270 against 0.348 ms,
  0.407 / 0.453, 0.451 / 0.545) but slower at 500 KB and 1 MB (0.657 against
  0.601 ms, 0.814 / 0.744), where its waits were still within the budget
  (2026-11-27, AMD EPYC with 2 vCPUs, one ps-server polling and one not,
  interleaved, medians of 6 runs of 2 s each);
* each poll offers the core to any other thread that wants it
  (``sched_yield``); a yield that took long (another thread ran: the core is
  wanted) ends the polling, and the caller sleeps in ``recv`` as before;
* a poller that yielded is runnable, not asleep: a message landing meanwhile
  waits for the thread that took the core to give it back (up to a scheduler
  slice, milliseconds), where a sleeper would have been woken. So after a
  contended poll the next wait sleeps, after two in a row the next two, and
  so on up to ``MAX_SKIPS``; a poll that yielded and found its message
  resets that. On a busy machine polling fades out (beside 3 spinning
  processes: 135 polls in ~10,000 round trips, which took 0.62 ms against
  0.70 ms with polling off).

A yield counts as contended past 100 us: shorter ones were mostly the
process's own libzmq I/O thread taking the core to deliver the message. With
30 us, 1,409 of 6,372 polls were cut short on an idle machine and polling
faded there too (20 KB round trip 0.28 ms); with 100 us, 105 of 24,477
(0.23 ms, the floor 0.24 ms in that run). Another process's turn lasts a
scheduler slice (0.75 ms or more), well beyond it.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import zmq

# Microseconds a worker polls for a reply, and a shard for its next message, before sleeping
# (--busy-poll-us); what it bought is in the docstring above.
BUSY_POLL_US = 400
MAX_BUSY_POLL_US = 10_000  # well below a heartbeat and a shard's 0.1 s tick
CONTENDED_SECONDS = 100e-6  # a yield this long handed the core to another process
MAX_POLLED_BYTES = 256 * 1024  # after a larger message the next wait sleeps (see above)
SMOOTHING = 0.25  # weight of the newest wait in the running estimate
MAX_SKIPS = 64  # waits slept through after contended polls in a row, at most


class BusyPoll:
    """Polls a socket for up to ``max_seconds`` before its caller's blocking ``recv``.

    ``wait(sock)`` returns when a message is ready, or when polling stops
    paying; the caller then receives as usual (at once, or sleeping in recv).
    ``max_seconds`` 0 never polls; nor does a wait after a message larger than
    ``max_bytes``. ``yield_core`` (``os.sched_yield``) and ``contended_seconds``
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

    def wait(self, sock: zmq.Socket) -> None:
        """Poll ``sock`` until a message is ready, the budget is spent, or the core is
        wanted elsewhere; returns at once when polling is off or not paying now."""
        if not self.max_seconds or self.large or self.expected > self.max_seconds:
            return
        if self.skip:
            self.skip -= 1
            return
        self.polls += 1
        end = time.perf_counter() + self.max_seconds
        yielded = False
        while not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
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
