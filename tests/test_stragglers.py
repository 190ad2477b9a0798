"""Stragglers on purpose (``--slowdown``, ``--delay``; core.pacing), the same in every mode.

Every step of ``tasks_for_tests:slow_counter`` sleeps STEP seconds in its forward: a
compute time that does not depend on how busy the machine is. A rank slowed 4x then
takes about 4 x STEP per step, measured from the run's metrics (event times and step
counts), not from the wait itself. DDP and the sync parameter server follow their
slowest rank; Hogwild's and the async server's fast ranks do not wait.
"""

import re
import subprocess

import pytest
import torch

from asyncsgd.core.pacing import Pacer, Pacing, parse_delay, parse_slowdown
from asyncsgd.errors import ConfigError
from asyncsgd.wire.protocol import ACK, PARAMS, PULL, Key
from conftest import Server, asyncsgd_cmd, finish, read_events, read_json, worker
from faults import record_figure
from test_exactly_once import TASK as COUNTER, Peer

# They time steps against each other: make test runs them alone, after the rest
pytestmark = pytest.mark.solo

STEP = 0.01
TASK = ("--task", "tasks_for_tests:slow_counter", "--epochs", 1_000_000, "--progress", "off")
SLOW = 4


@pytest.fixture
def slow_env(cli_env):
    return dict(cli_env, ASYNCSGD_TEST_STEP_SECONDS=str(STEP))


