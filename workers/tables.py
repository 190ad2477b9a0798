"""A worker's embedding tables served row by row: the rows a batch touches, local weights
that stand in for the tables during a step, and the row gradients it pushes.

The worker never holds a whole table. Per step and table it pulls the rows of ``U``, the
batch's unique ids (sorted), computes on a float32 weight of ``len(U)`` rows put in the
module's place, with the module's input ids remapped to their positions in ``U``, and
pushes that weight's gradient rows: the same loss and the same gradients as the whole
table's at those rows (tests/test_worker_tables.py checks both exactly).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from asyncsgd.core.sparse_ids import shard_of
from asyncsgd.core.models import lookup_ids, with_lookup_ids
from asyncsgd.errors import ConfigError
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.sparse import by_table, unique_ids, within

# EmbeddingBag modes whose result a remap of the ids keeps: each bag reduces the rows its
# ids name, and the local weight holds exactly those rows (tested for all three)
BAG_MODES = ("sum", "mean", "max")


class BatchTables:
    """The served tables of ``model`` (``layout.tables``, in their order): their modules,
    checked once, and per step their local weights.

    ``begin(ids, rows)`` puts a weight of the pulled ``rows`` (float32 [len(ids), dim],
    requires_grad) in each module's place; forward and backward run as usual; ``settle()``
    after the backward makes every table's gradient dense (so clipping sees it as the
    model's) and ``gradients()`` gives the rows to push. Outside a step a table's module
    holds an empty [0, dim] weight: the worker keeps no copy of the table."""

    def __init__(self, model: nn.Module, layout: Layout):
        self.model, self.specs = model, list(layout.tables)
        modules = {f"{prefix}.weight" if prefix else "weight": module
                   for prefix, module in model.named_modules()}
        self.modules = []
        for spec in self.specs:
            module = modules.get(spec.name)
            if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                raise ConfigError(f"table {spec.name!r} is not the weight of an nn.Embedding or "
                                  "nn.EmbeddingBag: a worker serves only those row by row; "
                                  "name another table or use --embeddings dense")
            _check_module(spec.name, module)
            self.modules.append(module)
        self.unique: list = [None] * len(self.specs)  # U per table, on the step's device
        self.touched: list = [None] * len(self.specs)  # positions in U the backward reached
        self._hooks = [m.register_forward_pre_hook(self._remap_hook(t), with_kwargs=True)
                       for t, m in enumerate(self.modules)]
        self._probing: Optional[list] = None
        for module, spec in zip(self.modules, self.specs):
            module.weight = nn.Parameter(torch.zeros(0, spec.dim))

    # -- which rows a batch touches ---------------------------------------------------

    def ids_of(self, inputs: Sequence[torch.Tensor]) -> list:
        """Per table, the unique ids (int64, sorted, on the CPU) the model looks up on
        ``inputs``: from the model's ``embedding_inputs`` when it has one, else from a
        probe, a forward without gradients whose tables answer zeros (one extra forward)."""
        own = getattr(self.model, "embedding_inputs", None)
        looked = own(*inputs) if callable(own) else self._probe(inputs)
        if len(looked) != len(self.specs):
            raise ConfigError(f"{type(self.model).__name__}.embedding_inputs gave ids for "
                              f"{len(looked)} tables; the model serves {len(self.specs)}")
        return unique_per_table([ids.detach().reshape(-1).to("cpu", torch.int64)
                                 for ids in looked])

    def _probe(self, inputs: Sequence[torch.Tensor]) -> list:
        """Every served module's input ids over one forward of ``inputs``, in eval mode (no
        batch-norm statistics move) and with the random state put back (dropout draws
        nothing the real forward would miss). Each table looks up row 0 of a zero weight
        instead: its output is zeros of the right shape, and no id needs to exist."""
        self._probing = [[] for _ in self.specs]
        blanks = [nn.Parameter(torch.zeros(1, spec.dim, device=_device(inputs)),
                               requires_grad=False) for spec in self.specs]
        kept = [m.weight for m in self.modules]
        was_training = self.model.training
        state = torch.get_rng_state()
        try:
            for module, blank in zip(self.modules, blanks):
                module.weight = blank
            self.model.eval()
            with torch.no_grad():
                self.model(*inputs)
            return [torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)
                    for found in self._probing]
        finally:
            self._probing = None
            for module, weight in zip(self.modules, kept):
                module.weight = weight
            self.model.train(was_training)
            torch.set_rng_state(state)

    # -- a step -----------------------------------------------------------------------

    def begin(self, ids: Sequence[torch.Tensor], rows: Sequence[torch.Tensor],
              device: torch.device) -> None:
        """Each table's local weight: ``rows[t]`` (float32 [len(ids[t]), dim], the rows
        pulled for ``ids[t]``, its unique sorted ids) on ``device``, with a fresh gradient."""
        for t, (module, spec) in enumerate(zip(self.modules, self.specs)):
            if rows[t].shape != (len(ids[t]), spec.dim):
                raise ValueError(f"table {t}: {tuple(rows[t].shape)} rows for "
                                 f"{len(ids[t])} ids of width {spec.dim}")
            self.unique[t] = ids[t].to(device)
            module.weight = nn.Parameter(rows[t].to(device, torch.float32))
            self.touched[t] = None

    def _remap_hook(self, t: int):
        def hook(module, args, kwargs):
            ids = lookup_ids(args, kwargs)
            if self._probing is not None:
                self._probing[t].append(ids.detach())
                return with_lookup_ids(args, kwargs, torch.zeros_like(ids))
            unique = self.unique[t]
            if unique is None:
                raise RuntimeError(f"table {self.specs[t].name!r} was used outside a step: "
                                   "the worker holds only the rows of the batch it trains")
            at = torch.searchsorted(unique, ids.contiguous())
            # a row the forward looks up that was not pulled: a model whose
            # embedding_inputs misses ids would else train on its neighbour's row
            if ids.numel() and (len(unique) == 0 or not bool(
                    (unique[at.clamp(max=len(unique) - 1)] == ids).all())):
                raise RuntimeError(f"table {self.specs[t].name!r} looked up ids outside the "
                                   "batch's rows: its model's embedding_inputs must return "
                                   "every id the forward looks up")
            return with_lookup_ids(args, kwargs, at)
        return hook

    def settle(self) -> None:
        """After the backward: each table's gradient dense [len(U), dim] (so clipping treats
        it as a model parameter's), keeping which rows a sparse one held (``gradients``)."""
        for t, module in enumerate(self.modules):
            grad = module.weight.grad
            if grad is None:
                module.weight.grad = torch.zeros_like(module.weight)
                self.touched[t] = torch.zeros(0, dtype=torch.int64)
            elif grad.is_sparse:
                grad = grad.coalesce()
                self.touched[t] = grad.indices()[0].cpu()
                module.weight.grad = grad.to_dense()
            else:
                self.touched[t] = None  # every row of U: a dense gradient names them all

    def gradients(self) -> list:
        """Per table ``(ids, values)``: the rows to push, on the CPU, float32 [n, dim]; for
        a sparse module only the rows its gradient held (an EmbeddingBag's max reaches some
        rows of a bag only), as torch's sparse optimizers would update."""
        out = []
        for t, module in enumerate(self.modules):
            grad, ids = module.weight.grad.detach().cpu(), self.unique[t].cpu()
            touched = self.touched[t]
            out.append((ids, grad) if touched is None else (ids[touched], grad[touched]))
        return out

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


