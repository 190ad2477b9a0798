"""The client's liveness timing (workers/liveness.py), driven by hand-set clocks: no sockets."""

import math

from asyncsgd.workers.liveness import MAX_BACKOFF, Liveness, doubled

# Binary fractions, so every sum and difference below is exact.
BEAT, TIMEOUT, T0 = 0.5, 4.0, 100.0


def fresh(shards: int = 2, heartbeat: float = BEAT) -> Liveness:
    return Liveness(shards, heartbeat, TIMEOUT, T0)


def test_a_heartbeat_is_due_exactly_one_interval_after_the_last():
    live = fresh()
    assert not live.beat_due(T0 + 0.25)
    assert not live.beat_due(math.nextafter(T0 + BEAT, 0))
    assert live.beat_due(T0 + BEAT)
    assert live.next_beat == T0 + 2 * BEAT
    assert not live.beat_due(T0 + 0.75)
    assert live.beat_due(101.25), "a late beat: the next is one interval after it"
    assert live.next_beat == 101.75
    assert not live.beat_due(101.5)


def test_the_retry_backoff_doubles_up_to_its_cap():
    live = fresh(heartbeat=1.5)
    waits = []
    for k in range(5):
        live.retried(T0 + k)
        waits.append(live.backoff)
    assert waits == [3.0, 6.0, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    assert live.retry_at == T0 + 4 + 3 * 1.5, "a fresh link gets three heartbeats to answer"
    assert doubled(4.0) == 8.0 and doubled(6.0) == MAX_BACKOFF == 10.0


def test_a_retry_is_due_at_retry_at_and_not_before():
    live = fresh()
    assert live.retry_due(T0), "the first retry may come as soon as a shard is silent"
    live.retried(T0 + 2)
    assert not live.retry_due(math.nextafter(T0 + 3.5, 0))
    assert live.retry_due(T0 + 3.5)


def test_hearing_from_the_server_resets_the_retry():
    live = fresh()
    live.retried(T0 + 2)
    live.retried(T0 + 4)
    assert (live.backoff, live.retry_at) == (2.0, T0 + 5.5)
    live.server_answered(T0 + 5)
    assert (live.backoff, live.retry_at) == (BEAT, T0 + 5)
    assert live.last_heard == [T0 + 5, T0 + 5]
    assert live.silent([0, 1], T0 + 6.5) == [], "1.5 s is three heartbeats, not more"


def test_no_silent_shard_resets_the_backoff_and_one_silent_keeps_it():
    live = fresh()
    live.retried(T0)
    live.heard(0, T0 + 1)
    assert live.silent([0, 1], T0 + 2) == [1]
    assert live.backoff == 1.0
    assert live.silent([0], T0 + 2) == []
    assert live.backoff == BEAT


def test_a_shard_is_silent_only_past_three_heartbeats_of_its_own():
    live = fresh(shards=3)
    live.heard(0, T0 + 1)
    live.heard(2, T0 + 0.25)
    assert live.last_heard == [T0 + 1, T0, T0 + 0.25]
    assert live.silent([0, 1, 2], T0 + 1.5) == []
    assert live.silent([0, 1, 2], math.nextafter(T0 + 1.5, math.inf)) == [1]
    assert live.silent([0, 1, 2], T0 + 2.5) == [1, 2]
    assert live.silent([0, 2], T0 + 2.5) == [2], "only shards waited on count"


def test_silence_past_the_timeout_declares_the_server_lost_at_exactly_that_time():
    live = fresh()
    live.heard(0, T0 + 1)
    assert live.silence([0, 1], T0 + 3) == 3.0, "the longest silence among the dead"
    assert not live.lost([1], T0 + TIMEOUT)
    assert live.lost([1], math.nextafter(T0 + TIMEOUT, math.inf))
    assert not live.lost([0], math.nextafter(T0 + TIMEOUT, math.inf))
    live.retried(T0 + 2)  # reopening a socket is no answer: the silence runs on
    assert live.lost([1], T0 + 4.5)


def test_a_retry_waits_the_backoff_but_not_past_the_timeout():
    live = fresh()
    assert live.rejoin_wait([0], T0 + 2) == BEAT
    assert live.rejoin_wait([0], T0 + 3.75) == 0.25
    live.retried(T0 + 1)
    live.retried(T0 + 2)
    assert live.rejoin_wait([0], T0 + 2) == 2.0
    assert live.rejoin_wait([0], T0 + 3) == 1.0


def test_an_unanswered_request_is_resent_after_three_heartbeats_then_with_backoff():
    live = fresh()
    a, b = (0, 7), (1, 8)
    assert live.resends_due([a], T0) == []
    assert live.resends_due([a], math.nextafter(T0 + 1.5, 0)) == []
    assert live.resends_due([a, b], T0 + 1.5) == [a], "b was first seen now"
    due = [t for t in (4.4, 4.5, 10.4, 10.5, 20.4, 20.5, 30.5)
           if live.resends_due([a], T0 + t) == [a]]
    assert due == [4.5, 10.5, 20.5, 30.5], "intervals 3, 6, then 10 s (the cap)"
    assert live.resends_due([b], T0 + 3.0) == [b]
