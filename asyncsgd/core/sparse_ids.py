"""Ids of row-sparse tables: ``hash_id`` (SplitMix64), the shard that holds a row, and the
seeded initial values of a row, the same for an id on any run, shard or process.
"""

from __future__ import annotations

from typing import Union

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK = (1 << 64) - 1

Ids = Union[int, torch.Tensor]


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    # torch shifts int64 arithmetically; masking the sign copies off makes it logical
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix_int(x: int) -> int:
    z = (x + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK
    return _signed(z ^ (z >> 31))


def hash_id(ids: Ids) -> Ids:
    """SplitMix64 of an int64 id (or an int64 tensor of ids), as an int64: the first output
    of the SplitMix64 generator seeded with the id, two's complement wrapped."""
    if not isinstance(ids, torch.Tensor):
        return _mix_int(int(ids))
    if ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64, got {ids.dtype}")
    # int64 addition and multiplication wrap modulo 2**64 on every torch backend
    z = ids + _signed(_GOLDEN)
    z = (z ^ _srl(z, 30)) * _signed(_MIX1)
    z = (z ^ _srl(z, 27)) * _signed(_MIX2)
    return z ^ _srl(z, 31)


def shard_of(ids: Ids, shards: int, hashed: bool) -> Ids:
    """The shard of each id: ``id % shards``, or ``hash_id(id) % shards`` (floor modulo of the
    signed hash, so never negative) when the id space is hashed."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    keys = hash_id(ids) if hashed else ids
    if isinstance(keys, torch.Tensor):
        return torch.remainder(keys, shards)
    return keys % shards


def seeded_rows(ids: torch.Tensor, dim: int, seed: int, scale: float) -> torch.Tensor:
    """float32 [len(ids), dim] initial rows, uniform in [-scale, scale): element j of an id's
    row is output j of the SplitMix64 stream seeded with ``hash_id(id) ^ seed``, its top 24
    bits taken as a float. Integer arithmetic only, so the same bits everywhere."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    base = hash_id(ids) ^ _signed(seed)
    steps = torch.arange(dim, dtype=torch.int64) * _signed(_GOLDEN)
    bits = _srl(hash_id(base[:, None] + steps[None, :]), 40)
    # bits / 2**23 - 1 is exact in float32: [-1, 1) in steps of 2**-23
    unit = bits.to(torch.float32).mul_(2.0 ** -23).sub_(1.0)
    return unit.mul_(scale)
