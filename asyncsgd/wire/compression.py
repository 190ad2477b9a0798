"""Compressed pushes and pulls: cast (bf16, fp16), int8 with per-chunk scales, or top-k.

The formats are PROTOCOL.md's "Compressed pushes"; this is what senders do with them
(``Compressor``, error feedback included) and how a receiver checks and expands them
(``expand``) before the shard, which keeps float32, applies them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .protocol import (DTYPES, FRAME_BYTES, INT8, TOPK, WIRE_FLOATS, Code, Packed,
                       ProtocolError, Segment, packed_bytes)

INT8_CHUNK = 256  # values per scale: 1.6% of overhead; a larger chunk rounds small values
WIRE_DTYPES = {"float32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # flag -> name


class Compressor:
    """A worker's encoder of pushes: each shard's slice of the gradient as the segments to
    send, keeping that shard's error-feedback residual between pushes.

    int8 and top-k keep *error feedback* (Seide et al. 2014; Stich et al. 2018): what a
    push left out (the gradient plus the previous residual, minus what was sent) is added
    to the next gradient, so nothing is dropped, only delayed. (A push the server never
    applies, a sync push acknowledged ``stale``, is dropped with what it carried.)
    ``segments`` is called once per push (a retry re-sends the same message), so the
    residual advances exactly once per push."""

    def __init__(self, kind: str = "none", ratio: float = 0.0, push_dtype: str = "float32"):
        """``kind``: none, int8 or topk (keeping the ``ratio`` share); ``push_dtype`` (none
        only): float32, bf16 or fp16."""
        # top-k above half: 8 bytes a kept value outweigh float32's 4 a value, and its
        # frames would outgrow what a shard takes from a peer (4 bytes a value of its slice)
        if kind not in ("none", INT8, TOPK) or (kind == TOPK and not 0 < ratio <= 0.5):
            raise ValueError(f"compression {kind!r} (ratio {ratio}): none, int8 or topk "
                             "with 0 < ratio <= 0.5")
        if kind != "none" and push_dtype != "float32":
            raise ValueError("int8 and top-k values have formats of their own: push_dtype "
                             "stays float32")
        self.kind, self.ratio = kind, ratio
        self.dtype = DTYPES[WIRE_DTYPES.get(push_dtype, push_dtype)]
        self.residuals: dict = {}  # shard -> float32 residual of its slice

    @property
    def lossless(self) -> bool:
        return self.kind == "none" and self.dtype == torch.float32

    def segments(self, shard: int, grads: torch.Tensor) -> list:
        """Segments for ``grads``, one shard's flat float32 slice."""
        if self.kind == "none":
            step = FRAME_BYTES // self.dtype.itemsize
            wire = grads.to(self.dtype)  # bf16/fp16: a copy, which the next step leaves alone
            out = [Segment(i, wire[i:i + step], transient=True)
                   for i in range(0, len(wire), step)]
        else:
            residual = self.residuals.get(shard)
            if residual is None or residual.shape != grads.shape:
                residual = self.residuals[shard] = torch.zeros_like(grads, dtype=torch.float32)
            residual += grads  # what is owed now: this gradient and what earlier ones left
            step = FRAME_BYTES // 4
            out = []
            for i in range(0, len(residual), step):
                run = residual[i:i + step]
                packed = pack_int8(run) if self.kind == INT8 else pack_topk(run, self.ratio)
                run -= expand_packed(packed)  # the residual: what this push leaves out
                out.append(Segment(i, packed, transient=True))
        return out

    def residual(self) -> torch.Tensor:
        """Every shard's residual, in shard order (empty without error feedback)."""
        return torch.cat([self.residuals[i] for i in sorted(self.residuals)]) \
            if self.residuals else torch.zeros(0)


