"""The wire's fast paths say exactly what the general ones say: ``decode``'s one-segment path
(the same message, or the same error, as ``_message``) and ``encode`` with a ``HeaderCache``
or a ``PartsCache`` (frames that decode to the same message as those encoded whole)."""

import random

import msgpack
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncsgd.wire import protocol
from asyncsgd.wire.protocol import (PARAMS, PUSH, HeaderCache, Key, Message, PartsCache,
                                    ProtocolError, Segment, decode, encode, in_parts, split)
from asyncsgd.wire.transport import shared_frames
from malformed import malformed, valid_push

SIZE = 96


def _said(frames: list, general: bool):
    """What decoding ``frames`` gives: the message's fields and tensor bytes, or the error's
    code, text, seq and worker. ``general``: ``_message`` alone, past the fast path."""
    try:
        if general:
            header = msgpack.unpackb(frames[0], **protocol._UNPACK_LIMITS)
            try:
                msg = protocol._message(header, frames, None, None)
            except ProtocolError as err:
                raise err.echo(header)
        else:
            msg = decode(frames)
    except ProtocolError as err:
        return "error", err.code, str(err), err.seq, err.worker
    except Exception as exc:  # the general path's own header read failed: skip
        return "undecodable", type(exc).__name__
    return ("message", msg.type, msg.worker, msg.incarnation, msg.seq, msg.clock, msg.shard,
            msg.meta, msg.token, [(s.offset, type(s.data).__name__, _bytes(s.data))
                                  for s in msg.segments])


def _bytes(data) -> bytes:
    tensor = data if isinstance(data, torch.Tensor) else data.payload
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _one_segment_or_skip(frames: list) -> bool:
    """Whether ``frames`` is a header map and one tensor frame: what the fast path may take."""
    if len(frames) != 2:
        return False
    try:
        return isinstance(msgpack.unpackb(frames[0], **protocol._UNPACK_LIMITS), dict)
    except Exception:
        return False


@settings(max_examples=3000, deadline=None)
@given(st.integers(0, 2 ** 32 - 1).map(random.Random))
def test_one_segment_messages_decode_as_the_general_path_decodes_them(rng):
    frames = malformed(rng, SIZE, seq=rng.randrange(1, 100)) if rng.random() < 0.8 else \
        valid_push(rng, SIZE, seq=rng.randrange(1, 100))[0]
    if not _one_segment_or_skip(frames):
        return
    assert _said(frames, general=False) == _said(frames, general=True)


def test_every_field_a_fast_path_checks_is_refused_as_before():
    grad = torch.arange(6, dtype=torch.float32)
    good = [bytes(f) for f in encode(Message(type=PUSH, worker="w", incarnation=1, seq=3,
                                             shard=0, meta={Key.PULL: True},
                                             segments=[Segment(0, grad)], token="t"))]
    header = msgpack.unpackb(good[0])
    for key, values in [("v", [2, True, "3", None]), ("t", ["launch", 1, None]),
                        ("w", [1, "x" * 257]), ("m", [[], 1]), ("d", [[], None, [[0]] * 2]),
                        ("k", [1, "k" * 65]), ("i", [-1, "1", 2 ** 63]), ("s", [-1, 1.5]),
                        ("c", [2 ** 64 - 1]), ("sh", [-2, 2 ** 21, True]),
                        ("x", [1]), ("j", [[1]]), ("extra", [1])]:
        for value in values:
            frames = [msgpack.packb({**header, key: value}), good[1]]
            assert _said(frames, False) == _said(frames, True), (key, value)
    for desc, frame in [([0, "float32", [5]], good[1]), ([-1, "float32", [6]], good[1]),
                        ([0, "float16", [12]], good[1]), ([0, "float32", [2, 3]], good[1]),
                        ([0, "float32", [0]], good[1]), ([0, "float32", [0]], b""),
                        ([0, "object", [6]], good[1]), ([0, "float32", 6], good[1]),
                        ([0, "float32"], good[1]), ([0, "int8", [6], 1], good[1][:10]),
                        ([2 ** 62, "float32", [6]], good[1])]:
        frames = [msgpack.packb({**header, "d": [desc]}), frame]
        assert _said(frames, False) == _said(frames, True), desc
    frames = [msgpack.packb({**header, "m": {Key.PULL: 1}}), good[1]]
    assert _said(frames, False)[:2] == ("error", "bad-field")
    assert _said(good, False) == _said(good, True) and _said(good, False)[0] == "message"
    # the fast path itself takes the good push and its valid variations, and decodes them as
    # the general path does: a fast path that quietly stopped being taken fails here
    for key, value in [(None, None), ("k", ""), ("m", {}), ("c", 5), ("sh", -1), ("s", 0),
                       ("i", 2 ** 63 - 1), ("d", [[8, "float32", [6]]])]:
        varied = header if key is None else {**header, key: value}
        frames = [msgpack.packb(varied), good[1]]
        assert protocol._one_segment(varied, good[1]) is not None, (key, value)
        assert _said(frames, False) == _said(frames, True), (key, value)


