"""The CUDA paths of the asynchronous modes, with exact oracles: parameter-server workers
that compute on a GPU and Hogwild processes sharing one model on a GPU. They skip without
a GPU; the gradient gathering they rely on is also checked here on the CPU.

(``single`` and ``ddp`` on a GPU, NCCL and AMP: test_single_ddp.py.)
"""

import pytest
import torch

from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.wire.layout import Layout
from asyncsgd.workers.worker import _gather_grads
from conftest import finish, read_json, worker

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_gathering_a_sparse_gradient_adds_its_rows():
    """A GPU worker's model keeps its own gradients; an EmbeddingBag's is sparse and has no
    reshape (main: 'reshape is not implemented for sparse tensors' on the first step of
    sparse-logreg with --device cuda). Repeated rows add up, the rest stay zero."""
    bag = torch.nn.EmbeddingBag(6, 2, mode="sum", sparse=True)
    lin = torch.nn.Linear(2, 1, bias=False)
    model = torch.nn.Sequential(bag, lin)
    model(torch.tensor([[1], [4], [4]])).sum().backward()
    assert bag.weight.grad.is_sparse
    layout = Layout.of(model)
    flat = torch.zeros(layout.total)
    expected = torch.cat([bag.weight.grad.to_dense().reshape(-1), lin.weight.grad.reshape(-1)])
    _gather_grads(model, layout, flat)
    assert torch.equal(flat, expected)
    assert flat[:12].view(6, 2)[[0, 2, 3, 5]].abs().sum() == 0
    assert bag.weight.grad is None and lin.weight.grad is None


@needs_gpu
@pytest.mark.parametrize("task,rows", [("index_counter", 999), ("dense_counter", 2000)])
def test_gpu_workers_lose_no_update(server, cli_env, task, rows):
    """Integer gradients, SGD lr 1, two workers computing on the GPU: index_counter's sparse
    gradient leaves every row at exactly -epochs, dense_counter's scalar at -(samples)."""
    epochs = 2
    args = ("--task", f"tasks_for_tests:{task}", "--samples", rows)
    srv = server(*args, "--workers", 2)
    results = finish([worker(cli_env, srv.address, r, 2, *args, "--epochs", epochs,
                             "--device", "cuda") for r in range(2)])
    for code, _, err in results:
        assert code == 0, err
    code, _, err = srv.wait()
    assert code == 0, err
    assert read_json(srv.out / "summary.json")["stopped_by"] == "workers_done"
    model = load_checkpoint(srv.out / "checkpoint.pt")["model"]
    if task == "index_counter":
        assert torch.equal(model["weight.weight"], torch.full((rows, 1), -float(epochs)))
    else:
        assert model["w"].item() == -epochs * rows


@needs_gpu
def test_hogwild_on_one_gpu_splits_the_data_exactly(tmp_path, run_cli):
    """Three processes update one model on the GPU: disjoint partitions touch disjoint rows,
    so even without a lock every row drops by exactly one per epoch."""
    out = tmp_path / "run"
    res = run_cli("hogwild", "--device", "cuda", "--task", "tasks_for_tests:index_counter",
                  "--samples", 1003, "--procs", 3, "--epochs", 2, "--progress", "off",
                  "--out", out)
    assert res.returncode == 0, res.stderr
    weights = load_checkpoint(out / "checkpoint.pt")["model"]["weight.weight"]
    assert torch.equal(weights.cpu(), torch.full((1003, 1), -2.0))
    assert read_json(out / "summary.json")["samples"] == 2 * 1003
