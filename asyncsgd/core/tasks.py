"""The task abstraction every training mode uses, and the built-in tasks.

A task is a model factory, train and test data (tensors in a ``Split``, or a map-style
Dataset), a loss and a metric; one object so every mode and process trains the same thing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import DataError, TaskError
from . import ctr_data, data, models, text
from .datasets import DatasetSplit, dataset_split
from .meta import OnMeta
from .scoring import ACCURACY, AUC, PERPLEXITY, Metric


@dataclass
class Split:
    """One split of a data set: input tensors and target tensor, row-aligned.

    ``inputs`` is a tuple of tensors whose first dimension indexes samples (the model is
    called as ``model(*inputs)``); modes index rows, so any data that fits in memory
    works, dense or sparse."""

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

    def fingerprint(self) -> str:
        """What the handshake compares of this split beyond its length: each tensor's
        per-sample shape and dtype, and the bytes of integer targets (labels). Labels are
        exact on every host; generated float data may differ in their last bit from host
        to host, and hashing every input would cost seconds for large data."""
        shapes = [[list(t.shape[1:]), str(t.dtype)] for t in (*self.inputs, self.targets)]
        digest = hashlib.sha256(json.dumps(shapes).encode())
        targets = self.targets
        if not targets.is_sparse and not targets.is_floating_point() \
                and not targets.is_complex():
            digest.update(targets.detach().cpu().contiguous().view(-1).numpy().tobytes())
        return digest.hexdigest()


@dataclass
class Task:
    """A model factory, data, a loss and a metric, plus sensible defaults."""

    name: str
    model_fn: Callable[[], nn.Module]
    train: Split  # or a map-style torch.utils.data.Dataset, wrapped in a DatasetSplit
    test: Split
    loss_fn: Callable = F.cross_entropy
    lr: float = 0.1
    batch_size: int = 32
    description: str = ""
    info: dict = field(default_factory=dict)
    metric: Metric = ACCURACY
    default_target: Optional[float] = None  # what compare times when given no --target
    # Embedding tables a parameter server serves row by row (a pull fetches the rows a
    # batch touches, a push sends row-sparse gradients): None, every parameter in the dense
    # slice; "auto", the model's nn.Embedding / nn.EmbeddingBag weights; or their names.
    tables: Union[None, str, tuple] = None

    def __post_init__(self):
        if not isinstance(self.train, (Split, DatasetSplit)):
            self.train = dataset_split(self.train, "train")
        if not isinstance(self.test, (Split, DatasetSplit)):
            self.test = dataset_split(self.test, "test")

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
        """``{"loss": mean loss, <metric name>: score}`` of ``model`` on ``split`` (the test
        set by default)."""
        split = split or self.test
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        total_loss, total_score = 0.0, 0.0
        per_batch, whole = self.metric.per_batch, self.metric.whole
        outputs, labels = [], []
        for start in range(0, len(split), batch_size):
            index = torch.arange(start, min(start + batch_size, len(split)))
            inputs, targets = split.rows(index)
            inputs = tuple(t.to(device) for t in inputs)
            targets = targets.to(device)
            out = model(*inputs)
            total_loss += float(self.loss_fn(out, targets, reduction="sum"))
            if per_batch is not None:
                total_score += per_batch(out, targets)
            if whole is not None:
                outputs.append(out.cpu())
                labels.append(targets.cpu())
        model.train(was_training)
        n = max(1, len(split))
        loss = total_loss / n
        if whole is not None:
            score = whole(torch.cat(outputs), torch.cat(labels)) if outputs else math.nan
        else:
            score = total_score / n if per_batch is not None else self.metric.from_loss(loss)
        return {"loss": loss, self.metric.name: score}

    def served_tables(self, model: nn.Module, embeddings: str = "sparse") -> list:
        """The parameter names of ``model`` served row by row (``tables``); none under
        ``--embeddings dense``, which pushes and pulls every table whole."""
        if embeddings == "dense" or self.tables is None:
            return []
        if self.tables == "auto":
            return models.embedding_tables(model)
        if isinstance(self.tables, str) or not all(isinstance(t, str) for t in self.tables):
            raise TaskError(f"task {self.name}: tables={self.tables!r}: give None, 'auto' or "
                            "a tuple of parameter names")
        return list(self.tables)

    def share_memory_(self) -> "Task":
        self.train.share_memory_()
        self.test.share_memory_()
        return self

    @classmethod
    def from_model(cls, model_fn: Callable[[], nn.Module], train_dataset, test_dataset, *,
                   loss: Callable = F.cross_entropy, metric: Metric = ACCURACY,
                   name: Optional[str] = None, lr: float = 0.1, batch_size: int = 32,
                   **fields) -> "Task":
        """A task from a model factory and two map-style torch Datasets (or ``Split``s)
        whose items are ``(input, ..., target)``; ``loss(outputs, targets, reduction=...)``
        as ``F.cross_entropy`` takes it, ``metric`` an ``asyncsgd.Metric``. ``name``
        defaults to the factory's name; ``fields``: the Task's other fields."""
        return cls(name=name or getattr(model_fn, "__name__", type(model_fn).__name__),
                   model_fn=model_fn, train=train_dataset, test=test_dataset, loss_fn=loss,
                   metric=metric, lr=lr, batch_size=batch_size, **fields)


def _mnist1d_task(name: str, model_fn, samples: Optional[int], cache_dir: Optional[str],
                  description: str, lr: float) -> Task:
    arrays = data.mnist1d(samples or 5000, cache_dir)
    return Task(
        name=name, model_fn=model_fn,
        train=Split((torch.from_numpy(arrays["x"]),), torch.from_numpy(arrays["y"])),
        test=Split((torch.from_numpy(arrays["x_test"]),), torch.from_numpy(arrays["y_test"])),
        lr=lr, batch_size=32, description=description,
        info={"samples": samples or 5000, "classes": 10, "input": "40 floats"})


def mnist1d_mlp(samples: Optional[int] = None, cache_dir: Optional[str] = None,
                width: int = 256, depth: int = 2) -> Task:
    """MNIST-1D (generated offline), MLP 40-W-W-10; lr 0.1, batch 32; best ~69%.

    ``width`` (default 256): width=2048 has 4.3 M parameters, a communication-bound model.
    ``depth``: hidden layers (default 2), for shallow-versus-deep comparisons."""
    for name, value in (("width", width), ("depth", depth)):
        if value < 1:
            raise TaskError(f"mnist1d-mlp:{name}={value}: must be at least 1")
    sizes = (40, *[width] * depth, 10)
    params = sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))
    shape = "-".join(map(str, sizes))
    task = _mnist1d_task("mnist1d-mlp", functools.partial(models.MLP, sizes), samples, cache_dir,
                         f"MNIST-1D, MLP {shape}, {params:,} parameters (best ~69%)", 0.1)
    task.info["parameters"] = params
    return task


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


def lm(samples: Optional[int] = None, layers: int = 4, width: int = 128,
       context: int = 32) -> Task:
    """Byte-level transformer LM on a generated corpus; metric: perplexity (lower is better).

    Defaults: 4 layers of width 128 (0.86 M parameters), context 32 bytes, batch 16
    sequences, lr 0.3 for the modes' plain SGD (0.25 and 0.5 both reached perplexity 2 in
    ~14,000 sequences; 1.0 diverged). The corpus is ``core.text``'s (nothing downloaded),
    with a known floor on the perplexity (1.23); compare times perplexity 2.0 when given
    no --target."""
    for name, value, least in (("layers", layers, 1), ("width", width, 8),
                               ("context", context, 8)):
        if value < least:
            raise TaskError(f"lm:{name}={value}: must be at least {least}")
    if width % models.TinyLM.HEAD_WIDTH:
        raise TaskError(f"lm:width={width}: must be a multiple of {models.TinyLM.HEAD_WIDTH} "
                        "(the width of one attention head)")
    n = samples or 20_000   # 18,000 training sequences: past 14,000 without repeating
    corpus = text.Corpus(seed=1234)   # the data do not change with --seed, as for mnist1d
    train_x, train_y = corpus.sequences(int(0.9 * n), context, stream=0)
    test_x, test_y = corpus.sequences(n - int(0.9 * n), context, stream=1)
    model_fn = functools.partial(models.TinyLM, text.VOCAB, width, layers, context)
    params = sum(p.numel() for p in model_fn().parameters())
    return Task(
        name="lm", model_fn=model_fn,
        train=Split((train_x,), train_y), test=Split((test_x,), test_y),
        loss_fn=models.sequence_cross_entropy, lr=0.3, batch_size=16, metric=PERPLEXITY,
        default_target=corpus.target_perplexity,
        description=f"byte-level transformer LM, {layers} layers x width {width}, "
                    f"{params:,} parameters, on a generated corpus ({corpus.description})",
        info={"samples": n, "context": context, "parameters": params,
              "entropy_floor_perplexity": round(corpus.floor_perplexity, 3)})


def ctr(samples: Optional[int] = None, rows: int = 10_000, tables: int = 26) -> Task:
    """Synthetic Criteo-like clicks, DLRM-like model, metric AUC; lr 0.5, batch 32.

    ``rows``: raw ids per categorical feature, the size of each of the 26 tables of 16
    floats (default 10,000: 4.2 M parameters, trained in seconds; Criteo-sized 10^7 rows
    are 16 GB of tables, the size only a sparse parameter server holds). Labels come from a
    fixed random teacher whose own test AUC (``info["auc_ceiling"]``) no model passes; the
    data do not change with --seed, as for mnist1d. Every eval's loss is the log loss.

    ``tables``: how many tables the 26 features share (feature ``f`` looks up table
    ``f % tables`` in its own block of ``rows`` rows, ``models.DLRM``); ``tables=1`` is one
    table of ``26 * rows`` rows, e.g. ``ctr:rows=384616,tables=1``: 10^7 rows x 16, 640 MB."""
    if not isinstance(rows, int) or not 1 <= rows <= ctr_data.MAX_ROWS:
        raise TaskError(f"ctr:rows={rows}: give a whole number of ids per feature between 1 "
                        f"and {ctr_data.MAX_ROWS}, e.g. ctr:rows=100000")
    if not isinstance(tables, int) or not 1 <= tables <= ctr_data.CATEGORICAL:
        raise TaskError(f"ctr:tables={tables}: give a whole number of embedding tables between "
                        f"1 (one table for every feature) and {ctr_data.CATEGORICAL} (one per "
                        "feature), e.g. ctr:tables=1")
    n = samples or 30_000
    teacher = ctr_data.Teacher(rows, CTR_DATA_SEED)
    split = int(0.9 * n)
    train = ctr_data.generate(split, rows, CTR_DATA_SEED, teacher, stream=0)
    test = ctr_data.generate(n - split, rows, CTR_DATA_SEED, teacher, stream=1)
    ceiling = ctr_data.auc_ceiling(test)

    def as_split(part):
        return Split((torch.from_numpy(part.dense), torch.from_numpy(part.categorical)),
                     torch.from_numpy(part.labels))

    model_fn = functools.partial(models.DLRM, rows, ctr_data.CATEGORICAL, ctr_data.DENSE,
                                 tables=tables)
    with OnMeta():   # counted without their memory: 10^7-row tables are GBs
        params = sum(p.numel() for p in model_fn().parameters())
    return Task(
        name="ctr", model_fn=model_fn, train=as_split(train), test=as_split(test),
        loss_fn=models.binary_logloss, lr=CTR_LR, batch_size=32, metric=AUC, tables="auto",
        default_target=round(0.85 * ceiling, 2),   # reached within one epoch of the default
        description=f"synthetic Criteo-like clicks, 13 dense and 26 categorical features of "
                    f"{rows:,} Zipf(1.1) ids; DLRM-like model, {tables} embedding "
                    f"table{'s' * (tables > 1)}, {params:,} parameters "
                    f"(teacher's AUC {ceiling:.3f})",
        info={"samples": n, "rows": rows, "tables": tables, "parameters": params,
              "auc_ceiling": round(ceiling, 4)})


CTR_DATA_SEED = 1234
CTR_LR = 0.5


BUILTIN_TASKS: dict = {
    "mnist1d-cnn": mnist1d_cnn,
    "mnist1d-mlp": mnist1d_mlp,
    "lm": lm,
    "sparse-logreg": sparse_logreg,
    "ctr": ctr,
    "mnist-cnn": mnist_cnn,
    "mnist-mlp": mnist_mlp,
}
_FILE_TASKS = {"mnist-cnn", "mnist-mlp"}


def split_options(name: str) -> tuple:
    """``'mnist1d-mlp:width=2048'`` -> ``('mnist1d-mlp', {'width': 2048})``: a task's name
    and its options (ints, floats or text), given as ``NAME:KEY=VALUE[,KEY=VALUE...]``."""
    base, sep, tail = name.rpartition(":")
    if not sep or "=" not in tail:
        return name, {}
    options: dict = {}
    for item in tail.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise TaskError(f"task option {item!r} in {name!r}: write options as "
                            "NAME:KEY=VALUE[,KEY=VALUE], e.g. mnist1d-mlp:width=2048")
        for kind in (int, float):
            try:
                options[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            options[key] = value.strip()
    return base, options


def task_options(factory: Callable) -> dict:
    """The options a task function takes beyond the ones every task is offered, with
    their defaults (what ``asyncsgd tasks`` lists)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    return {k: p.default for k, p in params.items() if k not in _OFFERED
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


_OFFERED = ("samples", "data_dir", "cache_dir", "seed")


# What a run records as its task when given a Task object: nothing can import it again
OBJECT_PREFIX = "object:"


def task_reference(fn: Callable) -> str:
    """``'module:qualname'``, the name a run records for the task function ``fn`` and
    by which spawned processes import it; TaskError in one line for a function that
    cannot be found by its name (a lambda, a closure, a callable object)."""
    qualname = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    if not (qualname and module) or isinstance(fn, type):
        why = f"a {type(fn).__name__} has no importable name"
    elif "<lambda>" in qualname:
        why = "a lambda has no importable name"
    elif "<locals>" in qualname:
        why = f"{qualname} is defined inside a function (a closure)"
    else:
        found = sys.modules.get(module)
        for part in qualname.split("."):
            found = getattr(found, part, None)
        why = None if found is fn else f"{module}.{qualname} is not that function"
    if why:
        raise TaskError(f"task={fn!r}: {why}; define the task function with def at the top "
                        "level of a module (then task=make_task, or 'module:make_task')")
    return f"{module}:{qualname}"


def _resolve_factory(name: str) -> Callable:
    if name.startswith(OBJECT_PREFIX):
        raise TaskError(f"task {name!r} was a Task object given as task= in Python: pass the "
                        "same task= again (to resume the run, or to Run.model(task=...))")
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
    if factory is None and module_name == "__main__":
        raise TaskError(f"task {name!r} is a function of the script that started the run: "
                        "run that script again with task= (or move the function into a module)")
    if factory is None or not callable(factory):
        raise TaskError(f"module {module_name!r} has no function {attr!r} for task {name!r}")
    return factory


def load_task(name: Union[str, Callable], *, samples: Optional[int] = None,
              data_dir: Optional[str] = None, cache_dir: Optional[str] = None,
              seed: int = 0) -> Task:
    """Resolve ``name`` (built-in or ``module:function``) and build the task.

    Your own task: a module-level function returning a ``Task``, passed as ``--task
    package.module:function``; it may take any of ``samples``, ``data_dir``,
    ``cache_dir``, ``seed``. Keep its model factory and loss module-level (or
    ``functools.partial`` of such) so the task can be sent to spawned processes. Options
    follow the name (``mnist1d-mlp:width=2048``) and are part of it, so every process of
    a run builds the same task. ``name`` may be the function itself (recorded as its
    ``module:function``)."""
    if callable(name):
        factory, base, options = name, task_reference(name), {}
    else:
        base, options = split_options(name)
        factory = _resolve_factory(base)
    if options:
        known = task_options(factory)
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TaskError(f"task {base} has no option {', '.join(unknown)}; its options: "
                            f"{', '.join(f'{k}={v}' for k, v in known.items()) or 'none'}")
    name = base
    if data_dir is not None and name in BUILTIN_TASKS and name not in _FILE_TASKS:
        raise TaskError(f"--data-dir is only read by the tasks {', '.join(sorted(_FILE_TASKS))}; "
                        f"task {name} generates its data (drop --data-dir)")
    offered = {"samples": samples, "data_dir": data_dir, "cache_dir": cache_dir, "seed": seed}
    received = _received(factory)
    kwargs = {k: v for k, v in offered.items() if k in received}
    if data_dir is not None and "data_dir" not in kwargs:
        raise TaskError(f"task {name} does not read --data-dir (drop it)")
    try:
        task = factory(**kwargs, **options)
    except (TaskError, DataError):
        raise
    except Exception as exc:
        raise TaskError(f"task {name!r} failed to build: {type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskError(f"{name!r} returned {type(task).__name__}; a task function must "
                        "return an asyncsgd.Task")
    return task


def _received(factory: Callable) -> set:
    """The arguments offered to every task (``_OFFERED``) that ``factory`` takes."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return set()
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return {k for k in _OFFERED if takes_all or k in params}


def task_identity(name: str, seed: int) -> tuple:
    """``(canonical name, data seed)`` of the task ``name`` built with ``seed``.

    The canonical name spells out every option of the task's function at its value, so
    ``lm`` and ``lm:layers=4`` name the same task; the data seed is ``seed`` when the
    function takes one (its data may depend on it) and None when it does not (then
    every seed builds the same data). What two processes compare to know they build
    the same data (``core.signature``)."""
    base, options = split_options(name)
    factory = _resolve_factory(base)
    values = {**task_options(factory), **options}
    canonical = base + (":" + ",".join(f"{k}={v}" for k, v in sorted(values.items()))
                        if values else "")
    return canonical, seed if "seed" in _received(factory) else None


def task_of(settings) -> Task:
    """The task a run's settings name: their ``task``, ``samples``, ``data_dir``,
    ``cache_dir`` and ``seed``."""
    return load_task(settings.task, samples=settings.samples, data_dir=settings.data_dir,
                     cache_dir=settings.cache_dir, seed=settings.seed)


# The name of the partitioning below, in the handshake's data signature: change it with
# partition_indices, so that processes partitioning differently refuse to train together.
PARTITION_SCHEME = "seeded-permutation-split/1"


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
