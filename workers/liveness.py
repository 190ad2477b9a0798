"""Liveness: when a waiting worker heartbeats, re-sends, retries silent shards or gives up.

Pure timing (PROTOCOL.md, Liveness and Retries): every method takes ``now``, so the client's
clock, sockets and threads stay in client.py and these rules are tested without them.
"""

from __future__ import annotations

RESEND_HEARTBEATS = 3  # an unanswered request is re-sent after this many heartbeats
SILENT_HEARTBEATS = 3  # a shard silent for this many heartbeats is assumed gone
MAX_BACKOFF = 10.0  # seconds: the longest wait between two retries


def doubled(wait: float) -> float:
    """The next wait of an exponential backoff: twice this one, at most MAX_BACKOFF."""
    return min(2 * wait, MAX_BACKOFF)


class Liveness:
    """One exchange's clocks: when each shard was last heard, the next heartbeat, the next
    retry of silent shards and its backoff, and each outstanding request's re-send."""

    def __init__(self, shards: int, heartbeat: float, server_timeout: float, now: float):
        self.heartbeat, self.server_timeout = heartbeat, server_timeout
        # Reopening a shard's socket is no answer: the silence --server-timeout bounds
        # runs on across retries.
        self.last_heard = [now] * shards
        self.next_beat = now + heartbeat
        self.retry_at, self.backoff = now, heartbeat  # the next retry of silent shards, its wait
        self._resend: dict = {}  # request key -> (due, interval)

    def heard(self, shard: int, now: float) -> None:
        """A reply of ``shard``: it is alive."""
        self.last_heard[shard] = now

    def server_answered(self, now: float) -> None:
        """A (restarted) server welcomed us: every shard listens, retries start afresh."""
        self.last_heard = [now] * len(self.last_heard)
        self.retry_at, self.backoff = now, self.heartbeat

    def beat_due(self, now: float) -> bool:
        """Whether the waited-on shards get a heartbeat now; if so, the next is one
        heartbeat later."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.heartbeat
        return True

    def resends_due(self, keys, now: float) -> list:
        """The outstanding requests (of ``keys``) to re-send now: first RESEND_HEARTBEATS
        heartbeats after they were first seen here, then at doubling intervals."""
        first = RESEND_HEARTBEATS * self.heartbeat
        due_now = []
        for key in keys:
            due, interval = self._resend.setdefault(key, (now + first, first))
            if now >= due:
                due_now.append(key)
                interval = doubled(interval)
                self._resend[key] = (now + interval, interval)
        return due_now

    def silent(self, waiting, now: float) -> list:
        """The shards of ``waiting`` silent for more than SILENT_HEARTBEATS heartbeats; none
        silent resets the backoff."""
        dead = [i for i in waiting if now - self.last_heard[i] > SILENT_HEARTBEATS * self.heartbeat]
        if not dead:
            self.backoff = self.heartbeat
        return dead

    def silence(self, dead, now: float) -> float:
        """Seconds since any of ``dead`` was last heard: the longest silence among them."""
        return now - min(self.last_heard[i] for i in dead)

    def lost(self, dead, now: float) -> bool:
        """Whether ``dead`` have been silent for longer than the server timeout."""
        return self.silence(dead, now) > self.server_timeout

    def retry_due(self, now: float) -> bool:
        return now >= self.retry_at

    def rejoin_wait(self, dead, now: float) -> float:
        """How long a retry waits for the front's answer: the backoff, but no longer than
        the time ``dead`` have left before the server timeout."""
        return min(self.backoff, self.server_timeout - self.silence(dead, now))

    def retried(self, now: float) -> None:
        """Silent shards' sockets were reopened: give a fresh link SILENT_HEARTBEATS
        heartbeats to answer, and double the backoff."""
        self.retry_at = now + SILENT_HEARTBEATS * self.heartbeat
        self.backoff = doubled(self.backoff)
