"""Adaptive sync round deadlines (--backup-workers auto): the policy on hand-made arrival
times, then through a shard on a hand-driven clock."""

import torch

from asyncsgd.config.modes import parse_modes
from asyncsgd.core.tasks import load_task
from asyncsgd.servers.deadline import K, RoundDeadline, quorum
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.simulator import Costs, Link, StepTime, VirtualSetup
from asyncsgd.simulator.run import finish, prepare
from asyncsgd.wire.protocol import ACK, PARAMS, PULL, PUSH, Key, Message, Segment

# Round 1 opens at 8.0; three fast pushes come 1.0, 1.25 and 1.5 s later, the straggler's
# after 4.0 s. Median 1.375, absolute deviations 0.375, 0.125, 0.125, 2.625: MAD 0.25.
CUT = 1.375 + K * 0.25


def _straggled() -> RoundDeadline:
    rd = RoundDeadline()
    rd.arrived(0, 0.5)  # round 0 has no opening: nothing to time it from
    assert not rd.due(0, 3, 4, 7.0) and rd.due(0, 4, 4, 8.0)
    rd.closed(0, 8.0)
    for pushed, now in enumerate((9.0, 9.25, 9.5), 1):
        rd.arrived(1, now)
        assert not rd.due(1, pushed, 4, now), "without a past round, a round waits for all"
    rd.arrived(1, 12.0)
    assert rd.due(1, 4, 4, 12.0)
    rd.closed(1, 12.0)
    return rd


def test_quorum_is_half_the_live_workers_rounded_up():
    assert [quorum(n) for n in (0, 1, 2, 3, 4, 5, 16)] == [1, 1, 1, 2, 2, 3, 8]


def test_the_first_rounds_wait_for_all_then_the_deadline_is_median_plus_k_mad():
    rd = _straggled()
    assert rd.deadline(1) is None and rd.deadline(2) == CUT and rd.at(2) == 12.0 + CUT
    assert rd.expected(2) == 3  # pushes of round 1 by its deadline: the straggler's was not


def test_a_round_closes_at_the_push_past_rounds_had_by_their_deadline():
    """The straggler's round: the third fast push closes round 2 at once."""
    rd = _straggled()
    assert [rd.due(2, pushed, 4, now) for pushed, now in ((1, 13.0), (2, 13.25), (3, 13.5))] \
        == [False, False, True]


def test_a_round_closes_at_its_deadline_with_the_quorum_and_never_without():
    rd = _straggled()
    at = 12.0 + CUT
    assert not rd.due(2, 2, 4, at - 1e-9) and rd.due(2, 2, 4, at)
    assert not rd.due(2, 1, 4, at + 100), "one push of 4 is below the quorum of 2"
    assert rd.due(2, 4, 4, 12.1), "every live worker pushed: at once"


def test_late_pushes_count_for_the_round_they_were_computed_in():
    """Round 2 closed on 3 pushes; the fourth, computed in round 2, comes 0.1 s after it,
    within the deadline: round 2 had 4 pushes by its deadline, and now round 3 expects 4
    (with history 1, round 2 alone is the past)."""
    rd = RoundDeadline(history=1)
    rd.closed(0, 0.0)
    for now in (1.0, 1.0, 1.0, 1.5):
        rd.arrived(1, now)
    rd.closed(1, 1.5)  # round 1's offsets 1, 1, 1, 1.5: median 1, MAD 0
    assert (rd.deadline(2), rd.expected(2)) == (1.0, 3)
    for now in (2.5, 2.5, 2.5):
        rd.arrived(2, now)
    assert rd.due(2, 3, 4, 2.5)
    rd.closed(2, 2.5)
    rd.arrived(2, 2.5)  # late, 1.0 after round 2 opened: by its deadline
    assert list(rd.rounds) == [2, 3], "history 1: round 1 is forgotten"
    assert (rd.deadline(3), rd.expected(3)) == (1.0, 4)
    rd.arrived(1, 2.6)  # a round no longer kept: nothing to time it from
    assert (rd.deadline(3), rd.expected(3)) == (1.0, 4)


def _state(workers: int) -> ShardState:
    cfg = ShardConfig(index=0, start=0, end=2, rule="sgd", lr=1.0, consistency="sync",
                      expected_workers=workers, heartbeat_timeout=100.0, sync_reduce="sum",
                      backup_workers="auto")
    return ShardState(cfg, torch.zeros(2))


def _push(state, name, seq, now, grad, clock):
    msg = Message(type=PUSH, shard=0, worker=name, incarnation=1, seq=seq, clock=clock,
                  meta={Key.PULL: True}, segments=[Segment(0, torch.tensor([grad, 0.0]))])
    return state.handle(name.encode(), msg, now)


def _params_to(replies) -> str:
    return "".join(sorted(peer.decode() for peer, r in replies if r.type == PARAMS))


