"""DyLU (--local-steps auto:H): shard 0 sizes each worker's local steps to its measured
steps a second, the fastest running H. The object alone, the shard that answers with it,
the value's parsing and ddp's refusal: no sockets, no processes."""

import math

import pytest
import torch

from asyncsgd.config import DDPConfig, parse_local_steps
from asyncsgd.errors import ConfigError
from asyncsgd.modes.ddp_hooks import check_hooks
from asyncsgd.servers.dylu import DyLU
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.wire.protocol import ACK, ERROR, PARAMS, PULL, PUSH, Key, Message, Segment
from conftest import finish, read_events, read_json, worker
from test_simulator import MS, _costs, _setup, _traced


def test_h_follows_the_measured_speeds_4_to_1_with_h_8_gives_8_and_2():
    dylu = DyLU()
    dylu.note("fast", 2.0, 8, 8)  # 8 steps in 2 s: 4 steps a second
    dylu.note("slow", 8.0, 8, 8)  # 8 steps in 8 s: 1 a second
    assert dylu.steps_for("fast", ["fast", "slow"]) == 8
    assert dylu.steps_for("slow", ["fast", "slow"]) == 2
    # its next push, 2 steps in 2 s, measures the same speed: the same H
    dylu.note("slow", 2.0, 2, 8)
    assert dylu.steps_for("slow", ["fast", "slow"]) == 2
    # 3:2:1 with H 6 -> 6, 4, 2; a worker not live no longer sizes the others
    dylu.note("mid", 2.0, 6, 8)  # 3 a second, under the fastest's 4
    assert [dylu.steps_for(w, ["fast", "mid", "slow"]) for w in ("fast", "mid", "slow")] == \
        [8, 6, 2]
    assert dylu.steps_for("mid", ["mid", "slow"]) == 8
    assert dylu.assigned == {"fast": 8, "mid": 8, "slow": 2}


def test_an_unmeasured_worker_runs_h():
    dylu = DyLU()
    dylu.note("fast", 1.0, 8, 8)
    dylu.note("new", 0.0, 8, 8)  # 0 s measures nothing
    assert dylu.steps_for("new", ["fast", "new"]) == 8
    assert dylu.steps_for("fast", ["fast", "new"]) == 8


def _state(mode="sync", workers=2, index=0):
    cfg = ShardConfig(index=index, start=0, end=4, rule="sgd", lr=1.0, consistency=mode,
                      expected_workers=workers, heartbeat_timeout=5.0)
    return ShardState(cfg, torch.zeros(4))


def _push(worker, seq, compute, steps=8, fastest=8, clock=0, shard=0):
    meta = {Key.COMPUTE: compute, Key.LOCAL_STEPS: steps, Key.AUTO_STEPS: fastest}
    return Message(type=PUSH, worker=worker, incarnation=1, seq=seq, clock=clock, shard=shard,
                   meta=meta, segments=[Segment(0, torch.ones(4))])


def _told(replies, kind=ACK):
    return {peer: r.meta.get(Key.LOCAL_STEPS) for peer, r in replies if r.type == kind}


def test_shard_0_answers_each_sync_worker_its_h_with_the_rounds_ack():
    state = _state()
    for w in (b"a", b"b"):
        state.handle(w, Message(type=PULL, worker=w.decode(), incarnation=1, seq=1), 0.0)
    assert state.handle(b"a", _push("a", 2, 2.0), 0.0) == []
    out = state.handle(b"b", _push("b", 2, 8.0), 0.0)
    assert _told(out) == {b"a": 8, b"b": 2}
    assert state.version == 1 and torch.equal(state.params, -torch.ones(4))
    assert state.stats(0.0)["local_steps"] == {"a": 8, "b": 2}


def test_shard_0_answers_an_async_worker_in_its_params_ack_and_other_shards_say_nothing():
    state = _state("async")
    first = state.handle(b"a", _push("a", 1, 2.0), 0.0)
    assert _told(first) == {b"a": 8}  # only worker measured: the fastest
    slow = dict(_push("b", 1, 8.0).meta, **{Key.PULL: True})
    out = state.handle(b"b", Message(type=PUSH, worker="b", incarnation=1, seq=1, shard=0,
                                     meta=slow, segments=[Segment(0, torch.ones(4))]), 0.0)
    (params,) = [r for _, r in out if r.type == PARAMS]
    assert params.meta[Key.ACK][Key.LOCAL_STEPS] == 2
    other = _state("async", index=1)
    assert Key.LOCAL_STEPS not in other.handle(b"a", _push("a", 1, 2.0, shard=1), 0.0)[0][1].meta
    assert other.stats(0.0)["local_steps"] == {}


@pytest.mark.parametrize("field, value", [
    (Key.COMPUTE, math.nan), (Key.COMPUTE, -1.0), (Key.COMPUTE, math.inf), (Key.COMPUTE, "1"),
    (Key.COMPUTE, True), (Key.LOCAL_STEPS, 0), (Key.LOCAL_STEPS, 2.0),
    (Key.AUTO_STEPS, 1 << 21), (Key.AUTO_STEPS, None)])
