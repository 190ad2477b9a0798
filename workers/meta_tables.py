"""A PS worker's model with its tables served by row never allocated: built on the meta device.

A worker gives its served tables up (``BatchTables`` puts an empty weight in their place) and
pulls every parameter it computes with from the server before its first step, so the values
the task's model function draws for those tables are never used: for a 10^7 x 16 table that
was 640 MB allocated and filled at every worker's start (experiments/README.md, "A worker's
start-up with a large table"). The model is built once on the meta device, for the served
tables' shapes alone; then for real, with each tensor of such a shape made on the meta device.
The model's names and shapes, all the handshake's layout check reads, are the same.

Drawing no values for the tables leaves the random state where it was, so the dense
parameters a worker builds after them differ from the server's: the first pull replaces them.
"""

from __future__ import annotations

import logging

import torch.nn as nn

from asyncsgd.core.meta import OnMeta

log = logging.getLogger(__name__)


def build_without_tables(task, embeddings: str) -> nn.Module:
    """``task``'s model as ``task.build_model(0)`` builds it, except that the tables it
    serves by row under ``embeddings`` are on the meta device. A model that cannot be built
    on the meta device, or one whose other parameters share a table's shape, is built whole."""
    if embeddings == "dense" or task.tables is None:  # no table served by row (served_tables)
        return task.build_model(0)
    try:
        with OnMeta():
            probe = task.build_model(0)
    except Exception as exc:  # a model function that reads values while it builds
        log.debug("the model cannot be built on the meta device (%s): built whole", exc)
        return task.build_model(0)
    served = set(task.served_tables(probe, embeddings))
    shapes = {tuple(p.shape) for name, p in probe.named_parameters() if name in served}
    if not shapes:
        return task.build_model(0)
    with OnMeta(shapes):
        model = task.build_model(0)
    stray = [name for name, p in model.named_parameters() if p.is_meta and name not in served]
    stray += [name for name, b in model.named_buffers() if b.is_meta]
    if stray:
        log.debug("%s share a served table's shape: the model is built whole", stray)
        return task.build_model(0)
    return model
