"""Tasks with exact oracles, used by the tests through ``--task tasks_for_tests:NAME``.

index_counter: row i's input is i; the model is one weight per row, and the
loss is the sum of the weights of the rows in the batch, so each step's
sparse gradient is 1 on exactly the rows trained on. With lr = 1 every row's
weight ends at minus the number of times any worker trained on it: -epochs
everywhere proves the partitions are disjoint and cover the data.

dense_counter: one shared scalar whose gradient is the batch size; with lr = 1
its final value is exactly -(samples processed) unless an update was lost.
dense_pair: two such scalars, one per shard with --shards 2, so each shard's
lost updates show in its own value.
"""

import functools
import os
import signal
import time

import torch
import torch.nn as nn

from asyncsgd.core.tasks import Split, Task
from asyncsgd.wire.protocol import FRAME_BYTES


def total(out, targets, reduction="sum"):
    return out.sum()


def _fail_on(index, row: int, hang: bool = False) -> None:
    """Raise (or hang for an hour first) when the batch holds ``row``; -1: never."""
    if row >= 0 and bool((index == row).any()):
        if hang:
            time.sleep(3600)
        raise ValueError(f"boom at row {row}")


class RowWeights(nn.Module):
    def __init__(self, rows: int, fail_row: int = -1):
        super().__init__()
        self.weight = nn.EmbeddingBag(rows, 1, mode="sum", sparse=True)
        nn.init.zeros_(self.weight.weight)
        self.fail_row = fail_row

    def forward(self, index):
        _fail_on(index, self.fail_row)
        return self.weight(index.view(-1, 1))


class Scalars(nn.Module):
    """``width`` shared weights; the output is their sum, so each one's gradient is the
    batch size."""

    def __init__(self, width: int = 1):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return self.w.sum().expand(len(x), 1)


def _rows_task(name, model_fn, samples):
    n = samples or 1000
    rows = torch.arange(n).view(-1, 1)
    return Task(name=name, model_fn=model_fn,
                train=Split((rows,), torch.zeros(n, dtype=torch.long)),
                test=Split((rows[-10:],), torch.zeros(10, dtype=torch.long)), loss_fn=total,
                lr=1.0, batch_size=8)


def index_counter(samples=None):
    n = samples or 1000
    return _rows_task("index-counter", functools.partial(RowWeights, n), n)


def failing(samples=None):
    n = samples or 1000
    return _rows_task("failing", functools.partial(RowWeights, n, 7), n)


class KilledAtRow(RowWeights):
    """RowWeights whose process is SIGKILLed as its batch holding ``fail_row`` computes."""

    def forward(self, index):
        if self.fail_row >= 0 and bool((index == self.fail_row).any()):
            os.kill(os.getpid(), signal.SIGKILL)
        return self.weight(index.view(-1, 1))


def killed_at_row7(samples=None):
    """index_counter whose worker dies mid-batch at row 7 while ``ASYNCSGD_TEST_KILL_ROW7``
    is set where the task is built; a run resumed without it trains on."""
    n = samples or 1000
    row = 7 if os.environ.get("ASYNCSGD_TEST_KILL_ROW7") else -1
    return _rows_task("killed-at-row7", functools.partial(KilledAtRow, n, row), n)


class TableCounter(RowWeights):
    """RowWeights served by row (its EmbeddingBag a table), plus ``width`` dense scalars
    added to every output: a model that is mostly table, whose few dense values leave
    shards with an empty dense slice under --shards > width."""

    def __init__(self, rows: int, width: int = 1):
        super().__init__(rows)
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, index):
        return super().forward(index) + self.bias.sum()


def table_counter(samples=None):
    """index_counter's rows as a table and one dense scalar: with lr 1 row i ends at minus
    the times it was trained on, the scalar at minus the samples."""
    n = samples or 1000
    task = _rows_task("table-counter", functools.partial(TableCounter, n), n)
    task.tables = "auto"
    return task


RAW_BASE, RAW_STEP = 10 ** 12, 7919


def raw_table_counter(samples=None):
    """table_counter fed raw int64 ids (10^12 + 7919 x row, beyond the table's rows), as
    in a hashed id space (``--id-space hashed``): the worker and the server's evaluator
    remap them; row ``i``'s raw id ends at minus the times it was trained on."""
    n = samples or 1000
    task = table_counter(n)
    task.name = "raw-table-counter"
    raw = RAW_BASE + RAW_STEP * torch.arange(n).view(-1, 1)
    task.train, task.test = Split((raw,), task.train.targets), Split((raw[-10:],),
                                                                       task.test.targets)
    return task


def dense_counter(samples=None):
    return _rows_task("dense-counter", Scalars, samples or 2000)


def wide_counter(samples=None, width=1 << 22):
    """dense_counter with ``width`` weights (16 MiB): each update is a long read-modify-write
    sweep, so unlocked Hogwild processes preempted mid-sweep lose updates measurably."""
    return _rows_task("wide-counter", functools.partial(Scalars, width), samples or 2000)


