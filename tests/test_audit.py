"""The exactly-once audit (--audit-dir): its reader on hand-written files, and its writer read
back; one short ps-async run audited end to end."""

import json

import pytest
import torch

from asyncsgd.analysis.audit import read_audit
from asyncsgd.errors import ConfigError
from asyncsgd.run.audit import make_audit_dir, shard_audit, worker_audit
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.wire.protocol import PUSH, Message, Segment
from conftest import finish, worker


def write(path, *lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def shard_life(tmp_path, index, pid, start, restored, *applied):
    """A shard life's file: ``applied`` are (worker, incarnation, seq, version)."""
    write(tmp_path / f"shard-{index}-{pid}.jsonl",
          {"start": start, "shard": index, "restored": restored, "lost": 0},
          *({"w": w, "i": i, "s": s, "v": v} for w, i, s, v in applied))


def worker_life(tmp_path, name, incarnation, *entries):
    write(tmp_path / f"worker-{name}-{incarnation}.jsonl",
          {"start": 1.0, "w": name, "i": incarnation}, *entries)


def sent(seqs, shards, compute):
    return {"s": seqs, "sh": shards, "compute": compute}


def acked(seq, shard, applied=True, duplicate=False, stale=False):
    return {"s": seq, "sh": shard, "applied": applied, "duplicate": duplicate, "stale": stale}


def test_a_push_applied_twice_is_doubled(tmp_path):
    shard_life(tmp_path, 0, 10, 1.0, None, ("a", 1, 1, 1), ("a", 1, 2, 2), ("a", 1, 1, 3))
    audit = read_audit(tmp_path)
    assert (audit.applied, audit.doubled, audit.lost, audit.lost_to_checkpoint) == (3, 1, 0, 0)
    assert audit.lost_resent == 0
    assert audit.violations == [("doubled", 0, "a", 1, 1)]


def test_an_other_incarnations_push_of_the_same_seq_is_not_doubled(tmp_path):
    shard_life(tmp_path, 0, 10, 1.0, None, ("a", 1, 1, 1), ("a", 2, 1, 2), ("b", 1, 1, 3))
    assert read_audit(tmp_path).doubled == 0


def test_an_acknowledged_push_no_shard_applied_is_lost(tmp_path):
    shard_life(tmp_path, 0, 10, 1.0, None, ("a", 1, 1, 1))
    worker_life(tmp_path, "a", 1, sent([1], [0], 0.5), acked(1, 0), sent([2], [0], 0.5),
                acked(2, 0, applied=False, duplicate=True), sent([3], [0], 0.5),
                acked(3, 0, applied=False, stale=True))
    audit = read_audit(tmp_path)
    # 2: a duplicate's acknowledgement says it was applied before; 3: stale, never applied
    assert (audit.lost, audit.shards[0].acknowledged) == (1, 2)
    assert audit.violations == [("lost", 0, "a", 1, 2)]
    assert audit.goodput == pytest.approx(1 / 3)


def test_a_restore_cuts_what_was_applied_after_its_checkpoint(tmp_path):
    # life 1 applies versions 1..4 and dies; life 2 restores the checkpoint of version 2,
    # so 3 and 4 are lost to it; b's push 2 had no ack and is re-sent: applied once more
    shard_life(tmp_path, 0, 10, 1.0, None,
               ("a", 1, 1, 1), ("b", 1, 1, 2), ("a", 1, 2, 3), ("b", 1, 2, 4))
    shard_life(tmp_path, 0, 11, 2.0, 2, ("b", 1, 2, 3), ("a", 1, 3, 4))
    worker_life(tmp_path, "a", 1, sent([1], [0], 1.0), acked(1, 0), sent([2], [0], 1.0),
                acked(2, 0), sent([3], [0], 1.0), acked(3, 0))
    worker_life(tmp_path, "b", 1, sent([1], [0], 1.0), acked(1, 0), sent([2], [0], 1.0),
                acked(2, 0))  # from life 2
    audit = read_audit(tmp_path)
    assert (audit.applied, audit.doubled, audit.lost, audit.lost_to_checkpoint) == (4, 0, 0, 2)
    # b's push 2 came again: its acknowledgement died with the shard; a's push 2 is gone
    assert audit.lost_resent == 1
    assert audit.shards[0].lives == 2 and audit.violations == []
    assert audit.goodput == pytest.approx(4 / 5)  # a's push 2 is gone


def test_restores_cut_in_the_order_the_lives_began(tmp_path):
    # three lives: the third restores version 3, which the second life reached (from 1)
    shard_life(tmp_path, 0, 30, 3.0, 3, ("a", 1, 5, 4))
    shard_life(tmp_path, 0, 10, 1.0, None, ("a", 1, 1, 1), ("a", 1, 2, 2), ("a", 1, 3, 3))
    shard_life(tmp_path, 0, 20, 2.0, 1, ("a", 1, 3, 2), ("a", 1, 4, 3), ("a", 1, 9, 4))
    audit = read_audit(tmp_path)
    # cut: versions 2, 3 of life 1, then version 4 of life 2; a's push 3 survives once
    assert (audit.applied, audit.lost_to_checkpoint, audit.doubled) == (4, 3, 0)
    assert audit.lost_resent == 1  # a's push 3, applied again by life 2


def test_goodput_counts_a_push_only_where_it_survives_on_every_shard(tmp_path):
    shard_life(tmp_path, 0, 10, 1.0, None, ("a", 1, 1, 1), ("a", 1, 3, 2), ("a", 1, 5, 3))
    shard_life(tmp_path, 1, 11, 1.0, None, ("a", 1, 2, 1), ("a", 1, 6, 2))
    # pushes: (1, 2) on both shards; (3, 4) lost its shard-1 half; (5, 6) on both
    worker_life(tmp_path, "a", 1, sent([1, 2], [0, 1], 2.0), sent([3, 4], [0, 1], 3.0),
                sent([5, 6], [0, 1], 5.0), sent([7, 8], [0, 1], 10.0))
    audit = read_audit(tmp_path)
    assert audit.compute_seconds == pytest.approx(20.0)
    assert audit.goodput == pytest.approx(7 / 20)
    assert audit.applied == 5 and set(audit.shards) == {0, 1}


def test_a_line_cut_short_by_a_kill_is_left_out(tmp_path):
    shard_life(tmp_path, 0, 10, 1.0, None, ("a", 1, 1, 1))
    with open(tmp_path / "shard-0-10.jsonl", "a") as fh:
        fh.write('{"w": "a", "i": 1, "s"')
    (tmp_path / "worker-b-1.jsonl").write_text("")  # killed before its first line
    assert read_audit(tmp_path).applied == 1


def test_an_audit_dir_that_cannot_be_written_is_one_clear_error(tmp_path):
    (tmp_path / "taken").write_text("a file, not a directory")
    for write in (lambda: worker_audit(str(tmp_path / "taken"), "a", 1),
                  lambda: make_audit_dir(str(tmp_path / "taken" / "below"))):
        with pytest.raises(ConfigError, match="--audit-dir .*taken.*: cannot write there"):
            write()


def test_the_writer_is_read_back(tmp_path):
    shard = shard_audit(str(tmp_path / "audit"), 0, restored=None, lost=0)
    shard.applied("a", 7, 1, 1)
    shard.applied("a", 7, 2, 2)
    log = worker_audit(str(tmp_path / "audit"), "a", 7)
    log.sent([1], [0], 0.25)
    log.acked(1, 0, {"applied": True, "staleness": 0})
    log.sent([2], [0], 0.75)
    log.acked(2, 0, {"applied": False, "duplicate": True})
    log.sent([3], [0], 1.0)
    audit = read_audit(tmp_path / "audit")
    assert (audit.applied, audit.doubled, audit.lost, audit.shards[0].acknowledged) == \
        (2, 0, 0, 2)
    assert audit.goodput == pytest.approx(0.5)
    assert shard_audit(None, 0, None, 0) is None and worker_audit("", "a", 1) is None
    shard.close()
    log.close()


def _push(worker, seq, inc=1):
    return Message(type=PUSH, shard=0, worker=worker, incarnation=inc, seq=seq,
                   segments=[Segment(0, torch.ones(2))])


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_a_shard_tells_the_audit_each_push_it_applies_once_with_its_version(consistency):
    state = ShardState(ShardConfig(0, 0, 2, consistency=consistency, expected_workers=2),
                       torch.zeros(2))
    applied = []
    state.audit = lambda *entry: applied.append(entry)
    for msg in (_push("a", 1), _push("a", 1), _push("b", 1, inc=7)):  # a retry in between
        state.handle(b"peer-" + msg.worker.encode(), msg, now=0.0)
    if consistency == "async":
        assert applied == [("a", 1, 1, 1), ("b", 7, 1, 2)]
    else:  # one round, applied when b's push completes it: one version for both
        assert applied == [("a", 1, 1, 1), ("b", 7, 1, 1)]
    assert state.version == len({v for *_, v in applied})


def test_an_audited_async_run_applies_every_acknowledged_push_once(server, cli_env, tmp_path):
    audit_dir = tmp_path / "audit"
    srv = server("--task", "tasks_for_tests:dense_counter", "--samples", 400, "--workers", 2,
                 "--audit-dir", audit_dir)
    procs = [worker(cli_env, srv.address, r, 2, "--task", "tasks_for_tests:dense_counter",
                    "--samples", 400, "--epochs", 2, "--audit-dir", audit_dir)
             for r in range(2)]
    for code, _out, err in finish(procs):
        assert code == 0, err
    code, _out, err = srv.wait()
    assert code == 0, err
    audit = read_audit(audit_dir)
    assert (audit.doubled, audit.lost, audit.lost_to_checkpoint) == (0, 0, 0), audit.violations
    # 2 epochs of 400 samples in batches of 8: 100 pushes, each acknowledged as applied
    assert audit.applied == audit.shards[0].acknowledged == 100
    assert 0 < audit.compute_seconds and audit.goodput == 1.0