class LocalRows:
    """--local-steps with tables served by row: the rows of the ids of the next H batches
    (``ids``, per table its unique sorted ids), pulled once, stood in for the tables at each
    of those steps (``BatchTables.begin``) and stepped in place by plain SGD, as the dense
    parameters by the inner optimizer; the push then carries their pseudo-gradient, pulled
    minus local rows, as the dense part's. A window of H batches touches fewer rows than H
    batches apart: ids a window repeats are pulled and pushed once."""

    def __init__(self, ids: Sequence[torch.Tensor], rows: Sequence[torch.Tensor],
                 device: torch.device):
        self.ids = list(ids)
        # copies: the pulled rows may be views of a received frame
        self.pulled = [r.to(device, torch.float32, copy=True) for r in rows]
        self.rows = [r.clone() for r in self.pulled]

    def step(self, tables: BatchTables, lr: float) -> None:
        """``rows -= lr * grad`` per table, after the step's backward (and ``settle``, so
        each gradient is dense [len(ids), dim], zero on the rows the batch did not touch)."""
        with torch.no_grad():
            for local, module in zip(self.rows, tables.modules):
                local.sub_(module.weight.grad, alpha=lr)

    def pseudo_gradients(self) -> list:
        """Per table ``(ids, pulled - local)`` on the CPU, for the rows that moved: a row
        whose steps summed to nothing is not pushed (sgd and adagrad leave it as it is)."""
        out = []
        for ids, pulled, local in zip(self.ids, self.pulled, self.rows):
            delta = (pulled - local).cpu()
            moved = delta.ne(0).any(1)
            out.append((ids.cpu(), delta) if bool(moved.all()) else
                       (ids.cpu()[moved], delta[moved]))
        return out


