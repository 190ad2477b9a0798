"""The task abstraction every training mode uses, and the built-in tasks.

A task is a model factory, train and test data, a loss and an evaluation.
Data are tensors: ``Split.inputs`` is a tuple of tensors whose first dimension
indexes samples (the model is called as ``model(*inputs)``) and
``Split.targets`` holds the labels. Modes index rows, so any data that fits
in memory works, dense or sparse.

Your own task: write a module-level function returning a ``Task`` and pass
``--task package.module:function``. The function may take any of the keyword
arguments ``samples``, ``data_dir``, ``cache_dir``, ``seed``. Keep the model
factory and loss module-level (or ``functools.partial`` of such) so the task
can be sent to spawned worker processes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import DataError, TaskError
from . import data, models


@dataclass
class Split:
    """One split of a data set: input tensors and target tensor, row-aligned."""

    inputs: tuple
    targets: torch.Tensor

    def __post_init__(self):
        self.inputs = tuple(self.inputs)
        n = len(self.targets)
        for t in self.inputs:
            if len(t) != n:
                raise TaskError(f"split inputs have {len(t)} rows but targets have {n}")

    def __len__(self) -> int:
        return len(self.targets)

    def rows(self, index: torch.Tensor) -> tuple:
        """``(inputs, targets)`` for the rows in ``index``."""
        return tuple(t[index] for t in self.inputs), self.targets[index]

    def share_memory_(self) -> "Split":
        for t in (*self.inputs, self.targets):
            t.share_memory_()
        return self


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return (logits.argmax(1) == targets).float().mean().item()


@dataclass
class Task:
    """A model factory, data, a loss and an evaluation, plus sensible defaults."""

    name: str
    model_fn: Callable[[], nn.Module]
    train: Split
    test: Split
    loss_fn: Callable = F.cross_entropy
    lr: float = 0.1
    batch_size: int = 32
    description: str = ""
    info: dict = field(default_factory=dict)

    def build_model(self, seed: int = 0) -> nn.Module:
        """The model, initialised from ``seed`` so every mode starts from the same weights."""
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            model = self.model_fn()
        finally:
            torch.random.set_rng_state(state)
        if not isinstance(model, nn.Module):
            raise TaskError(f"task {self.name}: model_fn returned {type(model).__name__}, "
                            "not a torch.nn.Module")
        return model

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: Optional[Split] = None,
                 batch_size: int = 2048) -> dict:
        """Mean loss and accuracy of ``model`` on ``split`` (the test set by default)."""
        split = split or self.test
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        total_loss, correct = 0.0, 0
        for start in range(0, len(split), batch_size):
            index = torch.arange(start, min(start + batch_size, len(split)))
            inputs, targets = split.rows(index)
            inputs = tuple(t.to(device) for t in inputs)
            targets = targets.to(device)
            out = model(*inputs)
            total_loss += float(self.loss_fn(out, targets, reduction="sum"))
            correct += int((out.argmax(1) == targets).sum())
        model.train(was_training)
        n = max(1, len(split))
        return {"loss": total_loss / n, "accuracy": correct / n}

    def share_memory_(self) -> "Task":
        self.train.share_memory_()
        self.test.share_memory_()
        return self


def _mnist1d_task(name: str, model_fn, samples: Optional[int], cache_dir: Optional[str],
                  description: str, lr: float) -> Task:
    arrays = data.mnist1d(samples or 5000, cache_dir)
    return Task(
        name=name, model_fn=model_fn,
        train=Split((torch.from_numpy(arrays["x"]),), torch.from_numpy(arrays["y"])),
        test=Split((torch.from_numpy(arrays["x_test"]),), torch.from_numpy(arrays["y_test"])),
        lr=lr, batch_size=32, description=description,
        info={"samples": samples or 5000, "classes": 10, "input": "40 floats"})


def mnist1d_mlp(samples: Optional[int] = None, cache_dir: Optional[str] = None) -> Task:
    """MNIST-1D (generated offline), MLP 40-256-256-10; lr 0.1, batch 32; best ~69%."""
    return _mnist1d_task("mnist1d-mlp", functools.partial(models.MLP, (40, 256, 256, 10)),
                         samples, cache_dir, "MNIST-1D, MLP 40-256-256-10 (best ~69%)", 0.1)


def mnist1d_cnn(samples: Optional[int] = None, cache_dir: Optional[str] = None) -> Task:
    """MNIST-1D (generated offline), the paper's CNN (5,210 params); lr 0.1, batch 32; ~93%."""
    return _mnist1d_task("mnist1d-cnn", models.Conv1DNet, samples, cache_dir,
                         "MNIST-1D, the paper's 3-layer CNN, 5,210 parameters (best ~94%)", 0.1)


