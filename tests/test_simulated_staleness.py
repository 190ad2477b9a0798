"""``single --simulate-staleness S`` and ``--optimizer adam``: each gradient is applied S
steps after it was computed, checked against a replay of the same batches by hand."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncsgd.config import SingleConfig
from asyncsgd.core.tasks import epoch_order, load_task
from asyncsgd.modes.single import train
from asyncsgd.modes.syncloop import padded_partition
from asyncsgd.run.checkpoint import load_checkpoint

TASK, SAMPLES, EPOCHS, LR = "tasks_for_tests:regression", 64, 3, 0.05


def _trained(tmp_path, **settings) -> tuple:
    cfg = SingleConfig(**{**dict(task=TASK, samples=SAMPLES, epochs=EPOCHS, lr=LR, threads=1,
                                 eval_every=1e6, checkpoint_every=0, progress="off",
                                 out=str(tmp_path / "run")), **settings})
    result = train(cfg)
    return load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"], result.summary


def _batches(task, epochs: int = EPOCHS):
    """The batches single trains on, in order (its data order is a function of the seed)."""
    part = padded_partition(len(task.train), 1, 0, 0)
    for epoch in range(epochs):
        order = epoch_order(part, 0, 0, epoch)
        for start in range(0, len(order), task.batch_size):
            yield task.train.rows(order[start:start + task.batch_size])


def _replay(staleness: int, make_opt, task_name: str = TASK, samples: int = SAMPLES,
            epochs: int = EPOCHS) -> tuple:
    """Parameters after applying each batch's gradient ``staleness`` steps late, by hand on
    a copy of the model."""
    task = load_task(task_name, samples=samples)
    model = task.build_model(0)
    opt = make_opt(model.parameters())
    in_flight, steps = [], 0
    for inputs, y in _batches(task, epochs):
        model.zero_grad()
        task.loss_fn(model(*inputs), y).backward()
        in_flight.append([p.grad.clone() for p in model.parameters()])
        steps += 1
        if len(in_flight) > staleness:
            for p, g in zip(model.parameters(), in_flight.pop(0)):
                p.grad = g
            opt.step()
    return model.state_dict(), steps


@pytest.mark.parametrize("staleness", [0, 1, 3])
@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.01)])
def test_gradients_are_applied_exactly_staleness_steps_late(tmp_path, staleness, momentum,
                                                            weight_decay):
    got, summary = _trained(tmp_path, simulate_staleness=staleness, momentum=momentum,
                            weight_decay=weight_decay)
    want, steps = _replay(staleness, lambda ps: torch.optim.SGD(
        ps, lr=LR, momentum=momentum, weight_decay=weight_decay))
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6), name
    if staleness:
        assert summary["simulated_staleness"] == staleness
        assert summary["updates_applied"] == steps - staleness
        assert summary["gradients_never_applied"] == staleness
    else:
        assert "simulated_staleness" not in summary


def test_staleness_changes_the_result(tmp_path):
    """The oracle can tell: one step of staleness does not give the fresh result."""
    fresh, _ = _replay(0, lambda ps: torch.optim.SGD(ps, lr=LR))
    stale, _ = _trained(tmp_path, simulate_staleness=1)
    assert not all(torch.allclose(stale[k], fresh[k], atol=1e-6) for k in fresh)


@pytest.mark.parametrize("staleness, weight_decay", [(0, 0.0), (2, 0.0), (2, 0.01)])
def test_adam_is_torch_adam(tmp_path, staleness, weight_decay):
    got, summary = _trained(tmp_path, optimizer="adam", lr=None, simulate_staleness=staleness,
                            weight_decay=weight_decay)
    lr = load_task(TASK, samples=SAMPLES).lr
    want, _ = _replay(staleness, lambda ps: torch.optim.Adam(ps, lr=lr,
                                                             weight_decay=weight_decay))
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6), name
    assert summary["optimizer"] == "adam"


def test_sparse_gradients_are_queued_and_applied_late(tmp_path):
    """sparse-logreg's EmbeddingBag gradients stay sparse in the queue: each late update
    touches the rows its own batch used, exactly as a replay applies them."""
    samples, staleness = 256, 2
    got, summary = _trained(tmp_path, task="sparse-logreg", samples=samples, lr=None,
                            simulate_staleness=staleness)
    lr = load_task("sparse-logreg", samples=samples).lr
    want, steps = _replay(staleness, lambda ps: torch.optim.SGD(ps, lr=lr), "sparse-logreg",
                          samples)
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6), name
    assert summary["updates_applied"] == steps - staleness


def test_resume_keeps_the_gradients_in_flight(tmp_path):
    """The queue is in the checkpoint: a run resumed at an epoch's end applies the gradients
    that were in flight, exactly as the uninterrupted replay does."""
    staleness = 2
    _, first = _trained(tmp_path, simulate_staleness=staleness, epochs=EPOCHS - 1)
    got, summary = _trained(tmp_path, simulate_staleness=staleness, out=None,
                            resume=str(tmp_path / "run"))
    want, steps = _replay(staleness, lambda ps: torch.optim.SGD(ps, lr=LR))
    for name in want:
        assert torch.allclose(got[name], want[name], atol=1e-6), name
    resumed_steps = steps - (first["updates_applied"] + staleness)
    assert summary["updates_applied"] == resumed_steps   # counted since the resume
    assert summary["gradients_never_applied"] == staleness


@pytest.mark.parametrize("args, fragment", [
    (["single", "--simulate-staleness", "-1"], "-1 is not in the range"),
    (["ddp", "--procs", "2", "--simulate-staleness", "2"], "is synchronous"),
    (["single", "--optimizer", "adam", "--momentum", "0.9"], "--momentum is sgd's"),
    (["single", "--optimizer", "adam", "--task", "sparse-logreg", "--epochs", "1"],
     "adam takes dense gradients"),
])
def test_bad_settings_are_one_clear_line(run_cli_here, tmp_path, args, fragment):
    res = run_cli_here(*args, "--progress", "off", "--out", tmp_path / "run")
    assert res.returncode != 0 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_delayed_wrapper_keeps_what_the_summary_reports():
    from asyncsgd.modes.optim import SGD, Delayed
    w = torch.nn.Parameter(torch.zeros(1))
    opt = Delayed(SGD([w], lr=1.0), staleness=2)
    for k in range(1, 6):   # gradients 1..5; applied: 1, 2, 3 (two still in flight)
        opt.zero_grad()
        w.grad = torch.tensor([float(k)])
        opt.step()
    assert w.item() == -6.0 and opt.applied == 3 and len(opt.in_flight) == 2
    assert copy.copy(opt.lr) == 1.0
