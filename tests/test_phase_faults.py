"""Faults at every phase of a push, a checkpoint and a handshake, each checked with the
exactly-once audit (--audit-dir, asyncsgd.analysis.audit).

The faults come from a test-only hook, off unless a test sets it: in a process started with
``ASYNCSGD_TESTING_ONLY_KILL_AT=<phase>:<n>:<file>`` (asyncsgd/run/kill_at.py), the n-th
time the process reaches <phase> it writes its pid into <file> and SIGKILLs itself; a
process that finds <file> there already (a shard restarted with the same environment)
goes on. Phases: before-push, between-parts, after-apply-before-ack and after-ack in a
worker; before-checkpoint and after-checkpoint in a shard (periodic checkpoints that hold
updates), and applied-unacked (tests/test_shard_tables_process.py); while-welcoming in the
server's front.

``tasks_for_tests:dense_counter``, SGD lr 1: every push applied subtracts its batch size
(8) from the one weight, so the final weight is -8 x the applications that survived, which
the audit counts.
"""

import json
import os
import signal

import pytest

from asyncsgd.analysis.audit import read_audit
from asyncsgd.run import kill_at
from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.run.kill_at import (AFTER_ACK, AFTER_APPLY_BEFORE_ACK, AFTER_CHECKPOINT,
                                  BEFORE_CHECKPOINT, BEFORE_PUSH, BETWEEN_PARTS, VARIABLE,
                                  WHILE_WELCOMING)
from asyncsgd.wire.protocol import HELLO, Key, Message, encode
from conftest import (Server, finish, periodic_checkpoint, read_json, shard_stats, wait_for,
                      worker)

TASK, PARTS_TASK = "tasks_for_tests:dense_counter", "tasks_for_tests:two_part_counter"
BATCH = 8


def killing(cli_env, phase: str, n: int, marker) -> dict:
    return {**cli_env, VARIABLE: f"{phase}:{n}:{marker}"}


def lives(audit_dir, kind: str) -> list:
    """(first line, the rest) of each ``kind`` file of the audit, in the order they began."""
    files = [[json.loads(line) for line in path.read_text().splitlines()]
             for path in audit_dir.glob(f"{kind}-*.jsonl")]
    return sorted(((f[0], f[1:]) for f in files), key=lambda life: life[0]["start"])


def final_weights(run_dir):
    return load_checkpoint(run_dir / "checkpoint.pt")["model"]["w"]


def assert_exactly_once(audit, lost_updates: int) -> None:
    """No push doubled, none acknowledged and missing, and every application a restore
    cut is one the shard counted as lost, or one its worker re-sent (its ack died)."""
    assert (audit.doubled, audit.lost) == (0, 0), audit.violations
    assert audit.lost_to_checkpoint - audit.lost_resent == lost_updates, audit


