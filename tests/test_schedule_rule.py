"""The learning-rate schedule's pure rule: hand-computed values and torch's own schedulers."""

import math

import pytest
import torch

from asyncsgd.core.schedule import Schedule, parse_schedule, parse_warmup, schedule
from asyncsgd.errors import ConfigError


def test_hand_computed_values():
    warm = Schedule(0.4, warmup=4)
    assert [warm(k) for k in range(6)] == [0.1, 0.2, 0.30000000000000004, 0.4, 0.4, 0.4]
    cos = Schedule(1.0, "cosine", steps=6, warmup=2)  # decays over steps 2..5, 0 at 6
    assert [cos(k) for k in range(8)] == [
        0.5, 1.0, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2,
        0.0, 0.0]
    lin = Schedule(0.8, "linear", steps=4)
    assert [lin(k) for k in range(5)] == [0.8, 0.8 * 0.75, 0.4, 0.2, 0.0]
    step = Schedule(1.0, "step", every=2, gamma=0.5, warmup=1)
    assert [step(k) for k in range(6)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25]


def _torch_lrs(make, steps: int, lr: float = 0.3) -> list:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind, make", [
    ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20)),
    ("linear", lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.0, total_iters=20)),
    ("step", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.7)),
])
def test_matches_torch_schedulers(kind, make):
    ours = Schedule(0.3, kind, steps=20, every=3, gamma=0.7)
    assert [ours(k) for k in range(20)] == pytest.approx(_torch_lrs(make, 20), rel=1e-12,
                                                         abs=1e-15)


def test_warmup_matches_torch_linear_then_cosine():
    def make(o):
        lr = torch.optim.lr_scheduler
        return lr.SequentialLR(o, [lr.LinearLR(o, 1 / 5, 1.0, total_iters=4),
                                   lr.CosineAnnealingLR(o, T_max=15)], milestones=[5])
    ours = schedule(0.3, "cosine", "5", steps=20)
    assert [ours(k) for k in range(20)] == pytest.approx(_torch_lrs(make, 20), rel=1e-12)


def test_parsing_and_refusals():
    assert parse_schedule("cosine") == ("cosine", None, 0, 1.0)
    assert parse_schedule("linear:500") == ("linear", 500, 0, 1.0)
    assert parse_schedule("step:100:0.5") == ("step", None, 100, 0.5)
    assert parse_warmup("500") == (500, "steps")
    assert parse_warmup("16000samples") == (16000, "samples")
    for bad in ("cos", "cosine:0", "step:10", "step:0:0.5", "step:10:2", "constant:5"):
        with pytest.raises(ConfigError, match="--lr-schedule"):
            parse_schedule(bad)
    for bad in ("-1", "1.5", "10s"):
        with pytest.raises(ConfigError, match="--warmup"):
            parse_warmup(bad)
    with pytest.raises(ConfigError, match="give it, e.g. --lr-schedule cosine:5000"):
        schedule(0.1, "cosine")
    with pytest.raises(ConfigError, match="give the warm-up in updates"):
        schedule(0.1, "constant", "64samples", counted="updates")
    with pytest.raises(ConfigError, match="steps after the warm-up"):
        schedule(0.1, "linear", "10", steps=10)
    assert schedule(0.1, "constant", "65samples", samples_per_step=32).warmup == 3
    assert schedule(0.1, "cosine:50", steps=10).steps == 50


def _shard(**kw):
    from asyncsgd.servers.shard import ShardConfig, ShardState
    cfg = ShardConfig(index=0, start=0, end=3, rule="sgd", lr=0.5, heartbeat_timeout=5.0,
                      lr_schedule="cosine:10", warmup="2", **kw)
    return ShardState(cfg, torch.zeros(3))


def _push(worker, seq, clock):
    from asyncsgd.wire.protocol import PUSH, Message, Segment
    return Message(type=PUSH, worker=worker, incarnation=1, seq=seq, clock=clock, shard=0,
                   segments=[Segment(0, torch.ones(3))])


def test_the_shard_takes_update_ks_lr_from_its_version_through_a_restart():
    """A gradient of ones moves each parameter by exactly -lr(k) at update k; a shard
    restarted from its checkpoint (its version) goes on with lr(version), not lr(0)."""
    rule = Schedule(0.5, "cosine", steps=10, warmup=2)
    state = _shard()
    for seq in range(1, 5):
        before = state.params.clone()
        state.handle(b"a", _push("w", seq, state.version), 0.0)
        assert torch.equal(state.params,
                           before - torch.tensor(rule(seq - 1), dtype=torch.float32))
        assert state.stats(0.0)["lr"] == rule(seq - 1)
    restarted = _shard()
    restarted.load_state_dict(state.state_dict(), now=0.0)
    before = restarted.params.clone()
    restarted.handle(b"a", _push("w", 5, restarted.version), 0.0)
    assert torch.equal(restarted.params, before - torch.tensor(rule(4), dtype=torch.float32))


def test_a_sync_round_is_one_update_of_the_schedule():
    rule = Schedule(0.5, "cosine", steps=10, warmup=2)
    state = _shard(consistency="sync", expected_workers=2)
    for k in range(3):
        before = state.params.clone()
        state.handle(b"a", _push("a", k + 1, k), 0.0)
        state.handle(b"b", _push("b", k + 1, k), 0.0)
        assert state.version == k + 1
        assert torch.equal(state.params, before - torch.tensor(rule(k), dtype=torch.float32))


def test_the_shard_refuses_a_cosine_without_its_length():
    from asyncsgd.servers.shard import ShardConfig, ShardState
    with pytest.raises(ConfigError, match="cosine:5000"):
        ShardState(ShardConfig(index=0, start=0, end=3, lr_schedule="cosine"), torch.zeros(3))
