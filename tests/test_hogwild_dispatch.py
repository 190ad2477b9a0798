"""Hogwild's ``--data-dispatch``: batches claimed on demand from one shared counter train every
row exactly once an epoch whatever the processes' speeds; fixed partitions do not; a resumed
run continues the epoch and hands out again a dead process's unfinished batch."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncsgd.config import HogwildConfig
from asyncsgd.config.modes import parse_modes
from asyncsgd.errors import ConfigError, WorkerError
from asyncsgd.modes import hogwild
from asyncsgd.modes.hogwild_dispatch import DynamicRows, RowLedger, StaticRows
from asyncsgd.modes.hogwild_state import POSITION

from conftest import read_json


def _drain(ledger: RowLedger, ranks: list, epochs: int, batch: int) -> list:
    """Ranks claim in the order given (cycled), each training its claim before its next."""
    count = torch.zeros(len(set(ranks)), 7, dtype=torch.int64).numpy()
    sources = {r: DynamicRows(ledger, r, epochs, batch, [], count[r]) for r in set(ranks)}
    trained, i = [], 0
    while True:
        rank = ranks[i % len(ranks)]
        rows = sources[rank].next()
        if rows is None:
            return trained
        ledger.trained(rank, rows)
        trained.append((rank, rows.tolist()))
        i += 1


def test_claims_cover_every_row_once_an_epoch_whoever_claims_them():
    ledger = RowLedger(10, 3, seed=1, dynamic=True, lock=threading.Lock())
    # rank 0 claims four times as often as rank 2: the rows are shared out all the same
    trained = _drain(ledger, [0, 0, 1, 0, 0, 1, 2], epochs=2, batch=3)
    assert ledger.counts.tolist() == [2] * 10
    assert ledger.epochs_done() == 2 and ledger.unfinished() == []
    # each epoch: 3 + 3 + 3 + 1 rows (the last batch is the epoch's remainder), in its order
    assert [len(rows) for _, rows in trained] == [3, 3, 3, 1] * 2
    first = [r for _, rows in trained[:4] for r in rows]
    assert first == ledger.order(0).tolist() and sorted(first) == list(range(10))
    assert ledger.order(1).tolist() != ledger.order(0).tolist()
    by_rank = [sum(len(rows) for r, rows in trained if r == rank) for rank in range(3)]
    assert by_rank[0] > by_rank[1] > by_rank[2] > 0


def test_a_checkpoint_holds_the_position_and_the_unfinished_claims_to_hand_again():
    ledger = RowLedger(10, 2, seed=0, dynamic=True, lock=threading.Lock())
    assert ledger.claim(0, 4, epochs=1) == (0, 0, 4)
    ledger.trained(0, ledger.order(0)[0:4])
    assert ledger.claim(1, 4, epochs=1) == (0, 4, 8)  # rank 1 dies with this claim
    state = ledger.state()
    assert (state["epoch"], state["row"], state["unfinished"]) == (0, 8, [[0, 4, 8]])

    resumed = RowLedger(10, 3, seed=0, dynamic=True, lock=threading.Lock())
    pending = resumed.restore(state)
    assert pending == [(0, 4, 8)]
    counts = torch.zeros(3, 7, dtype=torch.int64).numpy()
    again = DynamicRows(resumed, 2, 1, 4, pending, counts[2])
    assert again.next().tolist() == ledger.order(0)[4:8].tolist()  # handed out first
    assert resumed.unfinished() == [[0, 4, 8]]
    resumed.trained(2, ledger.order(0)[4:8])
    rest = _drain(resumed, [0, 1], epochs=1, batch=4)
    assert [len(rows) for _, rows in rest] == [2]  # then the epoch's remainder
    assert resumed.counts.tolist() == [1] * 10 and resumed.unfinished() == []


def test_a_checkpoint_of_the_other_dispatch_keeps_its_counts_not_its_position():
    static = RowLedger(6, 2, seed=0, dynamic=False)
    static.trained(0, torch.tensor([0, 1, 2]))
    dynamic = RowLedger(6, 2, seed=0, dynamic=True, lock=threading.Lock(), start_epoch=1)
    assert dynamic.restore(static.state()) == []
    assert dynamic.counts.tolist() == [1, 1, 1, 0, 0, 0]
    assert dynamic.epochs_done() == 1


def test_static_rows_walk_the_partition_from_the_saved_position():
    part = torch.tensor([5, 6, 7, 8, 9])
    count = torch.zeros(7, dtype=torch.int64).numpy()
    count[POSITION] = (1 << 32) | 2  # epoch 1, row 2
    rows = StaticRows(part, seed=0, rank=0, epochs=2, batch=2, count=count)
    seen = []
    while (batch := rows.next()) is not None:
        seen.append(batch.tolist())
        rows.done(batch)
    assert [len(b) for b in seen] == [2, 1]  # rows 2..4 of epoch 1's order
    assert (count[POSITION], rows.epoch) == (2 << 32, 2)


def test_hogwild_dynamic_is_a_mode_of_compare():
    spec, = parse_modes("hogwild+dynamic")
    assert (spec.command, spec.flags) == ("hogwild", ("--data-dispatch", "dynamic"))
    for other in ("single+dynamic", "ddp+dynamic"):
        with pytest.raises(ConfigError, match="unknown mode"):
            parse_modes(other)


def _cfg(out, **settings) -> HogwildConfig:
    return HogwildConfig(**{**dict(threads=1, eval_every=1e6, checkpoint_every=0,
                                   progress="off", out=str(out)), **settings})


SLOW = dict(task="tasks_for_tests:dropout_regression", procs=3, slowdown="1:2,2:4")


@pytest.mark.processes
def test_dynamic_dispatch_trains_every_row_twice_in_two_epochs_whatever_the_speeds(
        tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCSGD_TEST_STEP_SLEEP", "0.02")
    summary = hogwild.train(_cfg(tmp_path / "run", samples=600, epochs=2,
                                 data_dispatch="dynamic", **SLOW)).summary
    cover = summary["coverage"]
    assert (cover["min"], cover["max"], cover["spread"]) == (2, 2, 1.0)
    assert summary["samples"] == 2 * 480
    steps = [r["steps"] for r in summary["pacing"]["ranks"]]
    assert steps[2] < steps[0], steps  # the 4x straggler claimed fewer batches


@pytest.mark.processes
def test_static_partitions_leave_a_stragglers_rows_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCSGD_TEST_STEP_SLEEP", "0.02")
    summary = hogwild.train(_cfg(tmp_path / "run", samples=400, epochs=1000, max_seconds=4,
                                 **SLOW)).summary
    cover = summary["coverage"]
    assert summary["data_dispatch"]["kind"] == "static"
    assert cover["max"] > 1.5 * cover["min"], cover  # spread None: some row never trained


@pytest.mark.processes
def test_a_dead_process_s_batch_is_handed_out_again_on_resume(tmp_path, monkeypatch):
    """Killed mid-batch, a process fails the run; its claim stays unfinished in the
    checkpoint, and the resumed run trains it first, then continues the epoch: every row
    ends trained exactly once an epoch."""
    out, rows = tmp_path / "run", 160
    task = dict(task="tasks_for_tests:killed_at_row7", samples=rows, epochs=2, procs=2,
                data_dispatch="dynamic")
    monkeypatch.setenv("ASYNCSGD_TEST_KILL_ROW7", "1")
    with pytest.raises(WorkerError):
        hogwild.train(_cfg(out, **task))
    assert read_json(out / "summary.json")["status"] == "failed"
    monkeypatch.delenv("ASYNCSGD_TEST_KILL_ROW7")
    summary = hogwild.train(_cfg(None, resume=str(out), **task)).summary
    assert summary["stopped_by"] == "epochs"
    # the dead process's claim (the task's batch, 8), and the survivor's too when the failure
    # stopped it mid-batch (16 in one loaded run): whole claims either way
    assert summary["data_dispatch"]["rehanded_samples"] in (8, 16)
    cover = summary["coverage"]
    assert (cover["min"], cover["max"]) == (2, 2), cover
    assert summary["samples"] == 2 * rows