def test_the_hook_kills_at_the_nth_reach_once_and_is_off_unless_set(monkeypatch, tmp_path):
    assert kill_at.parse("") == {}
    for wrong in ("before-push", "nowhere:1", "before-push:0", "after-ack:x"):
        with pytest.raises(ValueError, match=VARIABLE):
            kill_at.parse(wrong)
    kills, prepared = [], []
    monkeypatch.setattr(kill_at.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    kill_at.reached(AFTER_ACK)  # unset: nothing
    marker = tmp_path / "killed"
    monkeypatch.setattr(kill_at, "_PLAN", kill_at.parse(f"{AFTER_ACK}:2:{marker}"))
    kill_at.reached(BEFORE_PUSH)
    kill_at.reached(AFTER_ACK, prepared.append, "first")
    assert kills == prepared == []
    kill_at.reached(AFTER_ACK, prepared.append, "second")
    assert kills == [(os.getpid(), signal.SIGKILL)] and prepared == ["second"]
    assert marker.read_text() == str(os.getpid())
    kill_at.reached(AFTER_ACK)  # past its n-th reach
    # a process that inherited the variable (a restarted shard) finds the kill taken
    monkeypatch.setattr(kill_at, "_PLAN", kill_at.parse(f"{AFTER_ACK}:1:{marker}"))
    kill_at.reached(AFTER_ACK)
    assert len(kills) == 1


# (phase, the victim's pushes applied, acknowledgements it heard): it dies in its 5th push
@pytest.mark.parametrize("phase,applied,acked", [
    (BEFORE_PUSH, 4, 4), (BETWEEN_PARTS, 4, 4), (AFTER_APPLY_BEFORE_ACK, 5, 4),
    (AFTER_ACK, 5, 5)])
def test_a_worker_killed_at_a_phase_of_its_push_and_restarted(server, cli_env, tmp_path, phase,
                                                             applied, acked):
    """The restarted worker (same id, a new incarnation) trains its epoch again; the killed
    one's fifth push is applied exactly when the shard got it whole."""
    task, rows = (PARTS_TASK, 40) if phase == BETWEEN_PARTS else (TASK, 80)
    audit_dir, marker = tmp_path / "audit", tmp_path / "killed"
    # the killed incarnation stays a live member for 30 s: the server waits for its successor
    srv = server("--task", task, "--samples", rows, "--audit-dir", audit_dir,
                 "--heartbeat-timeout", 30)
    args = ["--task", task, "--samples", rows, "--epochs", 1, "--audit-dir", audit_dir,
            "--transport", "tcp"]
    victim = worker(killing(cli_env, phase, 5, marker), srv.address, 0, 1, *args)
    assert victim.wait(120) == -signal.SIGKILL, victim.communicate()
    assert int(marker.read_text()) == victim.pid
    (code, _, err), = finish([worker(cli_env, srv.address, 0, 1, *args)])
    assert code == 0, err
    assert srv.wait()[0] == 0

    audit = read_audit(audit_dir)
    assert_exactly_once(audit, 0)
    assert audit.lost_to_checkpoint == 0
    (dead, dead_lines), (again, _) = lives(audit_dir, "worker")
    assert dead["w"] == again["w"] and dead["i"] < again["i"]
    (_, shard_lines), = lives(audit_dir, "shard")
    by_dead = [e["s"] for e in shard_lines if e["i"] == dead["i"]]
    assert len(by_dead) == applied
    assert sum("compute" in e for e in dead_lines) == 5  # logged before it is sent
    assert sum("applied" in e for e in dead_lines) == acked
    pushes = rows // BATCH
    assert audit.applied == applied + pushes
    weights = final_weights(srv.out)
    assert weights[0].item() == weights[-1].item() == -BATCH * (applied + pushes)


@pytest.mark.parametrize("phase", [BEFORE_CHECKPOINT, AFTER_CHECKPOINT])
def test_a_shard_killed_around_its_checkpoint(cli_env, tmp_path, phase):
    """Killed before its second checkpoint of updates, the shard restarts from the first
    and loses what came since, counted; killed right after it, it loses nothing."""
    rows, epochs = 1600, 1  # 200 pushes, 3 ms apart at least: checkpoints every 0.2 s
    audit_dir, marker, out = tmp_path / "audit", tmp_path / "killed", tmp_path / "run"
    srv = Server(killing(cli_env, phase, 2, marker), out, "--task", TASK, "--samples", rows,
                 "--checkpoint-every", 0.2, "--audit-dir", audit_dir)
    try:
        trainer = worker(cli_env, srv.address, 0, 1, "--task", TASK, "--samples", rows,
                         "--epochs", epochs, "--heartbeat", 0.2, "--delay", "const:3ms",
                         "--audit-dir", audit_dir)
        (code, out_text, err), = finish([trainer])
        assert code == 0, err
        assert srv.wait()[0] == 0
    finally:
        srv.close()
    assert marker.exists(), "the shard was never killed"
    summary = read_json(out / "summary.json")
    assert summary["shard_restarts"] == 1
    audit = read_audit(audit_dir)
    assert audit.shards[0].lives == 2
    assert_exactly_once(audit, summary["lost_updates"])
    if phase == AFTER_CHECKPOINT:  # nothing was applied between the write and the kill
        assert audit.lost_to_checkpoint == summary["lost_updates"] == 0
    else:
        assert audit.lost_to_checkpoint > 0
    pushes = rows // BATCH * epochs
    assert audit.applied == pushes - summary["lost_updates"]
    assert final_weights(out).item() == -BATCH * audit.applied


def test_a_server_killed_while_welcoming_is_resumed_and_its_worker_hellos_again(
        cli_env, tmp_path):
    """A second hello kills the front (and with it the shards) while the worker trains past
    a checkpoint; resumed on its address, the server welcomes the worker again, and every
    push is applied once or counted lost to the checkpoint."""
    rows, epochs = 1600, 2  # 400 pushes, 4 ms apart at least
    audit_dir, marker, out = tmp_path / "audit", tmp_path / "killed", tmp_path / "run"
    first = Server(killing(cli_env, WHILE_WELCOMING, 2, marker), out, "--task", TASK,
                   "--samples", rows, "--checkpoint-every", 0.2, "--audit-dir", audit_dir)
    resumed, trainer = None, None
    try:
        trainer = worker(cli_env, first.address, 0, 1, "--task", TASK, "--samples", rows,
                         "--epochs", epochs, "--heartbeat", 0.2, "--delay", "const:4ms",
                         "--audit-dir", audit_dir)
        port = first.stats()["shard_ports"][0]
        wait_for(lambda: periodic_checkpoint(out) and
                 shard_stats(first, port)["version"] >= 60, 120, "a checkpoint and 60 updates")
        hello = Message(type=HELLO, worker="latecomer", incarnation=1, seq=1,
                        meta={Key.SIGNATURE: first.signature()})
        with pytest.raises(TimeoutError):  # its token was made, its welcome never sent
            first.request(encode(hello), timeout=1)
        assert first.proc.wait(60) == -signal.SIGKILL
        assert int(marker.read_text()) == first.proc.pid
        resumed = Server(cli_env, out, "--resume", out, port=first.port)
        (code, _, err), = finish([trainer])
        assert code == 0, err
        assert "rejoined the restarted server" in err
        assert resumed.wait()[0] == 0
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for srv in (first, resumed):
            if srv is not None:
                srv.close()
    summary = read_json(out / "summary.json")
    audit = read_audit(audit_dir)
    assert audit.shards[0].lives == 2
    assert_exactly_once(audit, summary["lost_updates"])
    pushes = rows // BATCH * epochs
    assert audit.applied == pushes - summary["lost_updates"]
    assert final_weights(out).item() == -BATCH * audit.applied
