"""How a model's parameters are laid out for the parameter server: one flat float32 vector,
cut into contiguous shard slices, and the signature worker and server compare.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import ConfigError


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple
    offset: int
    numel: int


class Layout:
    """A model's parameters as one flat float32 vector, in ``named_parameters()`` order.

    Shard ``i`` of ``S`` owns a contiguous, equal-sized range of it, so shards are
    balanced by bytes and a large tensor may be split across shards. A worker ``bind``s
    its model to two flat buffers, so a pull copies received bytes straight into the
    model and a push sends slices of ``flat_grads`` without gathering anything.
    """

    def __init__(self, specs: list):
        self.specs = specs
        self.total = sum(s.numel for s in specs)

    @classmethod
    def of(cls, model: nn.Module) -> "Layout":
        specs, offset = [], 0
        for name, p in model.named_parameters():
            if p.dtype != torch.float32:
                raise ConfigError(f"parameter {name} is {p.dtype}; the parameter server "
                                  "holds float32 parameters (keep the model in float32)")
            specs.append(ParamSpec(name, tuple(p.shape), offset, p.numel()))
            offset += p.numel()
        if not specs:
            raise ConfigError("the model has no parameters to serve")
        return cls(specs)

    def signature(self) -> dict:
        """Names, shapes, dtypes and their digest: a worker with another model is refused
        at the handshake instead of corrupting the parameters (other data on the same
        model is ``core.signature``'s to catch)."""
        body = {"names": [s.name for s in self.specs],
                "shapes": [list(s.shape) for s in self.specs],
                "dtypes": ["float32"] * len(self.specs)}
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
        return {**body, "digest": digest, "total": self.total}

    def shard_ranges(self, shards: int) -> list:
        """``[(start, end), ...]``: contiguous, equal-sized (±1 element) slices."""
        if not 1 <= shards <= self.total:
            raise ConfigError(f"--shards {shards}: must be between 1 and the number of "
                              f"parameters ({self.total})")
        bounds = [self.total * i // shards for i in range(shards + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    def flatten(self, model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).float().clone()

    def bind(self, model: nn.Module, flat_params: torch.Tensor, flat_grads: torch.Tensor) -> None:
        """Make the model's parameters and gradients views of the flat buffers (copied in)."""
        with torch.no_grad():
            for spec, p in zip(self.specs, model.parameters()):
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
    return ""
