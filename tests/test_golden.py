"""Golden trajectories: the deterministic modes, run with a fixed seed and task, record the
SHA-256 of their parameters after every round (--record-digests), and each run must equal the
recording committed in tests/golden/<case>.json bit for bit, round by round. A ps-sync
server killed whole (SIGKILL to its process group) and resumed from its checkpoint while its
workers live on must equal it too, and the virtual clock's ps-sync and diloco runs equal the
real server's recordings.

Every case uses 2 workers (ranks) and one torch thread each: a sync round sums its pushes in
the order they arrive, which is exact for two (a + b == b + a) but not for three or more.

To record again, after a change meant to move a trajectory or on another torch version or
CPU, and commit the files:

    ASYNCSGD_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/test_golden.py

A recording holds the torch version and the CPU capability
(torch.backends.cpu.get_cpu_capability()) it was made with. The comparison runs whatever they
are (it never skips: a golden test that skips cannot fail); when it fails on another torch
version or CPU capability, whose kernels may round differently, the message names both and
how to record again.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from asyncsgd.config import DDPConfig, SingleConfig
from asyncsgd.modes import ddp
from asyncsgd.modes.single import train
from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.run.digests import params_digest, read_digests
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.wire.protocol import ACK, PARAMS, PUSH, Key, Message, Segment

from conftest import Server, finish, signal_group, stop_tree, wait_for, worker

GOLDEN = Path(__file__).parent / "golden"
RECORD = "ASYNCSGD_RECORD_GOLDEN"
HOW = f"{RECORD}=1 .venv/bin/python -m pytest tests/test_golden.py, then commit tests/golden"
TASK, SAMPLES, EPOCHS = "tasks_for_tests:regression", 400, 2  # 20 rounds of 2 x 16 rows
DATA = ("--task", TASK, "--samples", SAMPLES)
SYNC = (*DATA, "--consistency", "sync", "--workers", 2, "--shards", 1, "--threads", 1,
        "--record-digests", "--eval-every", 1e6)
WORKER = (*DATA, "--epochs", EPOCHS)
DILOCO = ("--optimizer", "nesterov", "--lr", 0.7, "--momentum", 0.9)  # compare's diloco


def here() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def trajectory(lines: list) -> list:
    """The digest of every round from 0, in order, from a digests file's lines; a round
    recorded twice (a resumed run repeating what its checkpoint lost) must repeat its digest."""
    (key,) = {k for line in lines for k in line if k != "sha256"}
    seen: dict = {}
    for line in lines:
        first = seen.setdefault(line[key], line["sha256"])
        assert first == line["sha256"], f"{key} {line[key]} was recorded twice, differently"
    assert sorted(seen) == list(range(len(seen))), f"{key}s missing: {sorted(seen)}"
    return [seen[k] for k in range(len(seen))]


def check(case: str, lines: list, records: bool = True) -> None:
    """``lines`` (a digests file's) are the recording ``case``'s trajectory, or become it
    when $ASYNCSGD_RECORD_GOLDEN is set and this run ``records`` it (the others compare
    with what it recorded: they run after it)."""
    path, got = GOLDEN / f"{case}.json", trajectory(lines)
    if records and os.environ.get(RECORD):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps({**here(), "digests": got}, indent=1) + "\n")
        return
    golden = json.loads(path.read_text())
    want = golden["digests"]
    differs = next((r for r, (a, b) in enumerate(zip(got, want)) if a != b), None)
    elsewhere = "".join(f"; it was recorded with {what} {golden[what]}, this is {value}: "
                        f"if no change here was meant to move it, record it again: {HOW}"
                        for what, value in here().items() if golden[what] != value)
    assert differs is None, (f"{case}: the parameters after round {differs} differ from "
                             f"{path.name} (rounds 0..{differs - 1} agree){elsewhere}")
    assert len(got) == len(want), f"{case}: {len(got)} rounds, recorded {len(want)}"


def final_digest(run_dir: Path) -> str:
    """The digest of the parameters a run's final checkpoint holds, in the model's order."""
    return params_digest(load_checkpoint(run_dir / "checkpoint.pt")["model"].values())


def _settings(out, **kw) -> dict:
    return dict(task=TASK, samples=SAMPLES, epochs=EPOCHS, threads=1, eval_every=1e6,
                checkpoint_every=0, progress="off", record_digests=True, out=str(out), **kw)


def test_single_repeats_its_recording(tmp_path):
    train(SingleConfig(**_settings(tmp_path / "run", momentum=0.9)))
    lines = read_digests(tmp_path / "run" / "digests.jsonl")
    check("single", lines)
    assert final_digest(tmp_path / "run") == lines[-1]["sha256"]


@pytest.mark.processes
def test_ddp_repeats_its_recording(tmp_path):
    ddp.train(DDPConfig(**_settings(tmp_path / "run", procs=2, momentum=0.9)))
    lines = read_digests(tmp_path / "run" / "digests.jsonl")
    check("ddp", lines)
    assert final_digest(tmp_path / "run") == lines[-1]["sha256"]


def _ps_run(cli_env, out, server_flags=(), worker_flags=()) -> list:
    srv = Server(cli_env, out, *SYNC, *server_flags)
    try:
        results = finish([worker(cli_env, srv.address, r, 2, *WORKER, *worker_flags)
                          for r in range(2)])
        code, _, err = srv.wait()
    finally:
        srv.close()
    assert code == 0, err
    assert all(c == 0 for c, _, _ in results), results
    lines = read_digests(out / "digests-shard-0.jsonl")
    assert final_digest(out) == lines[-1]["sha256"]
    return lines


@pytest.mark.parametrize("case, server_flags, worker_flags", [
    ("ps-sync", (), ()), ("diloco", DILOCO, ("--local-steps", 2))], ids=["ps-sync", "diloco"])
def test_a_sync_server_repeats_its_recording(cli_env, tmp_path, case, server_flags,
                                             worker_flags):
    check(case, _ps_run(cli_env, tmp_path / "run", server_flags, worker_flags))


def test_the_virtual_clock_repeats_the_real_servers_recordings(run_cli_here, tmp_path):
    """The simulator's server is the real ShardState and its workers take the real workers'
    batches: its trajectories are the real ones, whatever its clock says."""
    res = run_cli_here("simulate", *DATA, "--modes", "ps-sync,diloco:2", "--workers", 2,
                       "--epochs", EPOCHS, "--step-time", "10ms", "--progress", "off",
                       "--record-digests", "--out", tmp_path / "sim")
    assert res.returncode == 0, res.stderr
    for case, run in (("ps-sync", "ps-sync-r1"), ("diloco", "diloco-2-r1")):
        check(case, read_digests(tmp_path / "sim" / run / "digests.jsonl"), records=False)


def test_a_sync_push_computed_on_a_round_a_restored_shard_lost_is_stale():
    """A shard restored at version 3 gets a push computed on version 5 (its worker saw
    rounds the kill lost): acknowledged stale, nothing applied, and the worker gets the
    restored round's parameters to compute again. Async applies such a push as fresh."""
    for mode, applied in (("sync", False), ("async", True)):
        state = ShardState(ShardConfig(index=0, start=0, end=4, lr=1.0, consistency=mode),
                           torch.zeros(4))
        state.load_state_dict({**state.state_dict(), "version": 3})
        push = Message(type=PUSH, shard=0, worker="a", incarnation=1, seq=9, clock=5,
                       meta={Key.PULL: True}, segments=[Segment(0, torch.ones(4))])
        replies = {r.type: r for _, r in state.handle(b"a", push, 0.0)}
        ack = replies[ACK] if ACK in replies else replies[PARAMS].meta[Key.ACK]
        ack = ack.meta if isinstance(ack, Message) else ack
        assert ack[Key.APPLIED] is applied, (mode, ack)
        assert state.version == 3 + applied
        assert torch.equal(state.params, torch.full((4,), -float(applied)))
        if not applied:
            assert ack[Key.STALE] is True and state.counters["stale"] == 1
            assert replies[PARAMS].meta[Key.VERSION] == 3
        assert sum(state.staleness) == 1 and state.staleness[0] == 1


def _versions(path: Path) -> list:
    """The versions a shard's digests file holds so far (a line being written is left out)."""
    if not path.exists():
        return []
    versions = []
    for line in path.read_text().splitlines():
        try:
            versions.append(json.loads(line)["version"])
        except ValueError:
            pass
    return versions


def _saved_version(out: Path) -> int:
    path = out / "shard-0.pt"
    return load_checkpoint(path)["shard"]["version"] if path.exists() else -1


def test_a_sync_server_killed_whole_and_resumed_repeats_the_recording(cli_env, tmp_path):
    """The server is SIGKILLed rounds after its last checkpoint and resumed: the workers'
    pushes computed on the lost rounds are acknowledged stale, they pull the restored round
    and train from its batch again, so every round, repeated ones included, has the digest
    of the run never stopped."""
    out = tmp_path / "run"
    # A worker backing off while the server restarts must not be dropped from the rounds
    # (the resumed server keeps these settings).
    first = Server(cli_env, out, *SYNC, "--checkpoint-every", 0.5, "--heartbeat-timeout", 60,
                   own_group=True)
    resumed, procs = None, []
    try:
        procs = [worker(cli_env, first.address, r, 2, *WORKER, "--heartbeat", 0.2,
                        "--delay", "const:100ms") for r in range(2)]
        digests = out / "digests-shard-0.jsonl"
        wait_for(lambda: _saved_version(out) >= 1 and
                 max(_versions(digests), default=0) >= _saved_version(out) + 2, 120,
                 "a checkpoint after a round, and two rounds after it")
        stop_tree(first.proc, signal_group(signal.SIGKILL))
        killed_at, restored = max(_versions(digests)), _saved_version(out)
        resumed = Server(cli_env, out, "--resume", out, port=first.port, own_group=True)
        results = finish(procs, timeout=120)
        code, _, err = resumed.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for srv in (first, resumed):
            if srv is not None:
                srv.close()
    assert code == 0, err
    assert all(rc == 0 for rc, _, _ in results), results
    lines = read_digests(out / "digests-shard-0.jsonl")
    check("ps-sync", lines, records=False)
    assert final_digest(out) == trajectory(lines)[-1]
    assert restored < killed_at < EPOCHS * 10, (restored, killed_at)
    versions = [line["version"] for line in lines]
    for v in range(restored + 1, killed_at + 1):  # lost with the server, applied again
        assert versions.count(v) == 2, (v, versions)
    for _, _, worker_err in results:
        assert "the server is back at round" in worker_err, worker_err
