"""--balance batch on the parameter server, as plain objects: shard 0's batch sizing
(servers/balance.py), the weighted sync round, the shard's ``batch`` replies and the
network checks of a push's ``compute``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncsgd.config.modes import parse_modes
from asyncsgd.core.balance import global_slice
from asyncsgd.core.tasks import load_task
from asyncsgd.errors import ConfigError
from asyncsgd.servers.balance import Balancer
from asyncsgd.servers.consistency import make_policy
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.simulator import Costs, Link, StepTime, VirtualSetup
from asyncsgd.simulator.run import finish, prepare
from asyncsgd.wire.protocol import (ACK, PARAMS, PULL, PUSH, Code, Key, Message,
                                    ProtocolError, Segment, decode, encode)
from conftest import Server, read_events, read_json, worker
from conftest import finish as finish_procs


def test_equal_cuts_first_then_proportional_to_samples_per_second_every_k_rounds():
    bal = Balancer(per_worker=32, workers=2, every=4)
    assert bal.min_batch == 8, "0: a quarter of the per-worker batch"
    assert [bal.batch_of(w, ["b", "a"]) for w in "ab"] == [[32, 0, 64], [32, 32, 64]]
    bal.observe("a", 32, 0.1)  # 320 samples/s
    assert bal.round_closed(["a", "b"]) is False, "b not measured yet: the equal cut stays"
    bal.observe("b", 32, 0.4)  # 80: 4x slower, its injected wait included
    assert bal.round_closed(["a", "b"]) is True, "every worker measured: the first cut"
    # 64 x 320/400 = 51.2 and 64 x 80/400 = 12.8: 51 and 13 (the larger remainder, b's)
    assert [bal.batch_of(w, ["a", "b"]) for w in "ab"] == [[51, 0, 64], [13, 51, 64]]
    assert bal.report()["speeds"] == {"a": 320.0, "b": 80.0}
    bal.observe("a", 51, 0.1)  # 510 samples/s
    bal.observe("b", 13, 0.4)  # 32.5
    assert bal.round_closed(["a", "b"]) is False, "round 3 of every 4"
    assert bal.batch_of("b", ["a", "b"]) == [13, 51, 64], "fixed between re-sizings"
    assert bal.round_closed(["a", "b"]) is True
    # 64 x 32.5/542.5 = 3.8, below the minimum: b gets 8, a the other 56
    assert [bal.batch_of(w, ["a", "b"]) for w in "ab"] == [[56, 0, 64], [8, 56, 64]]
    assert bal.report()["batches"] == {"a": 56, "b": 8} and bal.report()["resizes"] == 3


def test_the_minimum_batch_bounds_a_very_slow_worker():
    bal = Balancer(per_worker=32, workers=2, every=1, min_batch=10)
    bal.batch_of("a", ["a", "b"])
    bal.observe("a", 32, 0.01)
    bal.observe("b", 32, 10.0)
    bal.round_closed(["a", "b"])
    assert [bal.batch_of(w, ["a", "b"]) for w in "ab"] == [[54, 0, 64], [10, 54, 64]]


def test_a_worker_leaving_or_joining_re_sizes_at_the_next_round():
    bal = Balancer(per_worker=16, workers=2, every=100)
    bal.batch_of("a", ["a", "b"])
    bal.observe("a", 16, 0.1)
    bal.observe("b", 16, 0.3)
    assert bal.round_closed(["a"]) is True, "b left"
    assert bal.batch_of("a", ["a"]) == [32, 0, 32]
    assert bal.batch_of("c", ["a"]) == [4, 0, 32], "joined mid-round: a minimum batch"
    assert bal.round_closed(["a", "c"]) is True
    # a measured 160 samples/s before; c not yet: counted as the mean of those measured
    assert [bal.batch_of(w, ["a", "c"]) for w in "ac"] == [[16, 0, 32], [16, 16, 32]]


def test_the_allocation_survives_a_checkpoint():
    bal = Balancer(per_worker=32, workers=2, every=2)
    bal.batch_of("a", ["a", "b"])
    bal.observe("a", 32, 0.1)
    bal.observe("b", 32, 0.4)
    bal.round_closed(["a", "b"])
    bal.round_closed(["a", "b"])
    bal.observe("a", 20, 0.5)
    again = Balancer(per_worker=32, workers=2, every=2)
    again.load_state_dict(bal.state_dict())
    assert again.state_dict() == bal.state_dict()
    assert [again.batch_of(w, ["a", "b"]) for w in "ab"] == [[51, 0, 64], [13, 51, 64]]


def test_a_step_slices_the_global_batch_of_its_epoch():
    # 10 rows, a global batch of 4: 2 whole steps an epoch, rows 8 and 9 wait
    assert global_slice(0, 10, 4, 0, 3) == (0, 0, 3)
    assert global_slice(1, 10, 4, 3, 1) == (0, 7, 8)
    assert global_slice(3, 10, 4, 1, 2) == (1, 5, 7)


def _worker(pushed=None):
    return SimpleNamespace(alive=True, round_pushed=pushed, pushes=0)


def test_the_weighted_round_is_the_big_batch_gradient():
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))

    def grad(rows):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        return torch.cat([model.weight.grad.flatten(), model.bias.grad]).clone()

    policy = make_policy("sync", size=18, expected_workers=3, weighted=True)
    workers = {n: _worker() for n in "abc"}
    for (name, record), (start, size) in zip(workers.items(), ((0, 41), (41, 16), (57, 7))):
        seg = SimpleNamespace(offset=0, data=grad(slice(start, start + size)))
        assert policy.push(record, [seg], 1, 0, 0, weight=size) == "gathered"
    update = policy.round_update(workers, 0)
    assert torch.allclose(update, grad(slice(0, 64)), atol=1e-6, rtol=0)
    assert (update - grad(slice(0, 64))).abs().max() < 1e-6


def test_balance_needs_sync_rounds_of_the_mean():
    with pytest.raises(ConfigError, match="needs --consistency sync and --sync-reduce mean"):
        make_policy("async", size=2, weighted=True)
    with pytest.raises(ConfigError, match="needs --consistency sync and --sync-reduce mean"):
        make_policy("sync", size=2, reduce="sum", weighted=True)


def _shard(index=0):
    cfg = ShardConfig(index=index, start=0, end=2, rule="sgd", lr=1.0, consistency="sync",
                      expected_workers=2, heartbeat_timeout=100.0, balance="batch",
                      balance_every=1, batch_size=8)
    return ShardState(cfg, torch.zeros(2))


def _push(state, name, grad, meta):
    msg = Message(type=PUSH, shard=state.cfg.index, worker=name, incarnation=1, seq=1,
                  clock=state.version, meta={Key.PULL: True, **meta},
                  segments=[Segment(0, torch.tensor(grad))])
    return state.handle(name.encode(), msg, 1.0)


def test_shard_0_tells_each_worker_its_batch_and_weighs_the_round_by_samples():
    state = _shard()
    for name in "ab":
        replies = state.handle(name.encode(), Message(type=PULL, worker=name, incarnation=1,
                                                      seq=0), 0.0)
    batches = {p.decode(): r.meta[Key.BATCH] for p, r in replies if r.type == PARAMS}
    assert batches == {"a": [8, 0, 16], "b": [8, 8, 16]}
    assert _push(state, "a", [1.0, 0.0], {Key.SAMPLES: 12, Key.COMPUTE: 0.1}) == []
    replies = _push(state, "b", [0.0, 4.0], {Key.SAMPLES: 4, Key.COMPUTE: 0.4})
    # (12 x [1, 0] + 4 x [0, 4]) / 16, lr 1
    assert state.params.tolist() == [-0.75, -1.0]
    # a: 120 samples/s, b: 10 -> 16 x 12/13 = 14.8 and 1.2, b held at the minimum 2
    batches = {p.decode(): r.meta[Key.BATCH] for p, r in replies if r.type == PARAMS}
    assert batches == {"a": [14, 0, 16], "b": [2, 14, 16]}
    assert state.stats(1.0)["balance"]["batches"] == {"a": 14, "b": 2}
    assert state.state_dict()["balance"]["sizes"] == {"a": 14, "b": 2}


def test_other_shards_weigh_rounds_alike_and_say_no_batch():
    state = _shard(index=1)
    for name in "ab":
        replies = state.handle(name.encode(), Message(type=PULL, worker=name, incarnation=1,
                                                      seq=0), 0.0)
    assert all(Key.BATCH not in r.meta for _, r in replies)
    _push(state, "a", [1.0, 0.0], {Key.SAMPLES: 3})
    _push(state, "b", [0.0, 4.0], {Key.SAMPLES: 1})
    assert state.params.tolist() == [-0.75, -1.0]


def test_a_balanced_push_without_its_samples_is_refused():
    state = _shard()
    for name in "ab":
        state.handle(name.encode(), Message(type=PULL, worker=name, incarnation=1, seq=0), 0.0)
    (_, reply), = _push(state, "a", [1.0, 0.0], {})
    assert reply.meta[Key.CODE] == Code.BAD_FIELD and state.counters["rejected"] == 1
    assert all(r.type != ACK for _, r in _push(state, "a", [1.0, 0.0], {Key.SAMPLES: 0}))


@pytest.mark.parametrize("compute", [float("nan"), float("inf"), -0.5, "1", True, None])
def test_a_push_whose_compute_is_not_finite_seconds_is_malformed(compute):
    msg = Message(type=PUSH, shard=0, worker="a", incarnation=1, seq=1,
                  meta={Key.SAMPLES: 4, Key.COMPUTE: compute},
                  segments=[Segment(0, torch.zeros(2))])
    with pytest.raises(ProtocolError, match="'m.compute' of a push must be a finite number"):
        decode(encode(msg))
    msg.meta[Key.COMPUTE] = 0.25
    assert decode(encode(msg)).meta[Key.COMPUTE] == 0.25


def test_a_4x_straggler_gets_a_fifth_of_the_global_batch_in_a_real_run(cli_env, tmp_path):
    """ps-sync --balance batch, 2 workers of 32 each (a global batch of 64), worker 1 4x
    slow. Every step of slow_counter sleeps 10 ms whatever its batch, so the re-sizing
    after round 1 measures 4x the samples per second on worker 0 and gives worker 1 a fifth
    of 64, about 13; with --balance-every 100 that cut lasts to the end of the epoch, 31
    whole global batches of its 2,000 rows, every one trained: 31 x 64 samples."""
    env = dict(cli_env, ASYNCSGD_TEST_STEP_SECONDS="0.01")
    srv = Server(env, tmp_path / "run", "--task", "tasks_for_tests:slow_counter",
                 "--workers", 2, "--consistency", "sync", "--balance", "batch",
                 "--batch-size", 32, "--balance-every", 100, "--max-seconds", 60)
    try:
        procs = [worker(env, srv.address, r, 2, "--task", "tasks_for_tests:slow_counter",
                        "--epochs", 1, "--slowdown", "1:4") for r in range(2)]
        code, _, err = srv.wait(timeout=120)
        results = finish_procs(procs, timeout=60)
    finally:
        srv.close()
    assert code == 0, err
    assert all(r[0] == 0 for r in results), [r[2] for r in results]
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["stopped_by"] == "workers_done", summary["stopped_by"]
    balance = summary["balance"]
    batches = {name[-2:]: size for name, size in balance["batches"].items()}
    assert balance["resizes"] == 2 and sum(batches.values()) == 64, balance
    assert 10 <= batches["r1"] <= 16, balance
    assert (summary["updates"], summary["samples"]) == (31, 31 * 64), summary
    # one epoch of whole global batches: 1,984 rows once, the 16 the epoch leaves never
    assert summary["coverage"]["max"] == 1 and summary["coverage"]["spread"] is None
    assert summary["coverage"]["mean"] == 31 * 64 / 2000, summary["coverage"]
    evals = [e for e in read_events(tmp_path / "run") if e["event"] == "eval"]
    assert any("batches" in e for e in evals), evals[-1]


def test_on_the_virtual_clock_balance_recovers_a_4x_stragglers_cost(tmp_path):
    """4 workers of 1 ms steps (16 samples), worker 3 4x slow: ps-sync waits for it every
    round; balanced, it takes 5 of the 64 samples and a round costs 1.25 ms, so the time to
    the target is within 1.35x of unslowed ps-sync's (the bound: 64 / 52 samples a ms, 1.23x)."""
    task = load_task("tasks_for_tests:regression")
    times = {}
    for mode, slow in (("ps-sync", ()), ("ps-sync", ((3, 4.0),)),
                       ("ps-sync+balance", ((3, 4.0),))):
        costs = Costs(StepTime(1e-3, 0.0), Link(1e9, 1e-5), 1e-10, 1000, slowdown=slow)
        setup = VirtualSetup(workers=4, seed=0, costs=costs, epochs=1000, eval_every=0.0025,
                             max_seconds=1.0, target=0.003, stop_at_target=True)
        out = tmp_path / f"{mode}-{len(slow)}"
        result = finish(prepare(task, parse_modes(mode)[0], setup, str(out), progress="off"))
        times[mode, bool(slow)] = result.summary["time_to_target"]
    base = times["ps-sync", False]
    assert times["ps-sync", True] > 3 * base, times
    assert times["ps-sync+balance", True] <= 1.35 * base, times


def test_a_forgotten_worker_leaves_no_measure_behind():
    balancer = Balancer(32, 2)
    for i in range(1000):  # a stream of names pushing between two sizings
        balancer.observe(f"w{i}", 32, 0.01)
        balancer.forget(f"w{i}")
    assert balancer.window == {}


def test_a_worker_asked_for_auto_local_steps_under_a_balancing_server_is_refused(cli_env,
                                                                                tmp_path):
    """Each push of a balanced round is one batch's gradient: a worker given --local-steps
    auto:H is refused with the fix as a number above 1 is, not left to push H steps' worth
    (the refusal once compared the text 'auto:4' with 1)."""
    srv = Server(cli_env, tmp_path / "run", "--workers", 1, "--consistency", "sync",
                 "--balance", "batch", "--max-seconds", 60)
    try:
        [(code, _, err)] = finish_procs([worker(cli_env, srv.address, 0, 1,
                                                "--local-steps", "auto:4")], timeout=60)
    finally:
        srv.close()
    assert code == 2 and "drop --local-steps and --push-every" in err, (code, err)
