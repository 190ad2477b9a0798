"""Tasks, data, partitions, the optimizer and checkpoints, without training processes."""

import os
import pickle

import numpy as np
import pytest
import torch

from asyncsgd import CheckpointError, DataError, TaskError, load_task
from asyncsgd.core.data import mnist1d, read_idx, write_idx
from asyncsgd.core.tasks import epoch_order, partition_indices
from asyncsgd.modes.optim import SGD
from asyncsgd.run.checkpoint import load_checkpoint, save_checkpoint
from conftest import read_json


@pytest.mark.parametrize("n, parts", [(1000, 1), (1003, 8), (7, 3), (4000, 2)])
def test_partitions_disjoint_cover_and_balanced(n, parts):
    chunks = [partition_indices(n, parts, r, seed=5) for r in range(parts)]
    flat = torch.cat(chunks)
    assert sorted(flat.tolist()) == list(range(n))  # cover, and no row twice
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    assert torch.equal(chunks[0], partition_indices(n, parts, 0, seed=5))  # deterministic
    if n > 10:
        assert not torch.equal(chunks[0], partition_indices(n, parts, 0, seed=6))


def test_each_epoch_reshuffles_a_partition_the_same_way():
    part = partition_indices(1000, 4, 1, seed=3)
    orders = [epoch_order(part, 3, 1, epoch) for epoch in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == sorted(part.tolist())  # a shuffle of the same rows
    assert not torch.equal(orders[0], orders[1]) and not torch.equal(orders[1], orders[2])
    assert torch.equal(orders[2], epoch_order(part, 3, 1, 2))  # a function of (seed, rank, epoch)
    assert not torch.equal(orders[0], epoch_order(part, 3, 2, 0))  # ranks shuffle differently


@pytest.mark.parametrize("mode", ["hogwild", "single", "worker"])
def test_every_mode_trains_in_the_order_of_seed_rank_and_epoch(run_cli, cli_env, tmp_path,
                                                                server, mode):
    """The rows each mode really trains on, step by step, over 2 epochs: exactly
    epoch_order(its partition, seed, rank 0, epoch) for each epoch in turn."""
    rows, seed = 40, 5
    cli_env["ASYNCSGD_TEST_PROBE_DIR"] = str(tmp_path)
    task = ("--task", "tasks_for_tests:order_probe", "--samples", rows, "--epochs", 2,
            "--seed", seed, "--progress", "off")
    if mode == "worker":  # a PS worker's partition uses the server's seed 0
        srv = server("--task", "tasks_for_tests:order_probe", "--samples", rows)
        res = run_cli("worker", "--server", srv.address, "--rank", 0, "--world", 1,
                      "--threads", 1, *task, timeout=120)
        part = partition_indices(rows, 1, 0, 0)
    else:
        procs = ("--procs", 1) if mode == "hogwild" else ()
        res = run_cli(mode, *procs, *task, "--out", tmp_path / "run", timeout=120)
        part = partition_indices(rows, 1, 0, seed)
    assert res.returncode == 0, res.stderr
    seen, = [f.read_text().split() for f in tmp_path.iterdir() if f.name.isdigit()]
    expected = torch.cat([epoch_order(part, seed, 0, epoch) for epoch in range(2)])
    assert [int(r) for r in seen] == expected.tolist()


def test_mnist1d_is_generated_once_then_cached(tmp_path):
    first = mnist1d(500, str(tmp_path))
    files = list(tmp_path.glob("*.npz"))
    assert len(files) == 1
    second = mnist1d(500, str(tmp_path))
    assert first["x"].shape == (400, 40) and first["x_test"].shape == (100, 40)
    for key in first:
        assert np.array_equal(first[key], second[key])
    assert set(np.unique(first["y"])) <= set(range(10))
    # The second call read the file: marked data in it comes back, nothing regenerated it.
    marked = {**second, "x": np.full_like(second["x"], 7.0)}
    np.savez(files[0], **marked)
    assert np.array_equal(mnist1d(500, str(tmp_path))["x"], marked["x"])
    assert list(tmp_path.glob("*.npz")) == files


def test_torn_cache_file_is_regenerated(tmp_path):
    mnist1d(200, str(tmp_path))
    path = next(tmp_path.glob("*.npz"))
    path.write_bytes(b"not an npz")
    assert mnist1d(200, str(tmp_path))["x"].shape == (160, 40)


def test_sparse_logreg_gradient_touches_only_active_features():
    task = load_task("sparse-logreg", samples=2000)
    model = task.build_model(0)
    inputs, targets = task.train.rows(torch.arange(16))
    task.loss_fn(model(*inputs), targets).backward()
    grad = model.weight.weight.grad
    assert grad.is_sparse
    active = set(inputs[0][inputs[1] > 0].tolist())
    rows = set(grad.coalesce().indices()[0].tolist())
    assert rows - {task.info["features"]} <= active
    assert len(rows) <= 16 * 60


def _idx_dir(tmp_path, n_train=600, n_test=200, gz=False):
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = np.zeros((n, 28, 28), np.uint8)
        for i, y in enumerate(labels):  # a bright bar whose row encodes the label
            images[i, 2 + 2 * y: 4 + 2 * y, 4:24] = 255
        images = np.clip(images + rng.integers(0, 40, images.shape), 0, 255).astype(np.uint8)
        write_idx(tmp_path / f"{split}-images-idx3-ubyte{suffix}", images)
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte{suffix}", labels)
    return tmp_path


def test_idx_round_trip_and_errors(tmp_path):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.idx", array)
    assert np.array_equal(read_idx(tmp_path / "a.idx"), array)
    raw = (tmp_path / "a.idx").read_bytes()
    (tmp_path / "short.idx").write_bytes(raw[:-1])
    with pytest.raises(DataError, match="header says shape"):
        read_idx(tmp_path / "short.idx")
    (tmp_path / "bad.idx").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(tmp_path / "bad.idx")


def test_missing_idx_files_are_named(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte"):
        load_task("mnist-mlp", data_dir=str(tmp_path))


def test_trains_on_local_idx_files(tmp_path, run_cli):
    (tmp_path / "mnist").mkdir()
    data = _idx_dir(tmp_path / "mnist", gz=True)
    res = run_cli("hogwild", "--task", "mnist-mlp", "--data-dir", data, "--procs", "2",
                  "--epochs", "4", "--out", tmp_path / "run", "--progress", "off")
    assert res.returncode == 0, res.stderr
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["final_metric"] > 0.9  # the bars are easy: far above chance (0.1)
    assert summary["samples"] == 4 * 600


def test_user_task_must_return_a_task():
    with pytest.raises(TaskError, match="returned int"):
        load_task("tasks_for_tests:not_a_task")


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.01)])
def test_sgd_matches_torch_sgd(momentum, weight_decay):
    torch.manual_seed(0)
    a = torch.nn.Linear(5, 3)
    b = torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    ours = SGD(a.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for _ in range(5):
        x = torch.randn(8, 5)
        for model, opt in ((a, ours), (b, ref)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_sgd_sparse_update_touches_only_used_rows():
    emb = torch.nn.EmbeddingBag(10, 2, mode="sum", sparse=True)
    before = emb.weight.detach().clone()
    opt = SGD(emb.parameters(), lr=1.0, weight_decay=0.1)
    emb(torch.tensor([[1, 3]])).sum().backward()
    opt.step()
    changed = (emb.weight != before).any(1).nonzero().flatten().tolist()
    assert changed == [1, 3]
    assert torch.allclose(emb.weight[1], before[1] - (1 + 0.1 * before[1]))


def test_checkpoint_round_trip_and_atomic_replace(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(3)}, "samples": 5})
    save_checkpoint(path, {"model": {"w": torch.zeros(3)}, "samples": 9})
    record = load_checkpoint(path)
    assert record["samples"] == 9 and torch.equal(record["model"]["w"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    _Exploit.marker = marker
    path = tmp_path / "checkpoint.pt"
    with open(path, "wb") as fh:
        torch.save({"format": "asyncsgd-checkpoint", "version": 1, "x": _Exploit()}, fh)
    with pytest.raises(CheckpointError, match="refused: loading it would call posix.system"):
        load_checkpoint(path)
    assert not marker.exists()
    with open(path, "wb") as fh:
        pickle.dump(_Exploit(), fh)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert not marker.exists()


def test_foreign_or_garbage_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        load_checkpoint(path)
    torch.save({"weights": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match="not an asyncsgd checkpoint"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
