"""The CUDA paths of the asynchronous modes, with exact oracles: parameter-server workers
that compute on a GPU (their model's parameters and gradients views of flat GPU buffers,
copied to and from pinned ones) and Hogwild processes sharing one model on a GPU. They
skip without a GPU.

(``single`` and ``ddp`` on a GPU, NCCL and AMP: test_single_ddp.py.)
"""

import pytest
import torch

from asyncsgd.run.checkpoint import load_checkpoint
from conftest import finish, read_json, worker

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("task,rows,extra", [
    ("index_counter", 999, ()), ("dense_counter", 2000, ()),
    ("dense_counter", 2000, ("--push-every", 2)), ("dense_counter", 2000, ("--local-steps", 2))])
def test_gpu_workers_lose_no_update(server, cli_env, task, rows, extra):
    """Integer gradients, SGD lr 1, two workers computing on the GPU: index_counter's sparse
    gradient leaves every row at exactly -epochs, dense_counter's scalar at -(samples),
    also when a push sums two steps, or sends the change of two local SGD steps (lr 1),
    the pulled parameters loaded onto the GPU between them.
    (A sparse gradient once failed there on its first step: 'reshape is not implemented
    for sparse tensors'; it now accumulates into the flat gradient, as on the CPU.)"""
    epochs = 2
    args = ("--task", f"tasks_for_tests:{task}", "--samples", rows)
    srv = server(*args, "--workers", 2)
    results = finish([worker(cli_env, srv.address, r, 2, *args, "--epochs", epochs,
                             "--device", "cuda", *extra) for r in range(2)])
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
