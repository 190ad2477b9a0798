"""A single/ddp run's checkpointed state (``modes.resume.SyncState``) on its own: saved,
written and read back, restored; two ranks share rank 0's through a sum, in threads."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from asyncsgd.errors import CheckpointError
from asyncsgd.modes.optim import SGD, Adam
from asyncsgd.modes.resume import SyncState, resumed_start
from asyncsgd.run.checkpoint import load_checkpoint, rng_state, save_checkpoint

CPU = torch.device("cpu")


def _params(seed: int = 0) -> list:
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def _stepped(opt, steps: int, seed: int = 1):
    """``opt`` after ``steps`` updates with fixed gradients, so its buffers are not empty."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in opt.params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt


class _Recorder:
    """What ``SyncState.restore`` asks of rank 0's recorder: the error for a bad state."""

    def bad_state(self, what: str) -> CheckpointError:
        return CheckpointError(what)


def test_state_round_trips_through_a_checkpoint_file(tmp_path):
    saved_opt = _stepped(SGD(_params(), lr=0.1, momentum=0.9), 3)
    state = SyncState(saved_opt, None, CPU, rank=0, world=1, agree=lambda v: v, start=(0, 0))
    state.position = (2, 48)
    state.gather_rngs()
    expected_draw = torch.rand(5)  # what the generators give next, as they were saved
    save_checkpoint(tmp_path / "checkpoint.pt", {"state": state.to_dict()})
    loaded = load_checkpoint(tmp_path / "checkpoint.pt")["state"]
    assert [(p["epoch"], p["row"]) for p in loaded["processes"]] == [(2, 48)]
    assert loaded["scaler"] is None

    opt = SGD(_params(), lr=0.1, momentum=0.9)
    restored = SyncState(opt, None, CPU, rank=0, world=1, agree=lambda v: v, start=(2, 48))
    torch.manual_seed(99)
    restored.restore(loaded, _Recorder())
    assert sorted(opt.buffers) == [0, 1]
    for i in (0, 1):
        assert torch.equal(opt.buffers[i], saved_opt.buffers[i])
    restored.set_resumed_rng()
    assert torch.equal(torch.rand(5), expected_draw)


def test_a_rule_of_another_kind_starts_afresh(caplog):
    saved = {"optimizer": _stepped(Adam(_params(), lr=0.01), 2).state_dict(), "scaler": None,
             "processes": [{"epoch": 0, "row": 16, "rng": None}]}
    opt = SGD(_params(), lr=0.1, momentum=0.9)
    state = SyncState(opt, None, CPU, rank=0, world=1, agree=lambda v: v, start=(0, 16))
    with caplog.at_level(logging.WARNING, logger="asyncsgd.modes.resume"):
        state.restore(saved, _Recorder())
    assert opt.buffers == {}
    assert state.resumed_rng is None
    assert "the checkpoint's update rule (adam) is not this run's (sgd)" in caplog.text


def test_a_generator_of_another_size_is_a_bad_state():
    saved = {"optimizer": None, "scaler": None,
             "processes": [{"epoch": 0, "row": 0, "rng": {"torch": torch.zeros(7,
                                                                              dtype=torch.uint8)}}]}
    state = SyncState(SGD(_params(), lr=0.1), None, CPU, rank=0, world=1, agree=lambda v: v,
                      start=(0, 0))
    with pytest.raises(CheckpointError) as err:
        state.restore(saved, _Recorder())
    size = torch.get_rng_state().numel()
    assert str(err.value) == f"a saved torch generator state has 7 bytes, this torch's {size}"


def test_resumed_start_of_each_kind_of_checkpoint():
    def recorder(resumed):
        return SimpleNamespace(resumed=resumed, epochs_done=3, run=SimpleNamespace(
            checkpoint="ckpt.pt"), bad_state=_Recorder().bad_state)

    assert resumed_start(recorder(None), rows=64, world=1) == [3, 0, 0]
    one = {"processes": [{"epoch": 2, "row": 16, "rng": {"torch": torch.zeros(1)}}]}
    assert resumed_start(recorder(one), rows=64, world=1) == [2, 16, 1]
    two = {"processes": [{"epoch": 2, "row": 16, "rng": {}}, {"epoch": 2, "row": 16, "rng": {}}]}
    assert resumed_start(recorder(two), rows=64, world=1) == [3, 0, 1]
    assert [p["rng"] for p in two["processes"]] == [None, None]
    past = {"processes": [{"epoch": 2, "row": 80, "rng": None}]}
    with pytest.raises(CheckpointError, match=r"^it resumes at row 80 of an epoch of 64 rows$"):
        resumed_start(recorder(past), rows=64, world=1)


class _ThreadSum:
    """An all-reduce (sum) between threads standing in for ranks: every rank's tensor,
    summed in rank order, on every rank."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world

    def of(self, rank: int):
        def agree(vector: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = vector.clone()
            self.barrier.wait()
            total = sum(self.slots[1:], self.slots[0].clone())
            self.barrier.wait()
            return vector.copy_(total)
        return agree


def test_two_ranks_get_rank_0s_rule_and_their_own_generators():
    source = _stepped(Adam(_params(), lr=0.01, weight_decay=0.01), 3)
    rank_0_rng = rng_state()
    torch.manual_seed(11)
    rank_1_rng = rng_state()
    saved = {"optimizer": source.state_dict(), "scaler": None,
             "processes": [{"epoch": 1, "row": 32, "rng": rank_0_rng},
                           {"epoch": 1, "row": 32, "rng": rank_1_rng}]}
    sums = _ThreadSum(2)
    states = [SyncState(Adam(_params(), lr=0.01, weight_decay=0.01), None, CPU, rank=r,
                        world=2, agree=sums.of(r), start=(1, 32)) for r in range(2)]
    errors = []

    def rank(r: int) -> None:
        try:
            states[r].restore(saved if r == 0 else None, _Recorder() if r == 0 else None)
        except Exception as exc:  # the test thread reports it
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    for state in states:
        assert state.opt.steps == 3
        assert sorted(state.opt.buffers) == [0, 1]
        for i in (0, 1):
            assert all(torch.equal(mine, theirs) for mine, theirs
                       in zip(state.opt.buffers[i], source.buffers[i]))
    assert states[0].resumed_rng is rank_0_rng
    assert set(states[1].resumed_rng) == {"torch"}
    assert torch.equal(states[1].resumed_rng["torch"], rank_1_rng["torch"])