def sparse_logreg(samples: Optional[int] = None) -> Task:
    """Synthetic RCV1-like sparse data, 50k features, sparse gradients; lr 1.0, batch 32."""
    n = samples or 60_000
    features = 50_000
    arrays = data.sparse_classification(n, features=features, seed=1234)
    split = int(0.8 * n)
    idx = torch.from_numpy(arrays["indices"])
    val = torch.from_numpy(arrays["values"])
    lab = torch.from_numpy(arrays["labels"])
    return Task(
        name="sparse-logreg", model_fn=functools.partial(models.SparseLinear, features, 2),
        train=Split((idx[:split], val[:split]), lab[:split]),
        test=Split((idx[split:], val[split:]), lab[split:]),
        lr=1.0, batch_size=32,
        description="synthetic RCV1-like sparse binary classification, 50,000 features, "
                    "20-60 non-zeros per row, sparse gradients (Hogwild's home turf)",
        info={"samples": n, "features": features, "classes": 2})


def _idx_task(name: str, model_fn, data_dir: Optional[str], description: str) -> Task:
    arrays = data.mnist_idx(data_dir)

    def images(x):
        return torch.from_numpy((x.astype(np.float32) / 255.0 - 0.1307) / 0.3081)

    return Task(
        name=name, model_fn=model_fn,
        train=Split((images(arrays["x"]),), torch.from_numpy(arrays["y"].astype(np.int64))),
        test=Split((images(arrays["x_test"]),),
                   torch.from_numpy(arrays["y_test"].astype(np.int64))),
        lr=0.05, batch_size=64, description=description,
        info={"data_dir": str(data_dir), "classes": 10, "input": "28x28 images"})


def mnist_mlp(data_dir: Optional[str] = None) -> Task:
    """MNIST / Fashion-MNIST IDX files from --data-dir, MLP 784-256-10; lr 0.05, batch 64."""
    return _idx_task("mnist-mlp", functools.partial(models.MLP, (784, 256, 10)), data_dir,
                     "MNIST / Fashion-MNIST IDX files from --data-dir, MLP 784-256-10")


def mnist_cnn(data_dir: Optional[str] = None) -> Task:
    """MNIST / Fashion-MNIST IDX files from --data-dir, 2-layer CNN; lr 0.05, batch 64."""
    return _idx_task("mnist-cnn", models.Conv2DNet, data_dir,
                     "MNIST / Fashion-MNIST IDX files from --data-dir, 2-layer CNN")


BUILTIN_TASKS: dict = {
    "mnist1d-cnn": mnist1d_cnn,
    "mnist1d-mlp": mnist1d_mlp,
    "sparse-logreg": sparse_logreg,
    "mnist-cnn": mnist_cnn,
    "mnist-mlp": mnist_mlp,
}
_FILE_TASKS = {"mnist-cnn", "mnist-mlp"}


def _resolve_factory(name: str) -> Callable:
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]
    if ":" not in name:
        raise TaskError(f"unknown task {name!r}; built-in tasks: {', '.join(BUILTIN_TASKS)}, "
                        "or give your own as 'package.module:function'")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise TaskError(f"cannot import module {module_name!r} for task {name!r}: "
                        f"{type(exc).__name__}: {exc}; check the module is on PYTHONPATH") from exc
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise TaskError(f"module {module_name!r} has no function {attr!r} for task {name!r}")
    return factory


def load_task(name: str, *, samples: Optional[int] = None, data_dir: Optional[str] = None,
              cache_dir: Optional[str] = None, seed: int = 0) -> Task:
    """Resolve ``name`` (built-in or ``module:function``) and build the task."""
    factory = _resolve_factory(name)
    if data_dir is not None and name in BUILTIN_TASKS and name not in _FILE_TASKS:
        raise TaskError(f"--data-dir is only read by the tasks {', '.join(sorted(_FILE_TASKS))}; "
                        f"task {name} generates its data (drop --data-dir)")
    offered = {"samples": samples, "data_dir": data_dir, "cache_dir": cache_dir, "seed": seed}
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_all or k in params}
    if data_dir is not None and "data_dir" not in kwargs:
        raise TaskError(f"task {name} does not read --data-dir (drop it)")
    try:
        task = factory(**kwargs)
    except (TaskError, DataError):
        raise
    except Exception as exc:
        raise TaskError(f"task {name!r} failed to build: {type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskError(f"{name!r} returned {type(task).__name__}; a task function must "
                        "return an asyncsgd.Task")
    return task


def task_of(settings) -> Task:
    """The task a run's settings name: their ``task``, ``samples``, ``data_dir``,
    ``cache_dir`` and ``seed``."""
    return load_task(settings.task, samples=settings.samples, data_dir=settings.data_dir,
                     cache_dir=settings.cache_dir, seed=settings.seed)


def partition_indices(n: int, parts: int, index: int, seed: int = 0) -> torch.Tensor:
    """Rows of worker ``index`` out of ``parts``: disjoint, together covering ``range(n)``.

    A seeded permutation is cut into ``parts`` nearly equal slices, so every
    mode (Hogwild, parameter-server workers, DDP) splits data the same way.
    """
    if not 0 <= index < parts:
        raise ValueError(f"partition index {index} outside 0..{parts - 1}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return torch.tensor_split(perm, parts)[index].clone()


def epoch_order(part: torch.Tensor, seed: int, rank: int, epoch: int) -> torch.Tensor:
    """Process ``rank``'s shuffle of its rows ``part`` in ``epoch``: a function of
    (seed, rank, epoch) alone, so every mode draws the same order and a resumed run
    continues it."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + epoch)
    return part[torch.randperm(len(part), generator=gen)]
