"""--clip-grad-norm and --accumulate: the pure rules, and single's steps in this process."""

from __future__ import annotations

import pytest
import torch

from asyncsgd.modes.gradients import Clipper, accumulate, micro_batches
from asyncsgd.modes.optim import SGD
from asyncsgd.modes.precision import Precision
from conftest import one_line_error, read_json


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _data(n: int = 20) -> tuple:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _grads(net) -> list:
    return [p.grad.clone() for p in net.parameters()]


def test_clipping_equals_torchs_clip_grad_norm_exactly():
    x, y = _data()
    clipped, reference = _net(), _net()
    for net in (clipped, reference):
        torch.nn.functional.cross_entropy(net(x) * 50, y).backward()  # a norm well above 0.1
    clipper = Clipper(0.1)
    norm = clipper(clipped.parameters())
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    assert torch.equal(norm, ref_norm) and norm > 0.1
    assert all(torch.equal(a, b) for a, b in zip(_grads(clipped), _grads(reference)))
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in _grads(clipped)]))
    assert abs(total.item() - 0.1) < 1e-6  # the total 2-norm over all parameters
    clipper(clipped.parameters())  # at the bound now: not clipped again
    assert clipper.to_dict() == {"max_norm": 0.1, "steps": 2, "clipped_steps": 1}


def test_clipping_by_hand():
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(1))
    p.grad, q.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert Clipper(1.0)([p, q]).item() == 5.0
    coef = 1.0 / (5.0 + 1e-6)  # torch's: max_norm / (norm + 1e-6)
    assert torch.allclose(p.grad, torch.tensor([3 * coef, 0.0]), rtol=0, atol=1e-7)
    assert torch.allclose(q.grad, torch.tensor([4 * coef]), rtol=0, atol=1e-7)


def test_an_overflowed_fp16_gradient_is_not_counted_as_clipped():
    """fp16's scaler skips that step: nothing was clipped and applied."""
    p = torch.nn.Parameter(torch.zeros(2))
    clip = Clipper(1.0)
    for grad in ([3.0, 4.0], [float("inf"), 0.0], [0.1, 0.0]):
        p.grad = torch.tensor(grad)
        clip([p])
    assert clip.to_dict() == {"max_norm": 1.0, "steps": 3, "clipped_steps": 1}


def test_clipping_sparse_gradients_as_their_dense_equals():
    """An embedding's sparse gradient (torch's clip_grad_norm_ refuses it), accumulated
    twice so that rows repeat uncoalesced: clipped as the same gradient made dense."""
    torch.manual_seed(0)
    sparse = torch.nn.Embedding(10, 3, sparse=True)
    dense = torch.nn.Embedding(10, 3)
    dense.load_state_dict(sparse.state_dict())
    for net in (sparse, dense):
        for rows in ([1, 2, 2], [2, 5]):
            (net(torch.tensor(rows)) * 10).sum().backward()
    clipper = Clipper(0.5)
    norm = clipper(sparse.parameters())
    ref = torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5)
    assert torch.allclose(norm, ref)
    assert torch.allclose(sparse.weight.grad.to_dense(), dense.weight.grad, rtol=0, atol=1e-7)
    assert clipper.clipped == 1


@pytest.mark.parametrize("rows, k", [(20, 4), (19, 4), (3, 5), (20, 1)])
def test_accumulated_micro_batches_equal_one_big_batchs_mean_gradient(rows, k):
    x, y = _data(rows)
    accumulated, big = _net(), _net()
    index = torch.arange(rows)

    def loss_of(part):
        return torch.nn.functional.cross_entropy(accumulated(x[part]), y[part])

    loss = accumulate(index, k, loss_of, lambda loss: loss.backward())
    whole = torch.nn.functional.cross_entropy(big(x), y)
    whole.backward()
    assert abs(loss.item() - whole.item()) < 1e-6
    for a, b in zip(_grads(accumulated), _grads(big)):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_micro_batches_cover_the_rows_once_with_their_shares():
    parts = micro_batches(torch.arange(10), 4)
    assert [p.tolist() for p, _ in parts] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert sum(w for _, w in parts) == 1.0
    assert len(micro_batches(torch.arange(2), 4)) == 2  # never an empty micro-batch


def test_accumulate_syncs_only_the_last_micro_batch():
    entered = []
    accumulate(torch.arange(8), 4, lambda part: part.float().sum(), lambda loss: None,
               no_sync=lambda: _Noting(entered))
    assert entered == [1, 1, 1]  # K-1 micro-batches without the all-reduce


class _Noting:
    def __init__(self, entered):
        self.entered = entered

    def __enter__(self):
        self.entered.append(1)

    def __exit__(self, *exc):
        return False


