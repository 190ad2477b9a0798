"""How a model's parameters are laid out for the parameter server: one flat float32 vector,
cut into contiguous shard slices, its embedding tables apart (sharded by row), and the
signature worker and server compare.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from ..errors import ConfigError


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple
    offset: int
    numel: int


@dataclass(frozen=True)
class TableSpec:
    """An embedding table served row by row: parameter ``name``, float32 [rows, dim]; rows
    travel as row-sparse segments naming the table by its index in ``Layout.tables``."""

    name: str
    rows: int
    dim: int


def holds(ids: torch.Tensor, shard: int, shards: int, rows=None,
          hash_ids: Optional[Callable] = None) -> torch.Tensor:
    """Which of ``ids`` (int64) shard ``shard`` of ``shards`` holds, as a bool mask: in a
    fixed id space (``rows``: an int, or one per id) ids in [0, rows) with
    ``id % shards == shard``; in a hashed
    one (``hash_ids``: core.sparse_ids.hash_id, which the wire does not import) any id
    with ``hash_ids(id) % shards == shard``."""
    if hash_ids is not None:
        return torch.remainder(hash_ids(ids), shards) == shard
    return (ids >= 0) & (ids < rows) & (torch.remainder(ids, shards) == shard)


def shard_rows(rows: int, shard: int, shards: int) -> int:
    """How many of a fixed table's ``rows`` shard ``shard`` holds (ids shard, shard +
    shards, ...; local row ``id // shards``)."""
    return len(range(shard, rows, shards))