def _run(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run(asyncsgd_cmd(*args), env=env, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)


def _per_step(events: list, worker) -> float:
    """Seconds per step of ``worker`` from its train events, its first one (start-up)
    left out."""
    mine = [e for e in events if e["event"] == "train" and e["worker"] == worker]
    assert len(mine) >= 3, mine
    steps = sum(e["steps"] for e in mine[1:])
    return (mine[-1]["t"] - mine[0]["t"]) / steps


def _compute_per_step(events: list, worker) -> float:
    mine = [e for e in events if e["event"] == "train" and e["worker"] == worker][1:]
    return sum(e["compute_s"] for e in mine) / sum(e["steps"] for e in mine)


def test_specs_parse_or_say_what_is_wrong():
    assert parse_slowdown("1:4,3:2.5") == ((1, 4.0), (3, 2.5))
    assert parse_delay("exp:20ms") == {"delay_kind": "exp", "delay_mean": 0.02,
                                       "delay_ranks": None}
    assert parse_delay("const:0.5s@1, 2")["delay_ranks"] == {1, 2}
    pacing = Pacing.parse("1:4,3:2", "exp:20ms@0,3")
    assert pacing.describe() == ("rank 1 4x slower, rank 3 2x slower, Exp(mean 20 ms) delay "
                                 "per step on rank(s) 0,3")
    assert pacing.flags(2) == ["--slowdown", "1:4", "--delay", "exp:0.02s@0"]
    assert pacing.flags(1) == ["--delay", "exp:0.02s@0"]  # single: rank 0 alone
    assert Pacing.parse("1:4", "exp:1ms@1").flags(1) == []
    for bad, words in [("1", "RANK:FACTOR"), ("1:0.5", "below 1"), ("1:2,1:3", "twice"),
                       ("a:2", "RANK:FACTOR")]:
        with pytest.raises(ConfigError, match=words):
            parse_slowdown(bad)
    for bad in ("exp", "gauss:1ms", "exp:5", "exp:5ms@x"):
        with pytest.raises(ConfigError, match="--delay"):
            parse_delay(bad)
    with pytest.raises(ConfigError, match=r"rank\(s\) 3, but --procs runs 2 process\(es\)"):
        pacing.check_ranks(2, "--procs")


def test_delays_are_seeded_per_rank_and_have_the_mean_asked():
    pacing = Pacing.parse(None, "exp:0.2ms")

    def draws(seed, rank):
        pacer = Pacer(pacing, rank, seed)
        return [pacer.rng.expovariate(1 / pacer.mean) for _ in range(4000)]

    assert draws(0, 1) == draws(0, 1)
    assert draws(0, 1) != draws(0, 2) and draws(0, 1) != draws(1, 1)
    mean = sum(draws(0, 0)) / 4000
    assert 0.00018 < mean < 0.00022  # 4000 exponential draws: within 3 standard errors
    pacer = Pacer(pacing, 0, 0)
    for _ in range(20):
        pacer.begin()
        pacer.end()
    assert pacer.steps == 20 and pacer.waited > 20 * 0.0001


def test_bad_straggler_flags_are_one_clear_line(run_cli_here, tmp_path):
    res = run_cli_here("hogwild", "--slowdown", "1:0.5", "--out", tmp_path / "a")
    assert res.returncode == 2 and "below 1" in res.stderr, res.stderr
    for mode in ("hogwild", "ddp"):
        res = run_cli_here(mode, "--procs", 2, "--slowdown", "5:2", *TASK,
                           "--out", tmp_path / mode)
        assert res.returncode != 0 and "rank(s) 5, but --procs runs 2" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and not (tmp_path / mode).exists()
    res = run_cli_here("single", "--delay", "exp:1ms@1", *TASK, "--out", tmp_path / "single")
    assert res.returncode != 0 and "but single runs 1 process(es): rank(s) 0..0" in res.stderr
    for args in (("--workers", 2), ("--workers", 2, "--consistency", "sync", "--backup-workers",
                                    2)):
        res = run_cli_here("ps-server", "--backup-workers", 1, *args, "--out", tmp_path / "c")
        assert res.returncode != 0 and "needs --consistency sync" in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_hogwild_single_and_ddp_ranks_take_their_pace(slow_env, tmp_path):
    """Hogwild: rank 1 slowed 4x takes 4x per step, rank 0 does not wait. single: 4x.
    DDP: every step waits for the slowed rank."""
    figures = {}
    # Stopped by epochs, not by a time budget: on a busy machine DDP's ranks once took 7 s
    # of a 10 s budget to start, leaving too few steps to measure. 8 rows a step: hogwild's
    # rank 0 takes 378 steps (~4 s), its rank 1 4x as long; single and ddp 125 slowed steps.
    for mode, args in [("hogwild", ("--procs", 2, "--samples", 1000, "--epochs", 6)),
                       ("single", ("--samples", 1000, "--epochs", 1)),
                       ("ddp", ("--procs", 2, "--samples", 2000, "--epochs", 1))]:
        out = tmp_path / mode
        slowed = 0 if mode == "single" else 1
        res = _run(slow_env, mode, *TASK, *args, "--threads", 1, "--slowdown",
                   f"{slowed}:{SLOW}", "--max-seconds", 120, "--eval-every", 0.5, "--out", out,
                   "--progress", "log")
        assert res.returncode == 0, res.stderr
        assert re.search(r"\| step time: \d+% computing, \d+% waited on purpose, \d+% "
                         r"communicating and other\n", res.stderr), res.stderr
        events, summary = read_events(out), read_json(out / "summary.json")
        pace = summary["pacing"]
        assert pace["slowdown"] == {str(slowed): SLOW}
        ranks = pace["ranks"]
        waited, computed = ranks[slowed]["waited_seconds"], ranks[slowed]["compute_seconds"]
        assert 2.7 < waited / computed < 3.3, ranks  # (4 - 1) x what it computed
        if mode == "hogwild":
            fast, slow = _per_step(events, 0), _per_step(events, 1)
            assert ranks[0]["waited_seconds"] == 0
            # the fast rank's time is its own: little beyond computing
            assert ranks[0]["other_seconds"] < 0.6 * ranks[0]["compute_seconds"], ranks
            assert slow / _compute_per_step(events, 1) > 3.3
            assert fast / _compute_per_step(events, 0) < 1.6  # rank 0 never waits for rank 1
            assert 2.8 < slow / fast < 5.5, (slow, fast)
            figures[mode] = {"fast_ms": round(fast * 1e3, 1), "slowed_ms": round(slow * 1e3, 1)}
        else:  # one train event per step group: its compute is the mean over ranks
            if mode == "ddp":  # rank 0 waits in the all-reduce for the slowed rank 1
                assert ranks[0]["other_seconds"] > 2 * ranks[0]["compute_seconds"], ranks
            group = _per_step(events, 0)
            ratio = group / _compute_per_step(events, 0)
            assert 3.0 < ratio < 5.5, (group, ratio)
            assert group > SLOW * STEP * 0.9
            figures[mode] = {"step_ms": round(group * 1e3, 1)}
    record_figure(f"rank slowed {SLOW}x, {STEP * 1e3:g} ms steps", **figures)


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_ps_sync_follows_the_slowest_worker_and_async_does_not(slow_env, tmp_path,
                                                               consistency):
    srv = Server(slow_env, tmp_path / "run", "--task", TASK[1], "--workers", 2,
                 "--consistency", consistency, "--max-seconds", 12)
    try:
        procs = [worker(slow_env, srv.address, r, 2, *TASK, "--slowdown", f"1:{SLOW}")
                 for r in range(2)]
        code, _, err = srv.wait(timeout=120)
        results = finish(procs, timeout=60)
    finally:
        srv.close()
    assert code == 0, err
    for w_code, out, w_err in results:
        assert w_code == 0, w_err
    assert re.search(r"s computing gradients, \d+\.\d s waited on purpose", results[1][1])
    assert "waited on purpose" not in results[0][1]
    events = read_events(tmp_path / "run")
    names = {e["worker"] for e in events if e["event"] == "train"}
    fast = _per_step(events, next(n for n in names if n.endswith("-r0")))
    slow = _per_step(events, next(n for n in names if n.endswith("-r1")))
    if consistency == "async":
        assert 2.8 < slow / fast < 5.5, (slow, fast)  # the fast worker does not wait
    else:
        assert 0.8 < slow / fast < 1.25, (slow, fast)  # every round waits for the slowest
        assert fast > SLOW * STEP * 0.9
    record_figure(f"ps-{consistency}: worker 1 slowed {SLOW}x, {STEP * 1e3:g} ms steps",
                  fast_ms=round(fast * 1e3, 1), slowed_ms=round(slow * 1e3, 1))


def test_compare_stages_the_same_stragglers_in_every_mode(tmp_path):
    """Each mode's command carries the stragglers; single, one process, gets rank 0's."""
    from asyncsgd.comparison.mode_run import ModeRun
    from asyncsgd.config.modes import parse_modes
    from asyncsgd.config import CompareConfig

    cfg = CompareConfig(procs=2, slowdown="1:4", delay="exp:20ms@0,1")
    flags = {}
    for spec in parse_modes("single,hogwild,ddp,ps-async,ps-backup"):
        run = ModeRun(cfg, spec, 0, tmp_path, {}, shown=None)
        flags[spec.name] = run.command() if spec.command != "ps-server" else \
            run.worker_command("tcp://127.0.0.1:1", 1)
    for mode in ("hogwild", "ddp", "ps-async"):
        assert " --slowdown 1:4 --delay exp:0.02s@0,1" in " ".join(flags[mode]), flags[mode]
    assert "--slowdown" not in flags["single"]
    assert " --consistency sync --backup-workers 1 " in " ".join(
        ModeRun(cfg, parse_modes("ps-backup")[0], 0, tmp_path, {}, shown=None).command())
    assert " --delay exp:0.02s@0" in " ".join(flags["single"])


@pytest.mark.parametrize("backup", [1, "auto"])
def test_a_permanently_slow_worker_does_not_slow_sync_rounds_with_a_backup(slow_env, tmp_path,
                                                                           backup):
    """ps-sync, 3 workers, worker 2 slowed 8x, --backup-workers 1: every round is applied
    once the two others pushed, so they keep their own pace; the slow worker's pushes come
    after their round and are dropped as stale (and counted, in summary.json: read once the
    server ended, not by a stats request at some moment that a slow start can put after its
    --max-seconds, when it no longer answers). --backup-workers auto: the same, once its
    first rounds (which wait for all) have timed the pushes."""
    srv = Server(slow_env, tmp_path / "run", "--task", TASK[1], "--workers", 3,
                 "--consistency", "sync", "--backup-workers", backup, "--max-seconds", 12)
    try:
        procs = [worker(slow_env, srv.address, r, 3, *TASK, "--slowdown", "2:8")
                 for r in range(3)]
        code, _, err = srv.wait(timeout=120)
        results = finish(procs, timeout=60)
    finally:
        srv.close()
    assert code == 0, err
    assert all(r[0] == 0 for r in results), [r[2] for r in results]
    summary = read_json(tmp_path / "run" / "summary.json")
    stats = {"updates": summary["updates"], "stale": summary["stale_pushes"]}
    events = read_events(tmp_path / "run")
    names = {e["worker"] for e in events if e["event"] == "train"}
    fast = [_per_step(events, next(n for n in names if n.endswith(f"-r{r}"))) for r in (0, 1)]
    slow = _per_step(events, next(n for n in names if n.endswith("-r2")))
    assert max(fast) < 2.5 * STEP, fast  # without a backup every round took the slow 8 x
    assert slow > 6 * STEP, slow
    assert stats["stale"] > 0 and stats["updates"] > 5 * stats["stale"], stats
    record_figure(f"ps-sync --backup-workers {backup}, worker 2 slowed 8x", fast_ms=[
        round(f * 1e3, 1) for f in fast], slowed_ms=round(slow * 1e3, 1),
        updates=stats["updates"], stale=stats["stale"])


def test_stale_pushes_in_the_summary_are_summed_over_shards(server):
    """Two shards under sync with one backup worker of two: each round is applied on the
    first push, and the other worker's push for it is stale. Hand-made peers make one
    stale push on shard 0 and two on shard 1; summary.json says 3."""
    srv = server("--task", COUNTER, "--samples", 16, "--shards", 2, "--workers", 2,
                 "--consistency", "sync", "--backup-workers", 1, "--heartbeat-timeout", 60)
    ports = srv.stats()["shard_ports"]
    assert len(ports) == 2
    peers = {(w, port): Peer(srv, port, worker=w, shard=i) for w in "ab"
             for i, port in enumerate(ports)}
    for peer in peers.values():  # each shard holds the first pull until both joined
        peer.send(PULL, 1)
    assert all(peer.reply().type == PARAMS for peer in peers.values())
    stale = {ports[0]: 1, ports[1]: 2}
    for port, count in stale.items():
        a, b = peers["a", port], peers["b", port]
        for n in range(count):  # a's push closes round n; b's, computed at version 0, is late
            ack = a.push(2 + n, torch.ones(1), clock=n)
            assert ack.type == ACK and ack.meta[Key.APPLIED] is True, ack
            late = b.push(2 + n, torch.ones(1), clock=0)
            assert late.type == ACK and late.meta.get(Key.STALE) is True, late
    for peer in peers.values():
        peer.close()
    srv.goodbyes()
    code, _, err = srv.wait(timeout=60)
    assert code == 0, err[-3000:]
    summary = read_json(srv.out / "summary.json")
    assert (summary["stale_pushes"], summary["updates"]) == (3, 3), summary
