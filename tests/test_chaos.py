"""experiments/chaos.py: its schedule, its recovery figures and its watch of a growing audit
(pure, fast tier), and a short chaos run of ps-async and ps-sync with backup workers auto
judged by the exactly-once audit."""

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncsgd.run.namespaces import can_make_namespaces
from asyncsgd.wire.protocol import Key
from test_protocol_and_shard import _pull, _push, _state

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("chaos", ROOT / "experiments" / "chaos.py")
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)

# The floor of the short run's goodput (the share of worker compute whose pushes survive).
# Measured over 10 minutes (experiments/README.md, "Training through chaos"): ps-async 98.6%,
# ps-backup:auto 95.9%. (A fixed --backup-workers 1 of 4 cannot pass 75%: each round's 4th
# push is stale, faults or not.)
GOODPUT_FLOOR = {"ps-async": 0.85, "ps-backup:auto": 0.85}


def test_the_schedule_is_seeded_exponential_and_ends_before_the_quiet_time():
    faults = chaos.schedule(15, 600, list(chaos.KINDS), seed=7, workers=4, shards=2, quiet=20)
    assert faults == chaos.schedule(15, 600, list(chaos.KINDS), seed=7, workers=4, shards=2,
                                    quiet=20)
    assert faults != chaos.schedule(15, 600, list(chaos.KINDS), seed=8, workers=4, shards=2,
                                    quiet=20)
    rng = random.Random(7)  # the first draw, by hand: an interval, a kind, a target
    first = rng.expovariate(1 / 15)
    assert faults[0].due == round(first, 3) and faults[0].kind == rng.choice(list(chaos.KINDS))
    assert all(0 < f.due < 580 for f in faults)
    assert [f.due for f in faults] == sorted(f.due for f in faults)
    for f in faults:
        assert f.target in {"shard": range(2), "server": [0]}.get(f.kind, range(4))
    long = chaos.schedule(15, 300_000, ["worker", "link"], seed=1, workers=4)
    assert {f.kind for f in long} == {"worker", "link"}
    assert abs(300_000 / len(long) - 15) < 0.5  # the mean interval is --mtbf


def test_recovery_table_counts_each_kind_from_the_fault_and_a_link_from_its_healing():
    faults = [chaos.Fault(1, "worker", 0, at=1.0, recovered=3.5),
              chaos.Fault(2, "worker", 1, at=10.0, recovered=11.0),
              chaos.Fault(3, "worker", 2, at=20.0, recovered=26.0),
              chaos.Fault(4, "link", 0, at=30.0, healed=33.0, recovered=33.5),
              chaos.Fault(5, "server", 0, at=40.0),  # not recovered
              chaos.Fault(6, "shard", 0)]  # never injected
    assert chaos.recovery_table(faults) == {
        "worker": {"faults": 3, "recovered": 3, "median_s": 2.5, "max_s": 6.0},
        "server": {"faults": 1, "recovered": 0, "median_s": None, "max_s": None},
        "link": {"faults": 1, "recovered": 1, "median_s": 0.5, "max_s": 0.5}}