def mib_counter(samples=None):
    """wide_counter of 1 MiB: one frame a message, a round trip well within a busy-poll
    budget of 10 ms."""
    return wide_counter(samples, width=1 << 18)


def two_part_counter(samples=None):
    """wide_counter one weight wider than a frame: a float32 push of it travels over TCP
    in two parts (PROTOCOL.md, "Parts")."""
    return wide_counter(samples, width=FRAME_BYTES // 4 + 1)


def dense_pair(samples=None):
    return _rows_task("dense-pair", functools.partial(Scalars, 2), samples or 2000)


def not_a_task():
    return 42


class DenseRows(nn.Module):
    """One weight per row, dense gradients (what DDP all-reduces); raises on ``fail_row``."""

    def __init__(self, rows: int, fail_row: int = -1, hang: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows))
        self.fail_row, self.hang = fail_row, hang

    def forward(self, index):
        _fail_on(index, self.fail_row, self.hang)
        return self.weight[index.view(-1)].view(-1, 1)


def dense_rows(samples=None):
    """index_counter with a dense gradient: with lr 1 and DDP averaging over N ranks, a row
    trained on k times ends at exactly -k/N (-k in one process)."""
    n = samples or 1000
    return _rows_task("dense-rows", functools.partial(DenseRows, n), n)


def failing_dense(samples=None):
    n = samples or 1000
    return _rows_task("failing-dense", functools.partial(DenseRows, n, 7), n)


def hanging_dense(samples=None):
    """Hangs for an hour in the forward of the batch holding row 7."""
    n = samples or 1000
    return _rows_task("hanging-dense", functools.partial(DenseRows, n, 7, True), n)


class AutocastProbe(nn.Module):
    """A linear classifier that raises, while training, unless it runs under bf16 CPU autocast
    (evaluation runs in float32)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        if not self.training:
            return self.linear(x)
        if not torch.is_autocast_enabled("cpu") or \
                torch.get_autocast_dtype("cpu") != torch.bfloat16:
            raise RuntimeError("not running under bf16 autocast")
        out = self.linear(x)
        if out.dtype != torch.bfloat16:
            raise RuntimeError(f"linear ran in {out.dtype}, not bfloat16")
        return out


def autocast_probe(samples=None):
    n = samples or 256
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return Task(name="autocast-probe", model_fn=AutocastProbe,
                train=Split((x,), y), test=Split((x[:64],), y[:64]), lr=0.1, batch_size=16)


class ThreadsProbe(Scalars):
    """dense_counter's scalar; its forward raises unless torch runs the number of threads
    in $ASYNCSGD_TEST_THREADS in this process."""

    def forward(self, x):
        wanted = int(os.environ["ASYNCSGD_TEST_THREADS"])
        if torch.get_num_threads() != wanted:
            raise RuntimeError(f"{torch.get_num_threads()} torch threads, not {wanted}")
        return super().forward(x)


def threads_probe(samples=None):
    return _rows_task("threads-probe", ThreadsProbe, samples or 400)


def _note(line: str) -> None:
    """Append ``line`` to this process's file in $ASYNCSGD_TEST_PROBE_DIR."""
    path = os.path.join(os.environ["ASYNCSGD_TEST_PROBE_DIR"], str(os.getpid()))
    with open(path, "a") as fh:
        fh.write(line + "\n")


class ComputeProbe(Scalars):
    """dense_counter's scalar behind a forward that computes for a few milliseconds; each
    training forward appends its (start, end) on the machine's monotonic clock to a file
    of its process in $ASYNCSGD_TEST_PROBE_DIR."""

    def forward(self, x):
        if not torch.is_grad_enabled():  # the parent's evaluation: not a training step
            return super().forward(x)
        start = time.monotonic()
        a = torch.ones(128, 128)
        with torch.no_grad():
            for _ in range(40):
                a = torch.mm(a, a).clamp_(max=1.0)
        _note(f"{start} {time.monotonic()}")
        return super().forward(x)


def compute_probe(samples=None):
    return _rows_task("compute-probe", ComputeProbe, samples or 2000)


class SeedProbe(Scalars):
    """dense_counter's scalar; each training forward appends torch's seed in this process
    (torch.initial_seed()) to a file of its process in $ASYNCSGD_TEST_PROBE_DIR."""

    def forward(self, x):
        if torch.is_grad_enabled():  # not the parent's evaluation
            _note(str(torch.initial_seed()))
        return super().forward(x)


def seed_probe(samples=None):
    return _rows_task("seed-probe", SeedProbe, samples or 160)


class SlowScalars(Scalars):
    """``Scalars`` whose training forward takes $ASYNCSGD_TEST_STEP_SECONDS: a long step
    (a big model, many local steps) without the compute; evaluation is not slowed."""

    def forward(self, x):
        if self.training:
            time.sleep(float(os.environ.get("ASYNCSGD_TEST_STEP_SECONDS", "0")))
        return super().forward(x)


