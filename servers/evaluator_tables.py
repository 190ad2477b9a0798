"""The evaluator's rows of the tables served by row: the ids the test split looks up, asked of
each shard beside its dense slice, and written into the server's model at those ids.

The server's model holds its tables whole (the task builds it so), and only the rows the metric
reads are refreshed at an evaluation: for ctr's sizes (up to 10^6 rows a table) a full-size
table filled at those ids costs less than remapping ids into a table of the touched rows. The
final observation asks every row, so the model the run saves holds the whole trained tables.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from asyncsgd.errors import ConfigError
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
            ids = args[0] if args else kwargs["input"]
            seen[t].append(torch.unique(ids.detach().reshape(-1).to("cpu", torch.int64)))
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
    model's tables."""

    def __init__(self, model: nn.Module, layout: Layout, ids: Sequence, shards: int,
                 hash_ids: Optional[Callable] = None):
        self.layout = layout
        self.weights = [m.weight for m in table_modules(model, layout)]
        for spec, table_ids in zip(layout.tables, ids):
            if table_ids.numel() and (int(table_ids.min()) < 0 or
                                      int(table_ids.max()) >= spec.rows):
                raise ConfigError(f"table {spec.name!r} is looked up at ids outside its "
                                  f"{spec.rows} rows: the server's evaluator fills the model's "
                                  "table at the ids its test split reads")
        self.pulls: list = []  # per shard: the ids segments of each pull
        for shard in range(shards):
            segments = []
            for t, table_ids in enumerate(ids):
                keys = hash_ids(table_ids) if hash_ids is not None else table_ids
                mine = table_ids[torch.remainder(keys, shards) == shard]
                segments += split_rows(t, mine)
            self.pulls.append(self._messages(segments))

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
            self.weights[data.table][data.ids] = data.values.to(torch.float32)
        return ""