def _lines(path: Path, *records, tail: str = "") -> None:
    with open(path, "a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_the_watch_counts_what_grows_across_process_lives(tmp_path):
    shard_a, shard_b = tmp_path / "shard-0-111.jsonl", tmp_path / "shard-0-222.jsonl"
    worker_a, worker_b = tmp_path / "worker-h-r1-5.jsonl", tmp_path / "worker-h-r1-9.jsonl"
    _lines(shard_a, {"start": 1, "shard": 0, "restored": None, "lost": 0},
           {"w": "h-r1", "i": 5, "s": 1, "v": 1}, {"w": "h-r1", "i": 5, "s": 2, "v": 2})
    _lines(worker_a, {"start": 1, "w": "h-r1", "i": 5},
           {"s": [1], "sh": [0], "compute": 0.1},
           {"s": 1, "sh": 0, "applied": True, "duplicate": False, "stale": False},
           {"s": 2, "sh": 0, "applied": False, "duplicate": False, "stale": True},
           tail='{"s": 3, "sh"')  # cut by a SIGKILL mid-line
    watch = chaos.AuditWatch(tmp_path)
    watch.poll()
    assert (watch.shard_updates, watch.acked, watch.shard_pids) == ({0: 2}, {1: 1}, {0: 111})
    worker, shard, server = (chaos.Fault(0, "worker", 1), chaos.Fault(0, "shard", 0),
                             chaos.Fault(0, "server", 0))
    marks = [watch.mark(f) for f in (worker, shard, server)]
    assert not any(watch.grown(m) for m in marks)
    _lines(shard_b, {"start": 2, "shard": 0, "restored": 1, "lost": 1},
           {"w": "h-r1", "i": 9, "s": 1, "v": 2})
    watch.poll()
    assert watch.shard_pids == {0: 222} and watch.shard_updates == {0: 3}
    assert [watch.grown(m) for m in marks] == [False, True, True]
    _lines(worker_b, {"start": 2, "w": "h-r1", "i": 9},
           {"s": 1, "sh": 0, "applied": True, "duplicate": False, "stale": False})
    watch.poll()
    assert watch.acked == {1: 2} and watch.grown(marks[0])


def test_a_worker_killed_without_its_rank_is_back_at_a_new_incarnations_applied_push(tmp_path):
    """A Ray actor names no rank: any new worker file with an applied push is the recovery."""
    ack = {"s": 2, "sh": 0, "applied": True, "duplicate": False, "stale": False}
    _lines(tmp_path / "worker-h-r0-5.jsonl", {"start": 1, "w": "h-r0", "i": 5}, ack)
    watch = chaos.AuditWatch(tmp_path)
    marks = watch.mark_new_incarnation()
    _lines(tmp_path / "worker-h-r0-5.jsonl", ack)  # the old incarnation: no recovery
    _lines(tmp_path / "worker-h-r1-7.jsonl", {"start": 2, "w": "h-r1", "i": 7},
           {**ack, "applied": False, "stale": True})
    watch.poll()
    assert not watch.grown(marks)
    _lines(tmp_path / "worker-h-r1-7.jsonl", ack)
    watch.poll()
    assert watch.grown(marks)


# Each mode's run: (minutes from its first update, --mtbf, --quiet). The same seed's faults
# come at times proportional to --mtbf, so both see the same kinds in the same order.
# ps-async keeps its goodput through them in 36 s (97.7% measured); ps-backup:auto loses a
# larger share to each (a throttled or cut-off worker's rounds close at the deadline): 81%
# over 36 s, so it gets the minute that keeps it above its floor.
SHORT_RUNS = {"ps-async": (0.6, 6, 16), "ps-backup:auto": (1, 12, 25)}


@pytest.mark.slow
@pytest.mark.solo  # its goodput floor counts seconds: alone, as make test runs it
def test_a_short_chaos_run_loses_and_doubles_nothing_and_recovers_from_every_fault(
        cli_env, tmp_path):
    """Two modes, 4 workers, 36 s (ps-async) and a minute (ps-backup:auto) each from their
    first update, a fault every 6 s and 12 s on average of every kind this machine can
    stage. Processes slow to start or stop (a busy machine) cost time, never the verdict:
    the clock starts at the first update, and a process forced to stop is reported, not
    failed."""
    linked = can_make_namespaces()[0]
    kinds = "worker,shard,server,link,throttle" if linked else "worker,shard,server"
    runs = []
    for mode, (minutes, mtbf, quiet) in SHORT_RUNS.items():
        out = tmp_path / mode.replace(":", "-")
        cmd = [sys.executable, str(ROOT / "experiments" / "chaos.py"), "--minutes", minutes,
               "--mtbf", mtbf, "--quiet", quiet, "--seed", "7", "--kinds", kinds,
               "--modes", mode, "--no-twin", "--out", out]
        res = subprocess.run([str(a) for a in cmd], env=cli_env, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        runs += json.loads((out / "chaos.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == ["ps-async", "ps-backup:auto"]
    for r in runs:
        assert r["doubled"] == 0, r["violations"]
        assert r["lost"] == 0, r["violations"]
        assert r["injected"] >= 1 and r["recovered"] == r["injected"], r["schedule"]
        assert r["goodput"] >= GOODPUT_FLOOR[r["mode"]], r
        assert r["final_metric"] is not None


def test_a_retried_stale_push_is_answered_stale_not_duplicate():
    """--backup-workers 1 of 2: the round closes with the first push; the second is
    acknowledged stale. Its worker never heard that (the link was down) and re-sends it."""
    state = _state("sync", workers=2, backup_workers=1)
    for name in "ab":
        state.handle(name.encode(), _pull(name, 1), 0.0)
    state.handle(b"a", _push("a", 2, torch.ones(6)), 0.0)
    (_, first), = state.handle(b"b", _push("b", 2, torch.ones(6)), 0.0)
    assert first.meta == {Key.APPLIED: False, Key.STALE: True}
    (_, again), = state.handle(b"b", _push("b", 2, torch.ones(6)), 0.0)
    assert again.meta == {Key.APPLIED: False, Key.STALE: True}, again.meta
