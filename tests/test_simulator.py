"""The virtual clock's engine, without processes or sockets: its scheduler, cost models and
exact oracles for what it computes (a sync round's mean, the order of async applies, the
virtual times of a 3-worker schedule worked out by hand, determinism)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from asyncsgd.config.modes import parse_modes
from asyncsgd.core.signature import PS_PARTITION_SEED
from asyncsgd.core.tasks import epoch_order, load_task, partition_indices
from asyncsgd.errors import ConfigError
from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.simulator import (Costs, Link, StepTime, VirtualSetup, parse_duration, parse_rate,
                                parse_size, simulate_run)
from asyncsgd.simulator.run import finish, prepare
from asyncsgd.simulator.events import Scheduler
from asyncsgd.simulator.simulate import check_modes
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import PUSH, Message, Segment

TASK = "tasks_for_tests:regression"
MS = 1e-3


def _costs(step=1 * MS, sigma=0.0, nbytes=1000, bandwidth=1e6, latency=0.1 * MS, apply=2e-7,
           **kw) -> Costs:
    """By default a push of 1,000 bytes takes 1 ms on the link and 0.2 ms to apply."""
    return Costs(StepTime(step, sigma), Link(bandwidth, latency), apply, nbytes, **kw)


def _setup(workers=3, **kw) -> VirtualSetup:
    return VirtualSetup(**{**dict(workers=workers, seed=0, costs=_costs(), epochs=1000,
                                  eval_every=1.0), **kw})


def test_the_scheduler_orders_by_time_then_by_insertion():
    s = Scheduler()
    for t, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")]:
        s.at(t, name)
    assert [s.pop()[1] for _ in range(5)] == ["first", "a", "b", "c", "d"]
    assert s.now == 2.0 and len(s) == 0
    with pytest.raises(ValueError, match="in the past"):
        s.at(1.0, "late")


@pytest.mark.parametrize("text, seconds", [("120ms", 0.12), ("20us", 2e-5), ("1.5s", 1.5),
                                           ("3", 3.0), ("500ns", 5e-7)])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


def test_sizes_rates_and_step_times():
    assert parse_size("100MB") == 100_000_000 and parse_size("4KiB") == 4096
    assert parse_size("512") == 512 and parse_size("1.5GiB") == 3 * 2 ** 29
    assert parse_rate("25gbit") == pytest.approx(25e9 / 8)
    assert parse_rate("100mbit") == pytest.approx(12.5e6)
    assert parse_rate("3GB/s") == pytest.approx(3e9)
    assert StepTime.parse("2ms") == StepTime(0.002)
    assert StepTime.parse("lognormal:2ms:0.5") == StepTime(0.002, 0.5)
    for bad, parse in [("fast", parse_duration), ("10 parsecs", parse_size),
                       ("0gbit", parse_rate), ("lognormal:2ms", StepTime.parse),
                       ("lognormal:2ms:-1", StepTime.parse), ("0ms", StepTime.parse)]:
        with pytest.raises(ConfigError, match="e.g."):
            parse(bad)


def test_a_ring_all_reduce_costs_2_n_minus_1_steps():
    link = Link(bandwidth=1e9, latency=20e-6)
    # 2(N-1)/N x bytes / bandwidth + 2(N-1) x latency
    assert link.ring_allreduce(100e6, 4) == pytest.approx(2 * 3 / 4 * 0.1 + 6 * 20e-6)
    assert link.ring_allreduce(100e6, 1) == 0.0
    assert link.transfer(1e9) == pytest.approx(1.0 + 20e-6)


def _traced(tmp_path, mode, setup, name="run"):
    engine = prepare(load_task(TASK), parse_modes(mode)[0], setup, out=str(tmp_path / name),
                     progress="off")
    engine.trace = []
    result = finish(engine)
    return engine, result


def test_three_workers_meet_the_virtual_times_worked_out_by_hand(tmp_path):
    """Steps of 1, 2 and 3 ms; 0.1 ms latency; a push (or a reply) takes 1 ms on the
    server's link and 0.2 ms to apply.

    Pulls reach the server at 0.1; its replies leave one after another (0.1-1.1, 1.1-2.1,
    2.1-3.1) and arrive 0.1 later: 1.2, 2.2, 3.2. Worker 0 pushes at 2.2: in by 3.3,
    applied 3.5, its reply on the link 3.5-4.5, back at 4.6. Worker 1 pushes at 4.2: in by
    5.3, applied 5.5, back at 6.6. Worker 0 again at 5.6: in by 6.7, applied 6.9, back at
    8.0. Worker 2 pushes at 6.2, but the link is busy with worker 0's push until 6.7: in
    by 7.7, applied 7.9 (staleness 3: three updates since its pull), back at 9.0."""
    setup = _setup(costs=_costs(slowdown=((1, 2.0), (2, 3.0))), max_seconds=9.5 * MS)
    engine, _ = _traced(tmp_path, "ps-async", setup)
    ms = [(what, round(t / MS, 6), *rest) for what, t, *rest in engine.trace]
    assert [m for m in ms if m[0] == "apply"] == [
        ("apply", 3.5, 0, 0), ("apply", 5.5, 1, 1), ("apply", 6.9, 0, 1), ("apply", 7.9, 2, 3)]
    assert [m for m in ms if m[0] == "pulled"] == [
        ("pulled", 1.2, 0), ("pulled", 2.2, 1), ("pulled", 3.2, 2), ("pulled", 4.6, 0),
        ("pulled", 6.6, 1), ("pulled", 8.0, 0), ("pulled", 9.0, 2)]


def test_async_applies_happen_in_the_order_pushes_arrive(tmp_path):
    """Lognormal steps: applies come out in time order, each push's staleness is the
    number of updates since the version it pulled, and the histogram counts them all."""
    setup = _setup(workers=5, costs=_costs(sigma=1.0), max_seconds=0.05)
    engine, result = _traced(tmp_path, "ps-async", setup)
    applies = [e for e in engine.trace if e[0] == "apply"]
    assert len(applies) > 20
    assert [t for _, t, *_ in applies] == sorted(t for _, t, *_ in applies)
    hist = [0] * 64
    for *_, staleness in applies:
        hist[staleness] += 1
    assert result.summary["staleness_hist"] == hist
    assert result.summary["updates"] == len(applies)


def test_a_sync_round_is_the_mean_of_the_workers_gradients_bit_for_bit(tmp_path):
    """3 workers, one batch each (48 samples, batch 16): the one round ps-sync applies
    equals a ShardState given the same three gradients by hand."""
    task = load_task(TASK, samples=48)
    model = task.build_model(0)
    layout = Layout.of(model)
    flat, grads = torch.zeros(layout.total), torch.zeros(layout.total)
    layout.bind(model, flat, grads)
    start = flat.clone()
    by_hand = ShardState(ShardConfig(index=0, start=0, end=layout.total, lr=task.lr,
                                     consistency="sync", expected_workers=3), start)
    pushes = []
    for rank in range(3):
        part = partition_indices(len(task.train), 3, rank, PS_PARTITION_SEED)
        inputs, targets = task.train.rows(epoch_order(part, 0, rank, 0)[:16])
        grads.zero_()
        task.loss_fn(model(*inputs), targets).backward()
        pushes.append(grads.clone())
    for rank, grad in enumerate(pushes):
        by_hand.handle(b"%d" % rank, Message(type=PUSH, worker=f"w{rank}", incarnation=1, seq=1,
                                             shard=0, segments=[Segment(0, grad)]), 0.0)
    assert by_hand.version == 1
    spec = parse_modes("ps-sync")[0]
    result = simulate_run(task, spec, _setup(epochs=1), out=str(tmp_path / "sync"),
                          progress="off")
    assert result.summary["updates"] == 1
    saved = load_checkpoint(tmp_path / "sync" / "checkpoint.pt")["model"]
    assert torch.equal(torch.cat([saved[s.name].reshape(-1) for s in layout.specs]),
                       by_hand.params)


def test_a_ddp_round_lasts_the_slowest_step_plus_the_ring(tmp_path):
    """Steps of 1, 2, 3 ms and a ring of 1,000 bytes among 3 at 1 MB/s and 0.1 ms:
    3 + 2*2/3*1 + 4*0.1 = 4.7333 ms a round."""
    setup = _setup(costs=_costs(slowdown=((1, 2.0), (2, 3.0))), max_seconds=10 * MS)
    engine, _ = _traced(tmp_path, "ddp", setup)
    assert [round(t / MS, 4) for _, t, _ in engine.trace] == [4.7333, 9.4667]


def test_the_same_seed_gives_the_same_run_and_another_seed_another(tmp_path):
    setup = _setup(workers=4, costs=_costs(sigma=0.5), max_seconds=0.03, eval_every=0.005)
    spec = parse_modes("ps-ssp:1")[0]
    runs = []
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        simulate_run(load_task(TASK), spec, VirtualSetup(**{**setup.__dict__, "seed": seed}),
                     out=str(tmp_path / name), progress="off")
        evals = [(e["t"], e["samples"], e["loss"]) for e in map(
            json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if e["event"] == "eval"]
        runs.append((evals, load_checkpoint(tmp_path / name / "checkpoint.pt")["model"]))
    (ea, ma), (eb, mb), (ec, _) = runs
    assert len(ea) >= 6 and ea == eb and ea != ec
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_the_run_directory_says_virtual_and_reads_like_any_run(tmp_path):
    from asyncsgd.run.reader import Run
    result = simulate_run(load_task(TASK), parse_modes("diloco:4")[0],
                          _setup(max_seconds=0.02, eval_every=0.005), out=str(tmp_path / "r"),
                          progress="off")
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["clock"] == "virtual" and config["config"]["local_steps"] == 4
    assert result.summary["clock"] == "virtual" and result.summary["stopped_by"] == "max_seconds"
    run = Run.read(tmp_path / "r")
    assert run.events[0]["clock"] == "virtual" and run.events[-1]["t"] == pytest.approx(0.02)


def test_what_is_not_simulated_is_refused_by_name(tmp_path):
    for mode in ("ddp+fp16", "ps-async+int8", "ddp-local:4"):
        with pytest.raises(ConfigError, match=re.escape(f"does not model {mode};")):
            simulate_run(load_task(TASK), parse_modes(mode)[0], _setup(), out=str(tmp_path))
    with pytest.raises(ConfigError, match="--leave names rank 7"):
        simulate_run(load_task(TASK), parse_modes("ps-async")[0], _setup(leave=((0.1, 7),)),
                     out=str(tmp_path))
    # simulate's up-front check, before anything runs: the same verdicts, balancing modelled
    check_modes(parse_modes("ps-async+dynamic,ps-sync+balance,ddp+balance,diloco:auto:8"))
    for mode in ("ps-async+int8", "ddp+fp16"):
        with pytest.raises(ConfigError, match=re.escape(f"does not model {mode} ")):
            check_modes(parse_modes(mode))


def test_a_diverging_run_fails_with_its_cause_and_keeps_what_it_recorded(tmp_path):
    """An lr far too large: the server refuses the first NaN gradient, as a real one does;
    the run ends failed, saying when and what to try, with its directory written."""
    from asyncsgd.errors import WorkerError
    with pytest.raises(WorkerError, match=r"diverged at .* virtual s: .*try a smaller --lr"):
        simulate_run(load_task(TASK), parse_modes("ps-async")[0],
                     _setup(lr=1e30, max_seconds=1.0, eval_every=0.01),
                     out=str(tmp_path / "r"), progress="off")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "failed" and "diverged" in summary["error"]


def test_a_worker_that_leaves_stops_holding_up_sync_rounds(tmp_path):
    """ps-sync with 3 workers, worker 2 ten times slower, leaving at 20 ms in the middle of
    its second step (lost). Before, worker 0's pushes were 11.4 ms apart, held by worker 2;
    after its bye, 4.4 ms: worker 1's push applied 1 ms after worker 0's ends the round,
    worker 0's reply takes 1 + 0.1 ms, its step 1 ms, its push 0.1 + 1 ms in, 0.2 to apply."""
    setup = _setup(costs=_costs(slowdown=((2, 10.0),)), leave=((0.02, 2),), max_seconds=0.06)
    engine, result = _traced(tmp_path, "ps-sync", setup)
    applies = {rank: [round(t / MS, 6) for what, t, r, *_ in engine.trace
                      if what == "apply" and r == rank] for rank in range(3)}
    assert applies[2] == [12.5]  # its second step was lost when it left
    gaps = [round(b - a, 6) for a, b in zip(applies[0], applies[0][1:])]
    assert gaps[0] == 11.4 and set(gaps[2:]) == {4.4}
    assert result.summary["workers"] == 3