def test_worker_drops_an_overflowed_fp16_gradient():
    """The parameter-server worker's fp16 path (no optimizer step of its own), on CPU."""
    net = torch.nn.Linear(3, 1)
    flat = torch.zeros(4)
    net.weight.grad, net.bias.grad = flat[:3].view(1, 3), flat[3:]
    precision = Precision("fp16", "cpu")
    unscaler = SGD(net.parameters(), lr=1.0)  # the worker's: never stepped
    scale = precision.scaler.get_scale()
    precision.backward(net(torch.ones(2, 3)).sum())
    assert not precision.overflowed(unscaler, flat)
    assert torch.equal(flat, torch.tensor([2.0, 2.0, 2.0, 2.0]))  # the scale taken off
    flat.zero_()
    precision.backward((net(torch.ones(2, 3)) * float("inf")).sum())
    assert precision.overflowed(unscaler, flat)
    assert precision.scaler.get_scale() == scale / 2


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_hogwild_fp16_step_is_the_float32_step_or_none(device):
    """Hogwild's fp16 path with its own SGD (not torch.optim): the scale is a power of two,
    so the unscaled, clipped step equals float32's exactly; an overflowed step is skipped
    and halves the scale."""
    x, y = (t.to(device) for t in _data())
    scaled, plain = _net().to(device), _net().to(device)
    precision = Precision("fp16", device)
    opt, reference = SGD(scaled.parameters(), lr=0.1), SGD(plain.parameters(), lr=0.1)
    loss_fn = torch.nn.functional.cross_entropy
    precision.backward(loss_fn(scaled(x), y))
    precision.unscale(opt)
    Clipper(0.05)(scaled.parameters())
    precision.step(opt)
    loss_fn(plain(x), y).backward()
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    reference.step()
    assert all(torch.equal(a, b) for a, b in zip(scaled.parameters(), plain.parameters()))
    before, scale = [p.detach().clone() for p in scaled.parameters()], precision.scaler.get_scale()
    opt.zero_grad()
    precision.backward(loss_fn(scaled(x), y) * float("inf"))
    precision.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(scaled.parameters(), before))
    assert precision.scaler.get_scale() == scale / 2


def _final_weights(out) -> list:
    model = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    return [t.double() for t in model.values()]


def test_single_with_accumulation_steps_as_the_bigger_batch(tmp_path, run_cli_here):
    """4 micro-batches of 8 rows take the steps of one batch of 32, to float rounding."""
    common = ("single", "--task", "mnist1d-mlp", "--samples", 400, "--epochs", 2,
              "--threads", 1, "--progress", "off", "--eval-every", 60, "--lr", 0.1)
    res = run_cli_here(*common, "--batch-size", 8, "--accumulate", 4, "--out", tmp_path / "acc")
    assert res.returncode == 0, res.stderr
    res = run_cli_here(*common, "--batch-size", 32, "--out", tmp_path / "big")
    assert res.returncode == 0, res.stderr
    for a, b in zip(_final_weights(tmp_path / "acc"), _final_weights(tmp_path / "big")):
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
    summary = read_json(tmp_path / "acc" / "summary.json")
    assert summary["accumulate"] == 4 and summary["global_batch_size"] == 32
    assert summary["steps"] == read_json(tmp_path / "big" / "summary.json")["steps"]


def test_single_clips_and_records_it(tmp_path, run_cli_here):
    res = run_cli_here("single", "--task", "mnist1d-mlp", "--samples", 200, "--epochs", 1,
                       "--threads", 1, "--progress", "off", "--clip-grad-norm", 1e-3,
                       "--out", tmp_path / "run")
    assert res.returncode == 0, res.stderr
    clipping = read_json(tmp_path / "run" / "summary.json")["clipping"]
    assert clipping["max_norm"] == 1e-3 and clipping["clipped_steps"] == clipping["steps"] > 0


def test_accumulate_with_balance_is_one_clear_line(run_cli_here):
    one_line_error(run_cli_here("ddp", "--procs", 2, "--balance", "batch", "--accumulate", 2,
                                "--progress", "off"), "--accumulate with --balance batch")


def test_worker_refuses_accumulate_with_push_every(run_cli_here):
    one_line_error(run_cli_here("worker", "--accumulate", 2, "--push-every", 4, "--progress",
                                "off"), "--accumulate 2 and --push-every 4: choose one")


def test_fp16_on_cpu_is_refused_in_hogwild_and_the_worker(run_cli_here, tmp_path):
    one_line_error(run_cli_here("hogwild", "--amp", "fp16", "--samples", 100, "--progress", "off",
                                "--out", tmp_path / "run"), "--amp fp16 needs --device cuda")
    assert not (tmp_path / "run").exists()
    one_line_error(run_cli_here("worker", "--amp", "fp16", "--progress", "off"),
                   "--amp fp16 needs --device cuda")


def test_whole_jobs_hand_the_step_settings_to_their_workers():
    from asyncsgd.config import JobConfig, make_config
    from asyncsgd.jobs.roles import worker_settings

    job = make_config(JobConfig, None, dict(accumulate=2, clip_grad_norm=1.5, amp="bf16"))
    cfg = worker_settings(job, "tcp://127.0.0.1:5555", 1, 2)
    assert (cfg.accumulate, cfg.clip_grad_norm, cfg.amp) == (2, 1.5, "bf16")


def test_compare_hands_the_step_settings_to_every_training_process(tmp_path):
    from asyncsgd.comparison.mode_run import ModeRun
    from asyncsgd.config import CompareConfig
    from asyncsgd.config.modes import parse_modes

    cfg = CompareConfig(procs=2, clip_grad_norm=0.5, accumulate=4)
    for spec in parse_modes("single,hogwild,ddp,ps-async"):
        run = ModeRun(cfg, spec, 0, tmp_path, {}, shown=None)
        flags = " ".join(run.command() if spec.command != "ps-server" else
                         run.worker_command("tcp://127.0.0.1:1", 1))
        assert " --clip-grad-norm 0.5 --accumulate 4" in flags, (spec.name, flags)
    server = " ".join(ModeRun(cfg, parse_modes("ps-async")[0], 0, tmp_path, {},
                              shown=None).command())
    assert "--accumulate" not in server and "--clip-grad-norm" not in server
