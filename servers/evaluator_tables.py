"""The evaluator's rows of the tables served by row: the ids the test split looks up, asked of
each shard beside its dense slice, and written into the server's model at those ids.

The server's model holds its tables whole (the task builds it so), and only the rows the metric
reads are refreshed at an evaluation: for ctr's sizes (up to 10^6 rows a table) a full-size
table filled at those ids costs less than remapping ids into a table of the touched rows. The
final observation asks every row, so the model the run saves holds the whole trained tables.

In a hashed id space the test split may look up raw ids beyond the model's rows (any int64):
then the rows of those ids are held apart, and during each forward a table module looks up
that local table at the ids' positions (as a worker's step does, workers/tables.py), its own
weight put back after; the model's whole tables stay for the saved model.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from asyncsgd.errors import ConfigError
from asyncsgd.core.models import lookup_ids, with_lookup_ids
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.sparse import MAX_MESSAGE_VALUES, reply_mismatch, split_rows


def table_modules(model: nn.Module, layout: Layout) -> list:
    """The module whose ``weight`` is each of the layout's tables (an nn.Embedding or
    nn.EmbeddingBag: their input is the ids they look up)."""
    modules = {f"{prefix}.weight" if prefix else "weight": module
               for prefix, module in model.named_modules()}
    found = [modules.get(spec.name) for spec in layout.tables]
    for spec, module in zip(layout.tables, found):
        if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            raise ConfigError(f"table {spec.name!r} is not the weight of an nn.Embedding or "
                              "nn.EmbeddingBag: the server's evaluator reads only those by row; "
                              "use --embeddings dense")
    return found


@torch.no_grad()
def touched_ids(model: nn.Module, layout: Layout, split, batch_size: int = 2048) -> list:
    """Per table, the unique ids (int64, sorted) ``model`` looks up on ``split``: its tables'
    inputs, caught by one forward over the split."""
    seen: list = [[] for _ in layout.tables]

    def catch(t: int) -> Callable:
        def hook(module, args, kwargs):
            ids = lookup_ids(args, kwargs)
            seen[t].append(torch.unique(ids.detach().reshape(-1).to("cpu", torch.int64)))
            # row 0 instead: raw ids of a hashed id space may lie beyond the model's rows
            return with_lookup_ids(args, kwargs, torch.zeros_like(ids))
        return hook

    hooks = [m.register_forward_pre_hook(catch(t), with_kwargs=True)
             for t, m in enumerate(table_modules(model, layout))]
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(split), batch_size):
            inputs, _ = split.rows(torch.arange(start, min(start + batch_size, len(split))))
            model(*inputs)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return [torch.unique(torch.cat(parts)) if parts else torch.zeros(0, dtype=torch.int64)
            for parts in seen]


class TableRows:
    """The ids of each table the evaluator asks of each shard, as observer pulls within the
    per-segment and per-message bounds, and the rows that come back written into the
    model's tables; or, when a hashed id space's ``ids`` lie beyond a table's rows, into
    a local table of those ids that the model's forward looks up (``remapped``)."""

    def __init__(self, model: nn.Module, layout: Layout, ids: Sequence, shards: int,
                 hash_ids: Optional[Callable] = None):
        self.layout = layout
        self.modules = table_modules(model, layout)
        self.weights = [m.weight for m in self.modules]
        outside = [t for t, (spec, table_ids) in enumerate(zip(layout.tables, ids))
                   if table_ids.numel() and (int(table_ids.min()) < 0 or
                                             int(table_ids.max()) >= spec.rows)]
        if outside and hash_ids is None:
            spec = layout.tables[outside[0]]
            raise ConfigError(f"table {spec.name!r} is looked up at ids outside its "
                              f"{spec.rows} rows: in a fixed id space the model's rows are the "
                              "ids; use --id-space hashed for raw ids")
        self.remapped = bool(outside)
        self._hooks: list = []
        if self.remapped:
            self.unique = [torch.unique(table_ids) for table_ids in ids]
            self.local = [torch.zeros(len(u), spec.dim)
                          for u, spec in zip(self.unique, layout.tables)]
            for t, module in enumerate(self.modules):
                self._hooks += [module.register_forward_pre_hook(self._look_up(t),
                                                                 with_kwargs=True),
                                module.register_forward_hook(self._put_back(t))]
        self.pulls: list = []  # per shard: the ids segments of each pull
        for shard in range(shards):
            segments = []
            for t, table_ids in enumerate(ids):
                keys = hash_ids(table_ids) if hash_ids is not None else table_ids
                mine = table_ids[torch.remainder(keys, shards) == shard]
                segments += split_rows(t, mine)
            self.pulls.append(self._messages(segments))
        self.count = sum(seg.data.n for pulls in self.pulls for msg in pulls for seg in msg)

    def _messages(self, segments: list) -> list:
        """``segments`` cut into messages of at most MAX_MESSAGE_VALUES rows x dim each."""
        out, current, values = [], [], 0
        for seg in segments:
            size = seg.data.n * self.layout.tables[seg.data.table].dim
            if current and values + size > MAX_MESSAGE_VALUES:
                out.append(current)
                current, values = [], 0
            current.append(seg)
            values += size
        return out + [current] if current or not out else out

    @torch.no_grad()
    def take(self, asked: list, got: list) -> str:
        """Write the rows ``got`` (a reply's rows segments) for the ids ``asked`` into the
        model's tables; a reply holding other rows writes nothing: why, else ''."""
        problem = reply_mismatch(asked, got, self.layout.tables)
        if problem:
            return problem
        for seg in got:
            data = seg.data
            if self.remapped:
                at = torch.searchsorted(self.unique[data.table], data.ids)
                self.local[data.table][at] = data.values.to(torch.float32)
            else:
                self.weights[data.table][data.ids] = data.values.to(torch.float32)
        return ""

    def _look_up(self, t: int) -> Callable:
        """A forward of table ``t``'s module: its weight the local rows, its ids their
        positions among the ids held."""
        def hook(module, args, kwargs):
            ids, unique = lookup_ids(args, kwargs), self.unique[t]
            at = torch.searchsorted(unique, ids.contiguous())
            inside = at < len(unique)
            held = inside.clone()
            held[inside] = unique[at[inside]] == ids[inside]
            if not bool(held.all()):
                raise RuntimeError(f"table {self.layout.tables[t].name!r} looked up id "
                                   f"{int(ids[~held][0])}, which the test split's rows do not "
                                   "hold: the evaluator remaps only the ids it pulled")
            module.weight = nn.Parameter(self.local[t], requires_grad=False)
            return with_lookup_ids(args, kwargs, at)
        return hook

    def _put_back(self, t: int) -> Callable:
        def hook(module, args, output):
            module.weight = self.weights[t]
        return hook

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
