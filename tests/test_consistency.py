"""The consistency policies alone, on worker records: no shard, no sockets."""

import pytest
import torch

from asyncsgd.errors import ConfigError
from asyncsgd.servers.consistency import (APPLY, GATHERED, SSP, STALE, Async, Sync, make_policy,
                                          min_live_clock)
from asyncsgd.servers.shard import WorkerRecord
from asyncsgd.wire.protocol import PULL, Message, Segment


def _workers(**clocks) -> dict:
    return {name: WorkerRecord(name, 1, name.encode(), 0.0, pushes=pushes)
            for name, pushes in clocks.items()}


def _hold(record: WorkerRecord) -> Message:
    record.held_pull = Message(type=PULL, worker=record.worker, incarnation=1, seq=9)
    return record.held_pull


def _grad(*values) -> list:
    return [Segment(0, torch.tensor(values, dtype=torch.float32))]


def test_async_answers_everything_at_once():
    policy, workers = Async(), _workers(a=7, b=0)
    _hold(workers["b"])  # none is ever held under async; even one set is not scanned
    assert policy.answers_at_once
    assert policy.may_answer(workers["a"], workers, 0) is True
    assert policy.may_answer(workers["a"], {}, 0) is True  # no expected workers to wait for
    assert policy.releasable(workers, 0) == []
    assert policy.lead(workers["a"], workers) is None
    assert policy.push(workers["a"], _grad(1.0), 1, staleness=5, version=5) == APPLY
    assert policy.round_update(workers, 0) is None and policy.next_round() == []


def test_ssp_2_holds_a_worker_3_clocks_ahead_until_the_slowest_catches_up():
    policy, workers = SSP(2, expected_workers=2), _workers(fast=3, slow=0)
    fast, slow = workers["fast"], workers["slow"]
    assert not policy.answers_at_once
    assert policy.may_answer(fast, workers, 3) is False
    assert policy.may_answer(slow, workers, 3) is True
    _hold(fast)
    assert policy.releasable(workers, 3) == []
    slow.pushes = 1                                    # fast is now exactly 2 ahead
    assert policy.releasable(workers, 4) == [fast]
    assert policy.lead(fast, workers) == 2 and policy.lead(slow, workers) == 0
    assert policy.push(fast, _grad(1.0), 5, staleness=1, version=4) == APPLY


def test_ssp_releases_a_held_worker_when_the_slowest_is_dropped():
    policy, workers = SSP(0, expected_workers=2), _workers(fast=4, slow=1)
    _hold(workers["fast"])
    assert policy.releasable(workers, 5) == []
    workers["slow"].alive = False
    assert min_live_clock(workers) == 4
    assert policy.releasable(workers, 5) == [workers["fast"]]


def test_ssp_answers_no_pull_before_every_expected_worker_came():
    policy, workers = SSP(5, expected_workers=3), _workers(a=0, b=0)
    assert policy.may_answer(workers["a"], workers, 0) is False
    workers.update(_workers(c=0))
    assert policy.may_answer(workers["a"], workers, 0) is True


def test_sync_with_1_backup_worker_applies_a_round_after_2_of_3_and_the_late_one_is_stale():
    policy = Sync(3, expected_workers=3, reduce="mean", backup_workers=1)
    workers = _workers(a=0, b=0, c=0)
    a, b, c = workers["a"], workers["b"], workers["c"]
    assert policy.push(a, _grad(1.0, 2.0, 3.0), 11, staleness=0, version=0) == GATHERED
    assert policy.round_update(workers, 0) is None      # 1 of the 2 it waits for
    assert policy.may_answer(a, workers, 0) is False     # a waits for the round it pushed to
    assert policy.may_answer(c, workers, 0) is True
    assert policy.push(a, _grad(9.0, 9.0, 9.0), 12, staleness=0, version=0) == STALE  # twice
    assert policy.push(b, _grad(3.0, 0.0, -1.0), 21, staleness=0, version=0) == GATHERED
    update = policy.round_update(workers, 0)
    assert torch.equal(update, torch.tensor([2.0, 1.0, 1.0]))  # the mean of a's and b's
    assert policy.next_round() == [(a, 11), (b, 21)]
    assert torch.equal(policy.total, torch.zeros(3)) and policy.members == []
    # c computed on version 0; the round was applied (version 1): stale, never summed.
    assert policy.push(c, _grad(5.0, 5.0, 5.0), 31, staleness=1, version=1) == STALE
    assert torch.equal(policy.total, torch.zeros(3))
    assert policy.may_answer(a, workers, 1) is True


def test_sync_sum_waits_for_every_live_worker_and_a_leaving_one_completes_the_round():
    policy = Sync(2, expected_workers=2, reduce="sum")
    workers = _workers(a=0, b=0)
    _hold(workers["a"])
    assert policy.push(workers["a"], _grad(1.0, 2.0), 1, staleness=0, version=0) == GATHERED
    assert policy.round_update(workers, 0) is None
    assert policy.releasable(workers, 0) == []           # a's pull waits for its round
    workers["b"].alive = False                          # b leaves: a alone completes it
    assert torch.equal(policy.round_update(workers, 0), torch.tensor([1.0, 2.0]))
    assert policy.next_round() == [(workers["a"], 1)]
    assert policy.releasable(workers, 1) == [workers["a"]]


def test_sync_applies_no_round_before_every_expected_worker_came():
    policy = Sync(1, expected_workers=2, reduce="sum")
    workers = _workers(a=0)
    assert policy.push(workers["a"], _grad(4.0), 1, staleness=0, version=0) == GATHERED
    assert policy.round_update(workers, 0) is None
    workers.update(_workers(b=0))
    assert policy.round_update(workers, 0) is None       # b has come, and not pushed
    assert policy.push(workers["b"], _grad(2.0), 1, staleness=0, version=0) == GATHERED
    assert torch.equal(policy.round_update(workers, 0), torch.tensor([6.0]))


def test_make_policy_builds_each_kind_from_plain_values():
    assert type(make_policy("async", 0, size=4)) is Async
    ssp = make_policy("ssp", 3, size=4, expected_workers=2)
    assert (type(ssp), ssp.bound, ssp.expected_workers) == (SSP, 3, 2)
    sync = make_policy("sync", 0, size=4, expected_workers=3, reduce="sum", backup_workers=1)
    assert (type(sync), sync.reduce, sync.backup_workers, len(sync.total)) == (Sync, "sum", 1, 4)
    with pytest.raises(ConfigError, match="use mean or sum"):
        make_policy("async", 0, size=4, reduce="median")
    with pytest.raises(ConfigError, match="use async, ssp or sync"):
        make_policy("bsp", 0, size=4)
