"""Fuzzing the protocol: the decoder and a shard in-process (hypothesis), then a soak of
thousands of malformed messages over CURVE from an authenticated peer against a real server.

Oracle everywhere: SGD with lr 1 from known parameters, so the final parameters
must equal the initial ones minus the sum of exactly the pushes that were
acknowledged as applied.
"""

import random
import time

import msgpack
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncsgd.wire.compression import expand
from asyncsgd.wire.protocol import (ACK, DTYPES, ERROR, MAX_HEADER_BYTES, STATS, TYPES, Message,
                                    Packed, ProtocolError, decode, encode)
from conftest import CurveServer
from faults import observe, record_figure
from malformed import WORKERS, malformed, valid_push
from asyncsgd.servers.shard import ShardConfig, ShardState

SIZE = 96


def _check_valid(msg: Message, frames: list) -> None:
    """What a decoded message guarantees to the code that handles it."""
    assert msg.type in TYPES and isinstance(msg.worker, str) and len(msg.worker) <= 256
    for value in (msg.incarnation, msg.seq, msg.clock):
        assert type(value) is int and 0 <= value < 2 ** 63
    assert type(msg.shard) is int and -1 <= msg.shard <= 1 << 20
    assert isinstance(msg.meta, dict) and len(msg.segments) == len(frames) - 1
    for seg, frame in zip(msg.segments, frames[1:]):
        assert 0 <= seg.offset < 2 ** 62
        if isinstance(seg.data, Packed):  # its layout checked; values once the slice is known
            assert seg.data.format in ("int8", "topk") and 0 < seg.data.numel < 2 ** 40
            assert seg.data.nbytes == len(frame)
            continue
        assert seg.data.dtype in DTYPES.values()
        assert seg.data.numel() * seg.data.element_size() == len(frame)


def _decode_or_refuse(frames: list):
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        assert exc.code and str(exc)
        return None
    _check_valid(msg, frames)
    return msg


# Seeds, not st.randoms(): a push draws ~100 numbers, which hypothesis makes ~100x slower.
seeds = st.integers(0, 2 ** 32 - 1).map(random.Random)


@settings(max_examples=3000, deadline=None)
@given(seeds)
def test_targeted_mutations_decode_or_raise_protocol_errors(rng):
    _decode_or_refuse(malformed(rng, SIZE, seq=rng.randrange(1, 100)))


_leaves = (st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64 - 1) | st.floats() |
           st.text(max_size=20) | st.binary(max_size=20) |
           st.sampled_from(sorted(TYPES) + sorted(DTYPES)))
_values = st.recursive(_leaves, lambda kids: st.lists(kids, max_size=4) |
                       st.dictionaries(st.text(max_size=4), kids, max_size=4), max_leaves=30)
_headers = st.dictionaries(st.sampled_from(["v", "t", "w", "i", "s", "c", "sh", "m", "d", "x"]),
                           _values, max_size=9).map(lambda h: {**h, "v": h.get("v", 1)})


@settings(max_examples=1500, deadline=None)
@given(_headers, st.lists(st.binary(max_size=64), max_size=3))
def test_arbitrary_msgpack_headers_decode_or_raise_protocol_errors(header, tensors):
    _decode_or_refuse([msgpack.packb(header, use_bin_type=True), *tensors])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
def test_random_bytes_decode_or_raise_protocol_errors(frames):
    _decode_or_refuse(frames)


def test_bombs_are_refused_quickly():
    for head in [b"\x91" * 1_000_000 + b"\x00", b"\xdd\xff\xff\xff\xff" * 1000,
                 b"\x81\xa1m" + b"\xdb" + (MAX_HEADER_BYTES * 4).to_bytes(4, "big")]:
        started = time.monotonic()
        assert _decode_or_refuse([head]) is None
        assert time.monotonic() - started < 1.0


def _apply(expected: torch.Tensor, frames: list) -> None:
    """What an applied push did under SGD lr 1: its values as the shard expanded them."""
    for seg in decode(frames).segments:
        seg = expand(seg, len(expected))
        expected[seg.offset:seg.offset + len(seg.data)] -= seg.data


@settings(max_examples=300, deadline=None)
@given(seeds)
def test_shard_applies_exactly_the_acknowledged_pushes(rng):
    """Malformed, valid and replayed pushes into a shard: params = initial - sum(applied)."""
    state = ShardState(ShardConfig(index=0, start=0, end=SIZE, lr=1.0), torch.zeros(SIZE))
    expected = torch.zeros(SIZE)
    sent = []
    for seq in range(1, 40):
        choice = rng.random()
        if choice < 0.3:
            frames, _ = valid_push(rng, SIZE, seq)
            sent.append(frames)
        elif choice < 0.4 and sent:
            frames = rng.choice(sent)  # a replay: acknowledged, never applied twice
        else:
            frames = malformed(rng, SIZE, seq)
        msg = _decode_or_refuse(frames)
        if msg is None:
            continue
        for _, reply in state.handle(b"peer", msg, 0.0):
            assert reply.type != ERROR or reply.meta["code"] != "unexpected"
            if reply.type == ACK and reply.meta.get("applied"):
                _apply(expected, frames)
    assert torch.equal(state.params, expected)


def test_soak_of_malformed_messages_over_curve_keeps_the_exact_oracle(keys, cli_env, tmp_path):
    """Thousands of malformed messages from an authenticated peer, mixed with valid pushes."""
    messages, rng = 10_000, random.Random(20261122)
    srv = CurveServer(cli_env, tmp_path / "run", keys[0], "--task",
                      "tasks_for_tests:index_counter", "--samples", SIZE, "--no-exit-when-done")
    try:
        port = srv.stats()["shard_ports"][0]
        sock = srv.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        srv.curve.apply(sock)
        sock.connect(f"tcp://127.0.0.1:{port}")
        tokens = {w: srv.admit(w) for w in WORKERS}
        expected, sent, counts = torch.zeros(SIZE), [], {"applied": 0, "error": 0, "other": 0}
        started = time.monotonic()
        for seq in range(1, messages + 1):
            if seq % 10 == 0:
                frames, _ = valid_push(rng, SIZE, seq, tokens=tokens)
                sent.append(frames)
            elif seq % 25 == 0:
                frames = rng.choice(sent)
            else:
                frames = malformed(rng, SIZE, seq, tokens=tokens)
            sock.send_multipart(frames)
            assert sock.poll(10_000), f"no answer to message {seq}: the shard stalled"
            reply = decode(sock.recv_multipart())
            if reply.type == ACK and reply.meta.get("applied"):
                _apply(expected, frames)
                counts["applied"] += 1
            else:
                counts["error" if reply.type == ERROR else "other"] += 1
        seconds = time.monotonic() - started
        sock.close()
        assert srv.proc.poll() is None
        assert torch.equal(observe(srv, port, SIZE), expected)
        assert counts["applied"] >= messages // 10 and counts["error"] > messages // 2, counts
        shard = srv.request(encode(Message(type=STATS, seq=1)), port=port).meta
        assert shard["updates"] == counts["applied"]
    finally:
        srv.close()
    record_figure("decoder soak over CURVE", messages=messages, malformed=messages - len(sent),
                  applied=counts["applied"], refused=counts["error"], crashes=0,
                  messages_per_second=round(messages / seconds), oracle="exact")