def test_a_malformed_dylu_field_refuses_the_push(field, value):
    state = _state("async")
    msg = _push("a", 1, 2.0)
    msg.meta[field] = value
    (_, reply), = state.handle(b"a", msg, 0.0)
    assert reply.type == ERROR and reply.meta[Key.CODE] == "bad-field"
    assert field in reply.meta[Key.ERROR]
    assert state.version == 0 and torch.equal(state.params, torch.zeros(4))
    assert state.dylu.speeds == {}


def test_a_push_asking_h_without_compute_is_refused_and_compute_alone_asks_nothing():
    state = _state("async")
    msg = _push("a", 1, 2.0)
    del msg.meta[Key.COMPUTE]
    assert state.handle(b"a", msg, 0.0)[0][1].type == ERROR
    plain = _push("a", 2, 2.0)
    plain.meta = {Key.COMPUTE: 2.0}
    (_, ack), = state.handle(b"a", plain, 0.0)
    assert ack.meta[Key.APPLIED] and Key.LOCAL_STEPS not in ack.meta


@pytest.mark.parametrize("text, parsed", [
    (4, (False, 4)), ("4", (False, 4)), ("auto", (True, 8)), ("auto:3", (True, 3))])
def test_parse_local_steps(text, parsed):
    assert parse_local_steps(text) == parsed


@pytest.mark.parametrize("text", ["0", "auto:0", "auto:", "fast", "auto:x", -1])
def test_a_bad_local_steps_is_a_clear_error(text):
    with pytest.raises(ConfigError, match="use a whole number H >= 1, auto or auto:H"):
        parse_local_steps(text)


def test_ddp_refuses_auto_local_steps():
    with pytest.raises(ConfigError, match="auto.* is for the parameter server's workers"):
        check_hooks(DDPConfig(local_steps="auto:8"), "gloo")


def test_a_real_4x_straggler_of_2_runs_a_quarter_of_the_local_steps(server, cli_env):
    """DiLoCo (sync) with --local-steps auto:8, rank 1 slowed 4x, every step 10 ms: shard 0
    measures 4:1 and sets H 8 and 2, as the server's evaluations record."""
    env = dict(cli_env, ASYNCSGD_TEST_STEP_SECONDS="0.01")
    srv = server("--task", "tasks_for_tests:slow_counter", "--samples", 4000, "--workers", 2,
                 "--consistency", "sync", "--optimizer", "nesterov", "--lr", 0.7,
                 "--momentum", 0.9, "--eval-every", 0.25)
    procs = [worker(env, srv.address, r, 2, "--task", "tasks_for_tests:slow_counter",
                    "--samples", 4000, "--local-steps", "auto:8", "--slowdown", "1:4",
                    "--max-seconds", 3) for r in range(2)]
    results = finish(procs, timeout=60)
    code, _, err = srv.wait()
    assert code == 0, err
    assert all(c == 0 for c, _, _ in results), results
    told = [{name[-3:]: steps for name, steps in e["local_steps"].items()}
            for e in read_events(srv.out) if "local_steps" in e]
    assert {"-r0": 8, "-r1": 2} in told, told
    assert "local_steps" in read_json(srv.out / "summary.json")


@pytest.mark.parametrize("mode", ["diloco:8", "diloco:auto:8"])
def test_on_the_virtual_clock_dylu_cuts_the_rounds_wait_for_a_4x_straggler(tmp_path, mode):
    """4 workers, steps of 1 ms, worker 3 four times slower. diloco:8: every round waits
    for its 8 x 4 ms, 37.4 ms between worker 0's pulls, 29.4 of them idle. diloco:auto:8: after
    the first round shard 0 sets H 8, 8, 8, 2, the straggler computes 8 ms as the others do,
    and rounds take 13.4 ms: the 24 ms it saved, exactly."""
    setup = _setup(workers=4, costs=_costs(slowdown=((3, 4.0),)), max_seconds=0.1)
    engine, result = _traced(tmp_path, mode, setup)
    pulls = [t / MS for what, t, rank, *_ in engine.trace if what == "pulled" and rank == 0]
    gaps = {round(b - a, 6) for a, b in zip(pulls[1:], pulls[2:])}  # after the first round
    if mode == "diloco:8":
        assert gaps == {37.4} and "local_steps" not in result.summary
    else:
        assert gaps == {13.4}
        assert result.summary["local_steps"] == {"sim-r0": 8, "sim-r1": 8, "sim-r2": 8,
                                                 "sim-r3": 2}


def test_a_forgotten_worker_leaves_nothing_behind():
    dylu = DyLU()
    for i in range(1000):  # a stream of names, each measured once
        dylu.note(f"w{i}", 0.01, 8, 8)
        dylu.steps_for(f"w{i}", [f"w{i}"])
        dylu.forget(f"w{i}")
    assert dylu.speeds == dylu.fastest == dylu.assigned == {}
