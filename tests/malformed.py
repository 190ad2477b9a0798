"""Malformed protocol messages, drawn from a ``random.Random``: hypothesis feeds it seeds
(tests/test_fuzz.py), the socket soak a fixed one.

``malformed(rng, size)`` starts from a valid PUSH for a shard of ``size``
elements and breaks it one way: a field of the wrong type or range, a bad
descriptor (dtype, offset, shape overflow, length mismatch, missing frames),
NaN/Inf gradients, a wrong shard id, a replay, or a msgpack bomb (deep
nesting, huge declared lengths, extension types, truncation, random bytes),
or a packed segment (int8, top-k) that lies: bad scales, indices, parameters,
lengths, or a run far beyond the shard (refused before anything is allocated).
Valid pushes are float32, bf16/fp16 or packed.
Some mutations happen to stay valid (e.g. another worker id); the oracle
treats every message by the reply it got, never by what it was meant to be.
"""

from __future__ import annotations

import random
import struct
from typing import Optional

import msgpack
import torch

from asyncsgd.wire.compression import pack_int8, pack_topk
from asyncsgd.wire.protocol import (DTYPES, MAX_HEADER_BYTES, PUSH, VERSION, Message, Segment,
                                    encode)

BAD_FIELDS = {
    "v": [0, 2, None, "1", 1.5, -1],
    "t": ["launch", "", 7, None, "PUSH", "welcome", "ack", "hello"],
    "w": [7, None, "x" * 257, "", b"bytes"],
    "i": [-1, "1", 2.5, 2 ** 64 - 1, True, None],
    "s": [-5, "7", 2 ** 64 - 1, 1.0, [1]],
    "c": [-1, 2 ** 63, "0", 10 ** 9, None],
    "sh": [-2, 2 ** 21, 1, 5, "0", None],
    "m": [[], "meta", 7, {"loss": float("nan"), "samples": -1}, {1: 2}],
    "d": ["d", 7, [[0, "float32"]], [None], [[0, "float32", [1]]] * 5000],
}
BAD_DTYPES = ["object", "complex64", "", "float", 7, None, "uint8", "bool"]
BAD_SHAPES = [[-1], [2 ** 40], [2 ** 39] * 8, [1] * 9, "4", [1.5], [None], [[4]]]
BOMBS = [
    b"\x91" * 100_000 + b"\x00",                # 100,000 nested arrays
    b"\x81\xa1m" + b"\x81\xa1x" * 20_000 + b"\x00",  # deeply nested maps
    b"\xdd\xff\xff\xff\xff",                    # an array claiming 4 G elements
    b"\xdf\xff\xff\xff\xff",                    # a map claiming 4 G pairs
    b"\xdb\xff\xff\xff\xff" + b"a" * 10,        # a string claiming 4 GiB
    b"\xc6\xff\xff\xff\xff",                    # bin claiming 4 GiB
    msgpack.packb({"v": VERSION, "t": "push", "m": msgpack.ExtType(5, b"payload")}),
    b"\x82\xa1v\x01\xa1m\xd7\xff" + b"\x00" * 8,  # a msgpack timestamp (ext type -1)
    b"\xc1",                                    # the never-used msgpack byte
    b"",
]


WORKERS = ("soak", "other", "w3")  # the ids pushes speak for: admit them for a live shard


def valid_push(rng: random.Random, size: int, seq: int, shard: int = 0,
               worker: str = "soak", tokens: Optional[dict] = None,
               float32: bool = False) -> tuple:
    """A valid push with small integer gradients (exact in float32) and its gradient;
    ``tokens``: each worker's session token, for a live shard (``Server.admit``). Its
    values travel as float32, bf16/fp16 (exact too) or packed, unless ``float32``."""
    grad = torch.tensor([rng.randint(-3, 3) for _ in range(size)], dtype=torch.float32)
    cut = rng.randrange(0, size + 1)
    segments = [s for s in (Segment(0, grad[:cut]), Segment(cut, grad[cut:])) if len(s.data)]
    wire = 1.0 if float32 else rng.random()
    if wire < 0.15:  # small integers: exact in bf16 and fp16 too
        segments = [Segment(s.offset, s.data.to(rng.choice([torch.bfloat16, torch.float16])))
                    for s in segments]
    elif wire < 0.3:
        segments = [Segment(s.offset, pack_int8(s.data, rng.choice([1, 7, 256]))
                            if rng.random() < 0.5 else pack_topk(s.data, rng.random()))
                    for s in segments]
    msg = Message(type=PUSH, worker=worker, incarnation=1, seq=seq, shard=shard,
                  meta={"loss": 0.5, "samples": 8}, segments=segments,
                  token=(tokens or {}).get(worker, ""))
    return [bytes(f) for f in encode(msg)], grad


def _header(frames: list) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _pack(header: dict, frames: list) -> list:
    return [msgpack.packb(header, use_bin_type=True)] + frames[1:]