def pack_int8(values: torch.Tensor, chunk: int = INT8_CHUNK) -> Packed:
    """``values`` (float32, 1-D) as int8 with one scale per ``chunk``: round to nearest,
    the chunk's largest magnitude at +-127 (a chunk of zeros has scale 0)."""
    n = len(values)
    chunks = -(-n // chunk)
    padded = torch.zeros(chunks * chunk, dtype=torch.float32)
    padded[:n] = values
    rows = padded.view(chunks, chunk)
    scales = rows.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-127, 127).to(torch.int8).view(-1)[:n]
    payload = torch.empty(packed_bytes(INT8, n, chunk), dtype=torch.uint8)
    payload[:4 * chunks] = scales.view(torch.uint8)
    payload[4 * chunks:] = q.view(torch.uint8)
    return Packed(INT8, n, chunk, payload)


def pack_topk(values: torch.Tensor, ratio: float) -> Packed:
    """The ``ratio`` share of ``values`` largest in magnitude (at least one), as increasing
    int32 indices and their float32 values."""
    n = len(values)
    k = min(n, max(1, math.ceil(ratio * n)))
    index = torch.topk(values.abs(), k, sorted=False).indices.sort().values
    payload = torch.empty(8 * k, dtype=torch.uint8)
    payload[:4 * k] = index.to(torch.int32).view(torch.uint8)
    payload[4 * k:] = values[index].contiguous().view(torch.uint8)
    return Packed(TOPK, n, k, payload)


def expand_packed(packed: Packed) -> torch.Tensor:
    """A packed segment's values as float32, checked: int8 scales finite and >= 0, top-k
    indices strictly increasing and below n. A ProtocolError otherwise."""
    n, param, payload = packed.numel, packed.param, packed.payload
    if packed.format == INT8:
        chunks = -(-n // param)
        scales = payload[:4 * chunks].view(torch.float32)
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise ProtocolError(Code.NON_FINITE, "an int8 segment's scales must be finite "
                                                 "and >= 0")
        q = payload[4 * chunks:].view(torch.int8).to(torch.float32)
        if chunks == 1:  # no chunk-long copy of the scale for a run shorter than a chunk
            return q * scales[0]
        return q * scales.repeat_interleave(param)[:n]  # < n + param <= 2n values
    index = payload[:4 * param].view(torch.int32).to(torch.int64)
    if bool((index < 0).any()) or bool((index >= n).any()) or \
            (param > 1 and not bool((index[1:] > index[:-1]).all())):
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"top-k indices must be strictly increasing "
                                                 f"and in [0, {n})")
    dense = torch.zeros(n, dtype=torch.float32)
    dense[index] = payload[4 * param:].view(torch.float32)
    return dense


def expand(seg: Segment, size: int) -> Segment:
    """``seg`` as float32 values for a receiver whose slice holds ``size`` elements: a
    packed one expanded once it is known to fit (nothing allocated before), a bf16 or
    fp16 one widened; any other left as it is (the receiver refuses what it cannot use)."""
    data = seg.data
    if isinstance(data, Packed):
        if seg.offset + data.numel > size:
            raise ProtocolError(Code.OUT_OF_RANGE, f"{data.format} segment [{seg.offset}, "
                                                   f"{seg.offset + data.numel}) outside a "
                                                   f"slice of {size}")
        return Segment(seg.offset, expand_packed(data))
    if data.dtype in (torch.bfloat16, torch.float16):
        data = data.to(torch.float32)
    elif data.dim() == 1:
        return seg
    return Segment(seg.offset, data.reshape(-1))  # a shape of several sizes: C order, flat


def wire_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """The dtype a PULL's ``pull_dtype`` asks for (None: float32, as stored); a
    ProtocolError for anything but WIRE_FLOATS."""
    if name in (None, "float32"):
        return None
    if not isinstance(name, str) or name not in WIRE_FLOATS:
        raise ProtocolError(Code.BAD_DTYPE, f"pull_dtype {name!r} is not one of "
                                            f"{', '.join(WIRE_FLOATS)}")
    return DTYPES[name]


def segment_values(seg: Segment) -> Optional[int]:
    """How many values ``seg`` places: a packed one's n, a float32, bfloat16 or float16
    tensor's element count (any shape, placed flat in C order); None for anything a
    gradient cannot be (another dtype, empty)."""
    data = seg.data
    if isinstance(data, Packed):
        return data.numel
    numel = data.numel()
    if data.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not numel:
        return None
    return numel