class Layout:
    """A model's parameters as one flat float32 vector, in ``named_parameters()`` order.

    Shard ``i`` of ``S`` owns a contiguous, equal-sized range of it, so shards are
    balanced by bytes and a large tensor may be split across shards. A worker ``bind``s
    its model to two flat buffers, so a pull copies received bytes straight into the
    model and a push sends slices of ``flat_grads`` without gathering anything.

    ``tables`` (``TableSpec``) are the parameters served row by row instead: they are not
    in the flat vector (the *dense slice*), and a model without them is laid out as before.
    """

    def __init__(self, specs: list, tables: Sequence = (), order: Sequence = ()):
        self.specs = specs
        self.tables = list(tables)
        self.total = sum(s.numel for s in specs)
        # every parameter's (name, shape) in model order: the signature lists them all
        self.order = list(order) or [(s.name, s.shape) for s in specs]

    @classmethod
    def of(cls, model: nn.Module, tables: Sequence = ()) -> "Layout":
        """``tables``: names of 2-D parameters to serve row by row (``core.models.embedding_tables``
        finds a model's own); the rest is the dense slice."""
        named = dict(model.named_parameters())
        unknown = [name for name in tables if name not in named or named[name].dim() != 2]
        if unknown:
            raise ConfigError(f"table {unknown[0]!r} is not a 2-D parameter of the model; "
                              f"name one of {[n for n, p in named.items() if p.dim() == 2]}")
        specs, found, offset = [], {}, 0
        for name, p in named.items():
            if p.dtype != torch.float32:
                raise ConfigError(f"parameter {name} is {p.dtype}; the parameter server "
                                  "holds float32 parameters (keep the model in float32)")
            if name in tables:
                found[name] = TableSpec(name, p.shape[0], p.shape[1])
                continue
            specs.append(ParamSpec(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        if not specs and not found:
            raise ConfigError("the model has no parameters to serve")
        return cls(specs, [found[name] for name in named if name in found],
                   [(name, tuple(p.shape)) for name, p in named.items()])

    def _dense(self, model: nn.Module) -> list:
        """The model's parameters in the flat vector, in order (its tables left out)."""
        if not self.tables:
            return list(model.parameters())
        apart = {t.name for t in self.tables}
        return [p for name, p in model.named_parameters() if name not in apart]

    def signature(self) -> dict:
        """Names, shapes, dtypes and their digest: a worker with another model is refused
        at the handshake instead of corrupting the parameters (other data on the same
        model is ``core.signature``'s to catch)."""
        body = {"names": [name for name, _ in self.order],
                "shapes": [list(shape) for _, shape in self.order],
                "dtypes": ["float32"] * len(self.order)}
        if self.tables:  # only then: a model without tables signs as before
            body["tables"] = [[t.name, t.rows, t.dim] for t in self.tables]
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
        return {**body, "digest": digest, "total": self.total}

    def shard_ranges(self, shards: int) -> list:
        """``[(start, end), ...]``: contiguous, equal-sized (±1 element) slices (empty
        ones when a model with tables has fewer dense values than shards)."""
        if not 1 <= shards <= (shards if self.tables else self.total):
            raise ConfigError(f"--shards {shards}: must be between 1 and the number of "
                              f"parameters ({self.total})")
        bounds = [self.total * i // shards for i in range(shards + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def flatten(self, model: nn.Module) -> torch.Tensor:
        dense = self._dense(model)
        if not dense:
            return torch.zeros(0)
        return torch.cat([p.detach().reshape(-1) for p in dense]).float().clone()

    def bind(self, model: nn.Module, flat_params: torch.Tensor, flat_grads: torch.Tensor) -> None:
        """Make the model's parameters and gradients views of the flat buffers (copied in)."""
        with torch.no_grad():
            for spec, p in zip(self.specs, self._dense(model)):
                view = flat_params[spec.offset:spec.offset + spec.numel].view(spec.shape)
                view.copy_(p)
                p.data = view
                p.grad = flat_grads[spec.offset:spec.offset + spec.numel].view(spec.shape)

    def state_dict(self, flat: torch.Tensor) -> dict:
        """``{name: tensor}`` of a flat parameter vector, as the model's state_dict names them."""
        return {s.name: flat[s.offset:s.offset + s.numel].view(s.shape).clone() for s in self.specs}


def signature_mismatch(ours: dict, theirs) -> str:
    """A readable difference between two signatures, or '' when they agree.

    Every name, shape and dtype is compared: the digest is the worker's own
    claim, so a copied digest proves nothing (a peer that sent ours with another
    model's fields was welcomed before). Anything malformed is a difference,
    never an exception: ``theirs`` comes from the network.
    """
    if not isinstance(theirs, dict):
        return "no model signature was sent (a map of names, shapes and dtypes)"
    fields = {}
    for key in ("names", "shapes", "dtypes"):
        value = theirs.get(key)
        if not isinstance(value, list):
            return f"the signature's {key} must be a list, got {type(value).__name__}"
        fields[key] = value
    names, shapes, dtypes = fields["names"], fields["shapes"], fields["dtypes"]
    if not len(names) == len(shapes) == len(dtypes):
        return (f"the signature lists {len(names)} names, {len(shapes)} shapes and "
                f"{len(dtypes)} dtypes")
    for i, name in enumerate(ours["names"]):
        if i >= len(names):
            return f"the worker's model lacks parameter {name}"
        if names[i] != name:
            return f"parameter {i} is {names[i]!r} on the worker but {name!r} on the server"
        shape = shapes[i]
        if not isinstance(shape, list) or shape != ours["shapes"][i]:
            return (f"{name} has shape {shape!r} on the worker but {ours['shapes'][i]} "
                    "on the server")
        if dtypes[i] != ours["dtypes"][i]:
            return (f"{name} is {dtypes[i]!r} on the worker but {ours['dtypes'][i]} "
                    "on the server")
    if len(names) > len(ours["names"]):
        return f"the worker's model has extra parameter {names[len(ours['names'])]!r}"
    tables = theirs.get("tables", [])
    if tables != ours.get("tables", []):
        return (f"the worker serves tables {tables!r:.200} but the server "
                f"{ours.get('tables', [])!r:.200}")
    return ""
