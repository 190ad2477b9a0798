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
    with pytest.raises(ConfigError, match="give --epochs or the length"):
        schedule(0.1, "cosine")
    with pytest.raises(ConfigError, match="give the warm-up in updates"):
        schedule(0.1, "constant", "64samples", counted="updates")
    with pytest.raises(ConfigError, match="steps after the warm-up"):
        schedule(0.1, "linear", "10", steps=10)
    assert schedule(0.1, "constant", "65samples", samples_per_step=32).warmup == 3
    assert schedule(0.1, "cosine:50", steps=10).steps == 50
