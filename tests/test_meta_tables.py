"""A PS worker's model built with its served tables on the meta device (workers/meta_tables.py):
plain objects, no processes.

Oracle: ``task.build_model(0)``, the whole model as the server builds it: the same parameter
names and shapes, hence the same layout signature the handshake compares, and every
parameter but the served tables real.
"""

import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from asyncsgd.core.tasks import Task
from asyncsgd.core.models import DLRM
from asyncsgd.wire.layout import Layout
from asyncsgd.workers.meta_tables import build_without_tables
from asyncsgd.workers.tables import BatchTables


def task_of(model_fn, tables="auto") -> Task:
    data = TensorDataset(torch.zeros(4, 1, dtype=torch.int64), torch.zeros(4))
    return Task.from_model(model_fn, data, data, tables=tables)


def dlrm():
    return DLRM(rows=500, tables=2)


class SameShape(nn.Module):
    """A dense parameter of the table's own shape: it must not be left on meta."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50, 4)
        self.twin = nn.Parameter(torch.empty(50, 4).uniform_())


class ReadsValues(nn.Module):
    """A model function that reads a value as it builds: it cannot be built on meta."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(50, 4)
        self.scale = float(self.table.weight.abs().max().item())


def test_the_served_tables_are_on_meta_and_the_layout_is_the_servers():
    task = task_of(dlrm)
    whole, built = task.build_model(0), build_without_tables(task, "sparse")
    served = set(task.served_tables(whole))
    assert served == {"tables.0.weight", "tables.1.weight"}
    assert [(n, p.shape) for n, p in built.named_parameters()] == \
        [(n, p.shape) for n, p in whole.named_parameters()]
    assert {n for n, p in built.named_parameters() if p.is_meta} == served
    assert not any(b.is_meta for b in built.buffers())
    assert Layout.of(built, served).signature() == Layout.of(whole, served).signature()
    # the worker gives the tables up as before: nothing of them is left on meta
    BatchTables(built, Layout.of(built, served))
    assert not any(p.is_meta for p in built.parameters())


def test_dense_embeddings_a_same_shaped_parameter_and_a_model_reading_values_build_whole():
    task = task_of(dlrm)
    assert not any(p.is_meta for p in build_without_tables(task, "dense").parameters())
    for model_fn in (SameShape, ReadsValues):
        whole = task_of(model_fn).build_model(0)
        built = build_without_tables(task_of(model_fn), "sparse")
        assert not any(p.is_meta for p in built.parameters())
        for (name, p), (_, q) in zip(built.named_parameters(), whole.named_parameters()):
            assert torch.equal(p, q), name  # built whole: as the server builds it