def test_a_shard_closes_rounds_by_the_deadline_on_its_own_clock():
    """4 workers, d 4x slower, sum reduce, lr 1. Rounds 0 and 1 wait for d (round 1 is
    timed as in ``_straggled``); round 2 closes at c's push, as many as round 1 had by its
    deadline; in round 3 c is slow too, and ``tick`` closes it at its deadline exactly,
    with a and b (the quorum). c's and d's late pushes are stale: acknowledged, counted,
    never applied."""
    state = _state(4)
    for name in "abcd":
        state.handle(name.encode(), Message(type=PULL, worker=name, incarnation=1, seq=0), 0.0)
    seq = dict.fromkeys("abcd", 0)

    def push(name, now, grad=1.0, clock=None):
        seq[name] += 1
        return _push(state, name, seq[name], now, grad,
                     state.version if clock is None else clock)

    for start in (0.0, 4.0):
        assert push("a", start + 1.0) == push("b", start + 1.25) == push("c", start + 1.5) \
            == []
        assert state.wake_at() is None, "no past round: the round waits for all"
        assert _params_to(push("d", start + 4.0)) == "abcd"
    assert (state.version, state.params.tolist()) == (2, [-8.0, 0.0])
    assert push("a", 9.0) == [] and state.wake_at() is None, "1 push: below the quorum"
    assert push("b", 9.25) == [] and state.wake_at() == 8.0 + CUT
    assert _params_to(push("c", 9.5, grad=2.0)) == "abc"
    assert (state.version, state.params.tolist()) == (3, [-12.0, 0.0])
    # Round 3 opened at 9.5. Past times 1, 1.25, 1.5, 4 and 1, 1.25, 1.5: median 1.25,
    # MAD 0.25; each past round had 3 pushes by then.
    assert push("a", 10.5) == push("b", 10.75) == []
    at = 9.5 + (1.25 + K * 0.25)
    assert state.wake_at() == at and state.tick(at - 1e-9) == []
    assert _params_to(state.tick(at)) == "ab" and state.wake_at() is None
    assert (state.version, state.params.tolist()) == (4, [-14.0, 0.0])
    for name, clock in (("c", 3), ("d", 2)):  # computed in rounds 3 and 2: both closed
        replies = push(name, 12.0, grad=100.0, clock=clock)
        # the ack alone, or inside the params (both are answered at once)
        acks = [r.meta for _, r in replies if r.type == ACK] + \
            [r.meta[Key.ACK] for _, r in replies if Key.ACK in r.meta]
        assert (acks, _params_to(replies)) == ([{Key.APPLIED: False, Key.STALE: True}], name)
    assert (state.params.tolist(), state.counters["stale"]) == ([-14.0, 0.0], 2)
    assert state.policy.deadline.rounds[2][1] == [1.0, 1.25, 1.5, 4.0], "d's late push timed"


def _traced(tmp_path, mode, setup):
    engine = prepare(load_task("tasks_for_tests:regression"), parse_modes(mode)[0], setup,
                     out=str(tmp_path / mode.replace(":", "-")), progress="off")
    engine.trace = []
    return engine, finish(engine)


def _costs(**kw) -> Costs:
    """Steps of 1 ms; a push (or a reply) takes 1 ms on the server's link, 0.2 ms to apply."""
    return Costs(StepTime(1e-3, kw.pop("sigma", 0.0)), Link(1e6, 1e-4), 2e-7, 1000, **kw)


def test_on_the_virtual_clock_auto_leaves_a_slow_worker_behind_as_one_backup_does(tmp_path):
    """3 workers, worker 2 ten times slower. Its first two rounds wait for it (worker 0's
    pushes 11.4 and 14.4 ms apart); from then on auto's rounds close at worker 1's push,
    as ps-backup:1's do: worker 0's pushes are 4.4 ms apart (its reply 1.1 ms, its step 1,
    its push in 1.1 and applied in 0.2, worker 1's push in 1 ms after it), only a slow
    push on the link between them delays one, and worker 2's pushes are stale."""
    setup = VirtualSetup(workers=3, seed=0, costs=_costs(slowdown=((2, 10.0),)), epochs=1000,
                         eval_every=1.0, max_seconds=0.08)
    gaps = {}
    for mode in ("ps-backup:1", "ps-backup:auto"):
        engine, result = _traced(tmp_path, mode, setup)
        applied = [t for what, t, rank, *_ in engine.trace if what == "apply" and rank == 0]
        gaps[mode] = [round((b - a) / 1e-3, 6) for a, b in zip(applied, applied[1:])]
        assert result.summary["stale_pushes"] > 0
    fixed, auto = gaps["ps-backup:1"], gaps["ps-backup:auto"]
    assert auto[:2] == [11.4, 14.4] and len(auto) > 12
    assert set(auto[2:]) <= set(fixed) and set(fixed) <= {4.4, 4.6}, (auto, fixed)
    assert auto.count(4.4) > 0.8 * len(auto[2:])


def test_on_the_virtual_clock_a_deadline_closes_a_round_at_its_virtual_time(tmp_path):
    """Lognormal steps (sigma 1): some rounds close when their deadline passes, at the
    virtual time the shard named, with no push arriving then."""
    setup = VirtualSetup(workers=4, seed=0, costs=_costs(sigma=1.0), epochs=1000,
                         eval_every=1.0, max_seconds=0.1)
    engine, _ = _traced(tmp_path, "ps-backup:auto", setup)
    fired = [e for e in engine.trace if e[0] == "deadline"]
    assert fired and all(t == wake for _, t, wake, _ in fired), fired
    assert any(closed for *_, closed in fired)


def test_a_round_whose_workers_all_left_is_not_closed_by_the_rule_of_all():
    rd = _straggled()
    assert not rd.due(2, 0, 0, 100.0)
