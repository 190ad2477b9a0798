"""Tasks whose data are a map-style torch Dataset (asyncsgd/core/datasets.py): batches
collated as a DataLoader collates them, the rows of each process disjoint and together the
whole split, and every mode training such a task through the installed CLI, each process
reading exactly its own partition in its own order."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import finish, read_json, worker
from tasks_for_tests import BlobDataset, blob_dataset
from torch.utils.data import DataLoader, Dataset, IterableDataset

from asyncsgd.core.datasets import DatasetSplit
from asyncsgd.core.signature import PS_PARTITION_SEED
from asyncsgd.core.tasks import Split, Task, epoch_order, partition_indices
from asyncsgd.errors import TaskError

SAMPLES, TRAIN, EPOCHS = 2000, 1600, 2  # blob_dataset keeps 80% for training


class Mixed(Dataset):
    """Items of three inputs of different kinds (a tensor, a numpy array, a float) and an
    int label: what default_collate turns into four tensors."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 3, 2, generator=g)
        self.z = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x[i], self.z[i], float(i) / 2, i % 5


class Numbered(Dataset):
    """Item i is ([i], i): the targets of a batch name the rows it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i)]), i


class Stream(IterableDataset):
    def __iter__(self):
        return iter([])


class Loose(Dataset):
    """Items that are not (input, ..., target) tuples, or hold text."""

    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.item


class _Unsized(Numbered):
    """A Dataset that cannot say its length."""

    def __init__(self):
        super().__init__(0)

    def __len__(self):
        raise TypeError("no len")


def _linear():
    return torch.nn.Linear(1, 2)


def test_a_dataset_split_collates_batches_as_a_dataloader_does():
    data = Mixed(50)
    split = DatasetSplit(data)
    index = torch.tensor([7, 3, 49, 0, 3, 21])
    inputs, targets = split.rows(index)
    loaded = next(iter(DataLoader(data, batch_size=len(index), sampler=index.tolist())))
    assert len(inputs) == 3 and len(split) == 50
    for ours, theirs in zip((*inputs, targets), loaded):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    assert inputs[0].shape == (6, 3, 2) and inputs[1].dtype == torch.float32
    assert inputs[2].dtype == torch.float64 and targets.tolist() == [2, 3, 4, 0, 3, 1]


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_the_partitions_of_a_dataset_are_disjoint_and_cover_it(parts):
    n, seed = 101, 4
    split = Task(name="numbered", model_fn=_linear, train=Numbered(n), test=Numbered(5)).train
    assert isinstance(split, DatasetSplit)
    read = []
    for rank in range(parts):
        part = partition_indices(n, parts, rank, seed)
        _, targets = split.rows(part)
        assert targets.tolist() == part.tolist()  # the rows asked for, in that order
        order = epoch_order(part, seed, rank, 1)
        assert sorted(split.rows(order)[1].tolist()) == sorted(part.tolist())
        assert len(part) in (n // parts, -(-n // parts))
        read.append(set(targets.tolist()))
    assert sorted(r for rows in read for r in rows) == list(range(n))  # disjoint, all covered
    again = split.rows(partition_indices(n, parts, parts - 1, seed))[1]
    assert set(again.tolist()) == read[-1]  # reproducible from the seed


def test_a_task_wraps_datasets_and_refuses_what_cannot_be_one_in_one_clear_error():
    x, y = torch.zeros(4, 1), torch.zeros(4, dtype=torch.long)
    refused = {
        "IterableDataset": Stream(),
        "loader.dataset": DataLoader(Numbered(4)),
        "tuple": (x, y),
    }
    for fragment, value in refused.items():
        with pytest.raises(TaskError, match=fragment):
            Task(name="bad", model_fn=_linear, train=value, test=Split((x,), y))
    with pytest.raises(TaskError, match="the test Dataset _Unsized has no len"):
        Task(name="bad", model_fn=_linear, train=Numbered(4), test=_Unsized())
    for item, fragment in ((torch.zeros(1), "returned a Tensor; its items must be tuples"),
                           ((torch.zeros(1),), "returned a tuple; its items must be tuples"),
                           ((torch.zeros(1), "label"), "element 1 .* to a tuple, not a tensor")):
        task = Task(name="loose", model_fn=_linear, train=Loose(item), test=Loose(item))
        with pytest.raises(TaskError, match=fragment):
            task.train.rows(torch.arange(2))


def test_evaluating_a_dataset_task_equals_evaluating_its_tensors():
    task = blob_dataset()
    test = task.test.dataset
    assert isinstance(test, BlobDataset) and len(task.train) == TRAIN
    tensors = Split((torch.stack([test.transform(r) for r in test.rows]),), test.labels)
    model = task.build_model(0)
    ours, theirs = task.evaluate(model, batch_size=64), task.evaluate(model, tensors)
    assert ours["accuracy"] == theirs["accuracy"]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
    assert task.share_memory_() is task


def _orders(probes: Path) -> list:
    """What each process read: its probe file's indices, in order, per process."""
    return sorted(([int(v) for v in f.read_text().split()] for f in probes.iterdir()
                   if f.name.isdigit()), key=lambda read: read[:5])


def _expected(parts: int, partition_seed: int, order_seed: int) -> list:
    return sorted((torch.cat([epoch_order(partition_indices(TRAIN, parts, rank, partition_seed),
                                          order_seed, rank, epoch)
                              for epoch in range(EPOCHS)]).tolist()
                   for rank in range(parts)), key=lambda read: read[:5])


@pytest.mark.parametrize("mode,procs", [("hogwild", 2), ("single", 1), ("ddp", 2)])
def test_every_mode_trains_a_dataset_task_each_process_on_its_own_partition(
        run_cli, cli_env, tmp_path, mode, procs):
    probes = tmp_path / "probes"
    probes.mkdir()
    cli_env["ASYNCSGD_TEST_PROBE_DIR"] = str(probes)
    seed = 3
    flags = ("--procs", procs) if procs > 1 else ()
    res = run_cli(mode, *flags, "--task", "tasks_for_tests:blob_dataset", "--samples", SAMPLES,
                  "--epochs", EPOCHS, "--seed", seed, "--threads", 1, "--progress", "off",
                  "--out", tmp_path / "run", timeout=180)
    assert res.returncode == 0, res.stderr
    # Exactly one file per training process (the parent read no training row), each the
    # rows of its partition in its epochs' orders: disjoint, and together every row.
    assert _orders(probes) == _expected(procs, seed, seed)
    summary = read_json(tmp_path / "run" / "summary.json")
    assert summary["final_metric"] >= 0.9, summary


def test_ps_workers_train_a_dataset_task_each_on_its_own_partition(server, cli_env, tmp_path):
    probes = tmp_path / "probes"
    probes.mkdir()
    cli_env["ASYNCSGD_TEST_PROBE_DIR"] = str(probes)
    task = ("--task", "tasks_for_tests:blob_dataset", "--samples", SAMPLES)
    srv = server(*task, "--workers", 2)
    procs = [worker(cli_env, srv.address, r, 2, *task, "--epochs", EPOCHS) for r in range(2)]
    for code, _, err in finish(procs):
        assert code == 0, err
    code, _, err = srv.wait()
    assert code == 0, err
    assert sorted(int(f.name) for f in probes.iterdir()) == sorted(p.pid for p in procs)
    assert _orders(probes) == _expected(2, PS_PARTITION_SEED, 0)
    summary = read_json(srv.out / "summary.json")
    assert summary["final_metric"] >= 0.9, summary