def _device(inputs: Sequence[torch.Tensor]) -> torch.device:
    for tensor in inputs:
        if isinstance(tensor, torch.Tensor):
            return tensor.device
    return torch.device("cpu")


def _check_module(name: str, module: nn.Module) -> None:
    """Refuse a table whose lookups need the whole table, or a reduction a remap changes."""
    if module.max_norm is not None:
        raise ConfigError(f"table {name!r} has max_norm={module.max_norm}: the lookup renormalises "
                          "rows in the whole table, which no worker holds; drop max_norm or use "
                          "--embeddings dense")
    if module.padding_idx is not None:
        raise ConfigError(f"table {name!r} has padding_idx={module.padding_idx}: that row's "
                          "gradient is held at zero by its index, which the worker renumbers; "
                          "drop padding_idx or use --embeddings dense")
    if isinstance(module, nn.EmbeddingBag) and module.mode not in BAG_MODES:
        raise ConfigError(f"table {name!r} is an EmbeddingBag of mode {module.mode!r}: served "
                          f"row by row it must be one of {', '.join(BAG_MODES)}")


def unique_per_table(ids: Sequence[torch.Tensor]) -> list:
    """Per table, its unique ``ids`` sorted: one sort of all tables' ids by (table, id)
    rather than a torch.unique per table (26 of them a step for ctr)."""
    if len(ids) < 2:
        return [unique_ids(one) for one in ids]
    every = torch.cat(list(ids))
    table_of = torch.repeat_interleave(torch.arange(len(ids)),
                                       torch.tensor([len(one) for one in ids]))
    every, table_of = by_table(every, table_of)
    first = torch.ones(len(every), dtype=torch.bool)
    first[1:] = (every[1:] != every[:-1]) | (table_of[1:] != table_of[:-1])
    counts = torch.bincount(table_of[first], minlength=len(ids))
    return list(every[first].split(counts.tolist()))


def route(ids: torch.Tensor, shards: int, hashed: bool) -> list:
    """Per shard, the positions in ``ids`` of those it holds (``id % shards``, or
    ``hash_id(id) % shards`` in a hashed id space), in the order of ``ids``."""
    owner = shard_of(ids, shards, hashed)
    return [torch.nonzero(owner == i).reshape(-1) for i in range(shards)]


def check_ids(ids: Sequence[torch.Tensor], layout: Layout, hashed: bool) -> None:
    """In a fixed id space every id is a row of its table: else one line naming it (the
    shard would refuse the push, and the worker stop with less to go on)."""
    if hashed:
        return
    if not ids:
        return
    if len(ids) == 1:  # one table (ctr:tables=1)
        if within(ids[0], layout.tables[0].rows):
            return
    else:
        bound = torch.repeat_interleave(torch.tensor([spec.rows for spec in layout.tables]),
                                        torch.tensor([len(t) for t in ids]))
        every = torch.cat(list(ids))
        if not bool(((every < 0) | (every >= bound)).any()):  # one test for all tables
            return
    for spec, table_ids in zip(layout.tables, ids):
        bad = (table_ids < 0) | (table_ids >= spec.rows)
        if bool(bad.any()):
            raise ConfigError(f"id {int(table_ids[bad][0])} of table {spec.name!r} is outside "
                              f"its {spec.rows} rows: the data need more rows (e.g. "
                              "ctr:rows=...) or the server --id-space hashed")