def slow_counter(samples=None):
    """dense_counter whose every step takes $ASYNCSGD_TEST_STEP_SECONDS."""
    return _rows_task("slow-counter", SlowScalars, samples or 2000)


class SlowEvalScalars(Scalars):
    """``Scalars`` whose evaluation forward takes $ASYNCSGD_TEST_EVAL_SECONDS (a big test
    set, as lm's on a busy machine); training is not slowed."""

    def forward(self, x):
        if not torch.is_grad_enabled():
            time.sleep(float(os.environ.get("ASYNCSGD_TEST_EVAL_SECONDS", "0")))
        return super().forward(x)


def slow_eval_counter(samples=None):
    """dense_counter whose every evaluation takes $ASYNCSGD_TEST_EVAL_SECONDS."""
    return _rows_task("slow-eval-counter", SlowEvalScalars, samples or 2000)


class OrderProbe(Scalars):
    """dense_counter's scalar; each training forward appends the rows of its batch to a file
    of its process in $ASYNCSGD_TEST_PROBE_DIR: the data order a mode really trains in."""

    def forward(self, x):
        if torch.is_grad_enabled():  # not an evaluation
            _note(" ".join(str(int(v)) for v in x.view(-1)))
        return super().forward(x)


def order_probe(samples=None):
    return _rows_task("order-probe", OrderProbe, samples or 40)


def _mse(out, targets, reduction="mean"):
    return torch.nn.functional.mse_loss(out, targets, reduction=reduction)


def regression(samples=None):
    """y = x . w_true + noise, a linear model, scored by MSE (lower is better): its loss
    per sample *is* the metric, so the two must agree exactly."""
    from asyncsgd.core.scoring import MSE
    n = samples or 2000
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0).view(8, 1) / 8 + 0.05 * torch.randn(n, 1, generator=g)
    cut = int(0.8 * n)
    return Task(name="regression", model_fn=functools.partial(nn.Linear, 8, 1),
                train=Split((x[:cut],), y[:cut]), test=Split((x[cut:],), y[cut:]),
                loss_fn=_mse, lr=0.05, batch_size=16, metric=MSE)


class Standardize:
    """A Dataset's own transform: a raw float64 row to float32 of zero mean and unit variance
    per feature. Module-level, so the Dataset pickles to spawned processes."""

    def __init__(self, mean, std):
        self.mean, self.std = mean, std

    def __call__(self, row):
        return ((row - self.mean) / self.std).float()


class BlobDataset(torch.utils.data.Dataset):
    """A map-style Dataset of (row, label): raw rows through ``transform``, labels as Python
    ints (default_collate makes them a tensor). With ``probe``, every item it serves appends
    its index to this process's file in $ASYNCSGD_TEST_PROBE_DIR: the rows each process read,
    in the order it read them."""

    def __init__(self, rows, labels, transform, probe=False):
        self.rows, self.labels, self.transform, self.probe = rows, labels, transform, probe

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        if self.probe:
            _note(str(i))
        return self.transform(self.rows[i]), int(self.labels[i])


def _blob_mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def blob_dataset(samples=None, seed=0):
    """Four Gaussian blobs in 8 dimensions, one per class, as torch Datasets (80% train,
    20% test) standardized by their transform; the blobs depend on ``seed``. The training
    Dataset probes the rows it serves when $ASYNCSGD_TEST_PROBE_DIR is set."""
    n = samples or 2000
    g = torch.Generator().manual_seed(1234 + seed)
    labels = torch.randint(0, 4, (n,), generator=g)
    centers = torch.randn(4, 8, generator=g, dtype=torch.float64) * 3
    rows = centers[labels] + torch.randn(n, 8, generator=g, dtype=torch.float64) + 5
    cut = int(0.8 * n)
    transform = Standardize(rows[:cut].mean(0), rows[:cut].std(0))
    probe = bool(os.environ.get("ASYNCSGD_TEST_PROBE_DIR"))
    return Task(name="blob-dataset", model_fn=_blob_mlp,
                train=BlobDataset(rows[:cut], labels[:cut], transform, probe),
                test=BlobDataset(rows[cut:], labels[cut:], transform), lr=0.1, batch_size=32)


class SlowDropoutMLP(nn.Module):
    """A small MLP with dropout (so every step draws from torch's generator) that sleeps
    ``ASYNCSGD_TEST_STEP_SLEEP`` seconds a forward pass in training, so a run can be
    stopped mid-epoch."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))
        self.pause = float(os.environ.get("ASYNCSGD_TEST_STEP_SLEEP", "0"))

    def forward(self, x):
        if self.training and self.pause:
            time.sleep(self.pause)
        return self.net(x)


def dropout_regression(samples=None):
    """``regression``'s data with a dropout MLP: a resumed run matches an uninterrupted one
    only if the data position, the update rule's state and the random generators all
    continue."""
    task = regression(samples)
    return Task(name="dropout-regression", model_fn=SlowDropoutMLP, train=task.train,
                test=task.test, loss_fn=_mse, lr=0.05, batch_size=16, metric=task.metric)