def malformed(rng: random.Random, size: int, seq: int, shard: int = 0,
              tokens: Optional[dict] = None) -> list:
    """One broken message (a list of frames) for a shard of ``size`` float32 elements."""
    frames, _ = valid_push(rng, size, seq, shard, worker=rng.choice(WORKERS), tokens=tokens,
                           float32=True)
    header = _header(frames)
    kind = rng.randrange(13)
    if kind == 0:    # a field of the wrong type or range
        key = rng.choice(sorted(BAD_FIELDS))
        header[key] = rng.choice(BAD_FIELDS[key])
    elif kind == 1:  # an unknown dtype
        header["d"][0][1] = rng.choice(BAD_DTYPES) if header["d"] else None
    elif kind == 2:  # a shape that overflows or lies
        if header["d"]:
            header["d"][0][2] = rng.choice(BAD_SHAPES)
    elif kind == 3:  # a frame shorter or longer than its descriptor says
        if len(frames) > 1:
            frames[1] = frames[1][:-rng.randrange(1, 4)] if rng.random() < 0.5 else \
                frames[1] + b"\x00" * rng.randrange(1, 9)
    elif kind == 4:  # frames missing or added
        frames = frames[:1] if rng.random() < 0.5 else frames + [b"\x00" * 4]
    elif kind == 5:  # offsets outside the shard, or negative
        if header["d"]:
            header["d"][-1][0] = rng.choice([size, size + 10 ** 6, 2 ** 62, -1, 2 ** 64 - 1])
    elif kind == 6:  # NaN or Inf somewhere in the gradient
        bad = torch.frombuffer(bytearray(frames[-1]), dtype=torch.float32) if len(frames) > 1 \
            else None
        if bad is not None and len(bad):
            bad[rng.randrange(len(bad))] = rng.choice([float("nan"), float("inf"), -float("inf")])
            frames[-1] = bytes(bad.numpy().tobytes())
    elif kind == 7:  # another dtype (bad-dtype) or a 2-D shape (a gradient, placed flat)
        if header["d"]:
            n = header["d"][0][2][0]
            dtype = rng.choice(sorted(set(DTYPES) - {"float32"}))
            itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
            header["d"][0][1:] = ([dtype, [n]] if rng.random() < 0.5 else ["float32", [1, n]])
            if header["d"][0][1] != "float32":
                frames[1] = b"\x00" * (n * itemsize)
    elif kind == 8:  # another shard's id
        header["sh"] = rng.choice([shard + 1, shard + 7, 2 ** 20])
    elif kind == 12:  # a packed segment that lies
        return _bad_packed(rng, frames, header, size)
    elif kind == 9:  # a msgpack bomb in place of the header
        return [rng.choice(BOMBS)] + frames[1:]
    elif kind == 10:  # truncated, bit-flipped or oversized header
        head = bytearray(frames[0])
        choice = rng.randrange(3)
        if choice == 0:
            head = head[:rng.randrange(len(head))]
        elif choice == 1:
            for _ in range(rng.randrange(1, 4)):
                head[rng.randrange(len(head))] ^= 1 << rng.randrange(8)
        else:
            head = b"\x81\xa1m" + b"\xdb" + struct.pack(">I", MAX_HEADER_BYTES + 10) + \
                b"a" * (MAX_HEADER_BYTES + 10)
        return [bytes(head)] + frames[1:]
    else:            # random bytes in every frame
        return [rng.randbytes(rng.randrange(1, 300)) for _ in range(rng.randrange(1, 4))]
    return _pack(header, frames)


def _bad_packed(rng: random.Random, frames: list, header: dict, size: int) -> list:
    """The push's first segment packed, then broken one way."""
    header["d"] = header["d"][:1]
    n = max(1, header["d"][0][2][0] if header["d"] else 1)
    values = torch.arange(1, n + 1, dtype=torch.float32)
    packed = pack_int8(values, 4) if rng.random() < 0.5 else pack_topk(values, 0.5)
    payload = bytearray(packed.payload.numpy().tobytes())
    desc = [0, packed.format, [n], packed.param]
    way = rng.randrange(7)
    if way == 0:    # an unknown format or a parameter out of range
        if rng.random() < 0.5:
            desc[1] = rng.choice(["int4", "TOPK", "", 3, None])
        else:
            desc[3] = rng.choice([0, -1, n + 1 if packed.format == "topk" else 2 ** 21, 1.5, "4"])
    elif way == 1:  # a frame a byte short or long
        payload = payload[:-1] if rng.random() < 0.5 else payload + b"\x00"
    elif way == 2 and packed.format == "int8":  # a scale NaN, Inf or negative
        struct.pack_into("<f", payload, 0, rng.choice([float("nan"), float("inf"), -1.0]))
    elif way == 2:  # an index out of range or repeated
        struct.pack_into("<i", payload, 0, rng.choice([-1, n, 2 ** 31 - 1]))
        if packed.param > 1 and rng.random() < 0.5:
            payload[4:8] = payload[0:4]
    elif way == 3:  # a run past the slice: [n] of 2^39 values in 8 bytes, never allocated
        desc, payload = [0, "topk", [2 ** 39], 1], bytearray(struct.pack("<if", 5, 1.0))
    elif way == 4:  # a run at an offset past the slice
        desc[0] = size - n + rng.randrange(1, 1000)
    elif way == 5:  # shape not [n]
        desc[2] = rng.choice([[n, 1], [], [0], "n", [-n]])
    else:           # NaN in a top-k value
        topk = pack_topk(values, 0.5)
        desc = [0, "topk", [n], topk.param]
        payload = bytearray(topk.payload.numpy().tobytes())
        struct.pack_into("<f", payload, 4 * topk.param, float("nan"))
    header["d"][:1] = [desc]
    return _pack(header, [frames[0], bytes(payload)])