def test_staleness_past_the_shards_histogram_is_counted_in_full(tmp_path):
    """70 async workers see staleness near 69: the shard's histogram stops at 63, the
    summary's percentiles and mean come from every push's own staleness, as traced."""
    setup = _setup(workers=70, costs=_costs(nbytes=10, apply=0.0), max_seconds=8 * MS)
    engine, result = _traced(tmp_path, "ps-async", setup)
    seen = sorted(e[3] for e in engine.trace if e[0] == "apply")
    assert seen[-1] > 63
    assert result.summary["staleness_p50"] == seen[(len(seen) - 1) // 2]
    assert result.summary["staleness_mean"] == pytest.approx(sum(seen) / len(seen))
    assert sum(result.summary["staleness_hist"]) == len(seen)


def test_dc_asgd_compensates_stale_pushes_only(tmp_path):
    """ps-dc-asgd is ps-async with the shard's delay compensation (lambda 0.04): one
    worker is never stale, so its run equals ps-async's bit for bit; three workers are,
    so theirs differs, and every push was compensated against the worker's own pull."""
    def final(mode, workers):
        name = f"{mode}-{workers}"
        engine, _ = _traced(tmp_path, mode, _setup(workers=workers, max_seconds=20 * MS),
                            name=name)
        return engine, engine.params().clone()

    _, alone_async = final("ps-async", 1)
    dc_engine, alone_dc = final("ps-dc-asgd", 1)
    assert dc_engine.state.cfg.dc_lambda == 0.04
    assert torch.equal(alone_async, alone_dc)
    _, three_async = final("ps-async", 3)
    dc_engine, three_dc = final("ps-dc-asgd", 3)
    assert dc_engine.state.counters["dc_uncompensated"] == 0
    assert any(e[3] > 0 for e in dc_engine.trace if e[0] == "apply")
    assert not torch.equal(three_async, three_dc)


def test_ddp_balance_sizes_batches_to_speed_and_rounds_shrink_to_the_fair_time(tmp_path):
    """4 ranks of 1 ms steps of 16 rows, rank 3 slowed 4x; the ring takes 2*3/4*1 + 6*0.1 =
    2.1 ms. Equal batches for 20 rounds: 4 + 2.1 ms each. Then speeds of 16,000, 16,000,
    16,000 and 4,000 rows/s size the global 64 as 20, 20, 19, 5 (19.69 x 3 and 4.92,
    largest remainders first), and a round takes max(20/16 x 1, 5/16 x 4) + 2.1 = 3.35 ms."""
    setup = _setup(workers=4, costs=_costs(slowdown=((3, 4.0),)), max_seconds=0.16)
    engine, result = _traced(tmp_path, "ddp+balance", setup)
    ends = [t for _, t, _ in engine.trace]
    steps = [round((b - a) / MS, 6) for a, b in zip([0.0] + ends, ends)]
    assert steps[:20] == [6.1] * 20 and steps[20:30] == [3.35] * 10
    assert result.summary["balance"]["batches"] == [20, 20, 19, 5]
    assert result.summary["balance"]["changes"] == [[20, [20, 20, 19, 5]]]
    assert result.summary["samples"] == 64 * len(steps)
    # the ranks slice one global order: each row's own count, every row once an epoch
    rows = len(engine.row_counts)
    # (counted as computed: the round in flight when the budget ran out is in)
    assert int(engine.row_counts.sum()) - result.summary["samples"] in (0, 64)
    assert engine.coverage()["granularity"] == "sample"
    assert engine.row_counts.max() - engine.row_counts.min() <= 1 + (rows % 64 > 0)


def test_the_virtual_clock_accumulates_and_clips_as_the_real_modes(tmp_path):
    """ps-sync, one round of 3 workers: --accumulate 2 of batch 8 pushes the gradients of
    batch 16 (to float rounding) in twice the steps' time; --clip-grad-norm bounds them."""
    task = load_task(TASK, samples=48)
    spec = parse_modes("ps-sync")[0]
    saved = {}
    for name, kw in [("big", dict(batch_size=16)), ("acc", dict(batch_size=8, accumulate=2)),
                     ("clip", dict(batch_size=16, clip_grad_norm=1e-3))]:
        engine = prepare(task, spec, _setup(epochs=1, **kw), out=str(tmp_path / name),
                         progress="off")
        engine.trace = []
        assert finish(engine).summary["updates"] == 1
        saved[name] = torch.cat([t.reshape(-1) for t in load_checkpoint(
            tmp_path / name / "checkpoint.pt")["model"].values()])
        if name == "acc":
            assert engine.step_time(engine.workers[0]) == 2 * MS
    assert torch.allclose(saved["acc"], saved["big"], rtol=0, atol=1e-6)
    start = torch.cat([t.reshape(-1) for t in task.build_model(0).state_dict().values()])
    moved = (saved["clip"] - start).norm().item()
    assert moved <= task.lr * 1e-3 * (1 + 1e-4) < (saved["big"] - start).norm().item()
