"""A PS worker's model built with its served tables on the meta device (workers/meta_tables.py):
plain objects, and one fresh interpreter (what a start imports).

Oracle: ``task.build_model(0)``, the whole model as the server builds it: the same parameter
names and shapes, hence the same layout signature the handshake compares, and every
parameter but the served tables real.
"""

import json
import math
import subprocess
import sys
import textwrap

import pytest
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


@pytest.mark.processes
def test_the_ctr_model_on_meta_imports_no_dynamo_and_has_the_shapes_of_torchs_meta_device():
    """core/meta.py skips nn.init's draws on meta tensors: on torch's own meta device they
    import torch._dynamo (0.8 s). A fresh interpreter, as a worker's start is one."""
    code = textwrap.dedent("""
        import json, sys
        import torch
        from asyncsgd.core.tasks import load_task
        from asyncsgd.workers.meta_tables import build_without_tables
        task = load_task("ctr:rows=1000,tables=2", samples=200)
        built = build_without_tables(task, "sparse")
        shapes = [[n, list(p.shape), p.is_meta] for n, p in built.named_parameters()]
        dynamo = "torch._dynamo" in sys.modules
        with torch.device("meta"):
            reference = [[n, list(p.shape)] for n, p in task.build_model(0).named_parameters()]
        print(json.dumps([dynamo, task.info["parameters"], shapes, reference]))
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    dynamo, parameters, shapes, reference = json.loads(out.stdout.splitlines()[-1])
    assert dynamo is False
    assert [s[:2] for s in shapes] == reference
    assert parameters == sum(math.prod(shape) for _, shape in reference)
    assert {n for n, _, meta in shapes if meta} == {"tables.0.weight", "tables.1.weight"}