def _decoded(frames: list) -> tuple:
    return _said([bytes(f) for f in frames], general=False)


def test_a_cached_header_encodes_what_the_whole_header_encodes():
    grads = torch.arange(40_000, dtype=torch.float32)  # 160 KB: a zmq.Frame each way
    for segments in (shared_frames(split(grads[:5000])), shared_frames(split(grads)),
                     split(grads[:10], frame_bytes=16)):
        cache = HeaderCache()
        for seq, (kind, worker, token, meta) in enumerate([
                (PUSH, "w", "tok", {Key.PULL: True}),
                (PUSH, "w", "tok", {Key.PULL: True, Key.LOSS: 0.25, Key.SAMPLES: 8}),
                (PUSH, "w", "other", {}),  # a rejoin's new session token
                (PARAMS, "", "", {Key.VERSION: 3, Key.ACK: {Key.APPLIED: True}}),
                (PUSH, "w2", "", {Key.PULL: True})]):
            msg = Message(type=kind, worker=worker, incarnation=5, seq=seq + 1, clock=seq * 7,
                          shard=2, meta=meta, segments=segments, token=token)
            whole = encode(msg)
            size = msg.nbytes
            fast = encode(msg, cache=cache)
            assert _decoded(fast) == _decoded(whole) and msg.nbytes == size
            assert cache.segments is segments
    transient = [Segment(0, grads[:8], transient=True)]
    cache = HeaderCache()
    msg = Message(type=PUSH, worker="w", seq=1, segments=transient)
    assert _decoded(encode(msg, cache=cache)) == _decoded(encode(msg))
    assert cache.segments is None  # a copy made for one message is never kept


def test_a_parts_cache_encodes_each_part_as_in_parts_encoded_whole_and_keeps_each_header():
    grads = torch.arange(40_000, dtype=torch.float32)
    big, small = shared_frames(split(grads, frame_bytes=64_000)), split(grads[:10], frame_bytes=16)
    cache = PartsCache()
    heads = {}  # the packed fixed fields of each part of ``big``: kept while its list is
    for seq, (segments, kind, meta) in enumerate([
            (big, PUSH, {Key.PULL: True}),  # 3 parts: a zmq.Frame each
            (big, PUSH, {Key.PULL: True, Key.LOSS: 0.5}),
            (small, PARAMS, {Key.VERSION: 4, Key.ACK: {Key.APPLIED: True}}),  # 3 other parts
            (small[:1], PARAMS, {Key.VERSION: 5}),  # one segment: the message itself
            (big, PUSH, {Key.PULL: True})]):
        msg = Message(type=kind, worker="w", incarnation=2, seq=seq + 1, clock=seq, shard=0,
                      meta=meta, segments=segments, token="tok")
        parts = cache.parts(msg)
        plain = in_parts(msg) if len(segments) > 1 else [msg]
        assert len(parts) == len(plain) == len(segments)
        for (part, header), whole in zip(parts, plain):
            assert _decoded(encode(part, cache=header)) == _decoded(encode(whole))
            assert header.segments is part.segments  # cached: the next send packs 3 fields
        if len(segments) > 1:  # the ack rides on part 0 only, as in_parts puts it
            assert [Key.ACK in p.meta for p, _ in parts] == [Key.ACK in meta, False, False]
        if seq == 1:  # the same list again: each part's header reused, not packed anew
            assert [h.head for _, h in parts] == heads[0]
            assert all(a is b for a, b in zip([h.head for _, h in parts], heads[0]))
        heads.setdefault(seq, [h.head for _, h in parts])
    assert len(cache.headers) == 3  # one per part, kept as the list changed
