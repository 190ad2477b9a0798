"""Compressed pushes and pulls (PROTOCOL.md, Compressed pushes): error feedback sends every
gradient in the end; packed segments expand exactly as specified; a live shard applies
cast and packed pushes as their expanded values and refuses lying ones, changing nothing;
workers that compress train to the target; bad combinations are one clear line.

The shard's oracle is test_exactly_once's: SGD with lr 1 from zeros, so the parameters
are minus the sum of the expanded pushes acknowledged as applied.
"""

import random
import re
import struct
from collections import Counter

import msgpack
import pytest
import torch
import zmq

from asyncsgd.wire import transport
from asyncsgd.wire.compression import (INT8_CHUNK, Compressor, expand, expand_packed,
                                       pack_int8, pack_topk)
from asyncsgd.wire.protocol import (ERROR, FRAME_BYTES, PARAMS, PULL, PUSH, VERSION, Key,
                                    Message, Packed, ProtocolError, Segment, decode, encode,
                                    in_parts)
from conftest import finish, one_line_error, read_json, shard_stats, worker
from faults import observe
from test_exactly_once import SIZE, TASK, Peer, applied, grad

# Error feedback in float32: each push rounds ``residual += g`` and ``residual -= sent``
# once per value, so after T pushes the identity sum(sent) + residual = sum(g) holds to
# float32 roundings of the running residual, not exactly: the largest gap measured here
# over 50 pushes was 2.7e-10 of the slice's sum(|g|) over all pushes (top-k 0.01 on the
# 259-value slice; int8 8e-11). Asserted: 1e-8.
EF_TOLERANCE = 1e-8


@pytest.mark.parametrize("kind,ratio", [("int8", 0.0), ("topk", 0.01), ("topk", 0.3),
                                        ("topk", 0.5)])
def test_error_feedback_sends_every_gradient_in_the_end(kind, ratio):
    """Over 50 pushes to three shards (slices of sizes that cut int8 chunks oddly, one of
    two frames), what the shards expand plus the residual equals the gradients' sum."""
    rng = torch.Generator().manual_seed(7)
    sizes = [1000, INT8_CHUNK + 3, FRAME_BYTES // 4 + 777]
    comp = Compressor(kind, ratio)
    total = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    sent = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    magnitude = [torch.zeros(n, dtype=torch.float64) for n in sizes]
    for _ in range(50):
        for shard, n in enumerate(sizes):
            g = torch.randn(n, generator=rng) * torch.rand(n, generator=rng) ** 4
            total[shard] += g.double()
            magnitude[shard] += g.double().abs()
            for seg in comp.segments(shard, g):
                assert isinstance(seg.data, Packed) and seg.data.format == kind
                part = expand_packed(seg.data).double()
                sent[shard][seg.offset:seg.offset + len(part)] += part
    for shard in range(len(sizes)):
        gap = (sent[shard] + comp.residuals[shard].double() - total[shard]).abs()
        assert float(gap.max()) <= EF_TOLERANCE * float(magnitude[shard].sum()), \
            (shard, float(gap.max()), float(magnitude[shard].sum()))
        assert float(comp.residuals[shard].abs().sum()) > 0  # a lossy push leaves some owed
    assert comp.residual().shape == (sum(sizes),)


def test_packed_formats_expand_exactly_as_specified():
    """int8: round(x / scale) * scale with scale = max|x| / 127 per chunk, a zero chunk
    zeros; top-k: the largest magnitudes at their places, zeros elsewhere; the bytes
    PROTOCOL.md gives."""
    x = torch.tensor([127.0, -63.5, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.54, -1.27, 0.0])
    packed = pack_int8(x, 4)
    assert packed.nbytes == 4 * 3 + 11
    scales = [1.0, 0.0, 2.54 / 127]
    want = torch.tensor([127, -64, 1, 0, 0, 0, 0, 0, 127, -64, 0], dtype=torch.float32) \
        * torch.tensor(scales).repeat_interleave(4)[:11]
    assert torch.equal(expand_packed(packed), want)
    y = torch.tensor([0.1, -5.0, 0.2, 4.0, -0.3, 3.0])
    top = pack_topk(y, 0.5)
    assert top.param == 3 and top.nbytes == 24
    assert torch.equal(expand_packed(top), torch.tensor([0, -5.0, 0, 4.0, 0, 3.0]))
    assert pack_topk(y, 1e-9).param == 1  # at least one value
    assert torch.equal(expand_packed(pack_topk(y, 1.0)), y)  # all of them: exact
    wide = torch.randn(1 << 20)
    assert pack_int8(wide).nbytes / (wide.numel() * 4) < 0.26
    assert pack_topk(wide, 0.01).nbytes / (wide.numel() * 4) < 0.021


def test_packed_segments_survive_the_wire_and_bound_their_size():
    """encode/decode keep a packed segment's bytes; expand refuses a run past the slice
    before allocating it (2^39 values in an 8-byte frame)."""
    packed = pack_topk(torch.arange(10.0), 0.2)
    frames = [bytes(f) for f in encode(Message(type=PUSH, segments=[Segment(3, packed)]))]
    msg = decode(frames)
    assert torch.equal(expand(msg.segments[0], 13).data, expand_packed(packed))
    with pytest.raises(ProtocolError, match="out-of-range"):
        expand(msg.segments[0], 12)
    huge = [msgpack.packb({"v": VERSION, "t": PUSH, "d": [[0, "topk", [2 ** 39], 1]]}),
            struct.pack("<if", 5, 1.0)]
    with pytest.raises(ProtocolError, match="out-of-range"):
        expand(decode(huge).segments[0], SIZE)


def test_a_shard_applies_cast_and_packed_pushes_and_refuses_lying_ones(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port, worker="zip")
    expected = torch.zeros(SIZE)
    pushes = [pack_int8(grad(100, -3, 0.25, 7, 0, 1), 4),
              pack_topk(grad(0, 0, 9, -7, 0.5, 0, 1), 3 / SIZE),
              grad(1.5, -2.25, 3).to(torch.bfloat16),
              grad(0.1, 0.2).to(torch.float16)]
    for seq, data in enumerate(pushes, start=1):
        assert applied(peer.push(seq, data))
        expected -= expand(Segment(0, data), SIZE).data
    assert torch.equal(observe(srv, port, SIZE), expected)
    stats = shard_stats(srv, port)
    assert stats["workers"]["zip"]["push_format"] == "float16", stats["workers"]
    # pulls in bf16: the parameters cast, at the current version
    peer.send(PULL, 10, meta={Key.PULL_DTYPE: "bfloat16"})
    reply = peer.reply()
    assert reply.type == PARAMS and reply.segments[0].data.dtype == torch.bfloat16
    assert torch.equal(reply.segments[0].data, expected.to(torch.bfloat16))
    # lying messages: each refused with its code, nothing applied, the shard serving on
    token = peer.token(1)
    header = {"v": VERSION, "t": PUSH, "w": "zip", "i": 1, "c": 0, "sh": 0, "m": {},
              "k": token}
    nan_scale = bytearray(pack_int8(grad(1, 2), 16).payload.numpy().tobytes())
    struct.pack_into("<f", nan_scale, 0, float("nan"))
    backwards = bytearray(pack_topk(grad(5, 6), 2 / SIZE).payload.numpy().tobytes())
    backwards[0:8] = struct.pack("<ii", 1, 0)
    lies = {
        "non-finite": ([[0, "int8", [SIZE], 16]], bytes(nan_scale)),
        "bad-descriptor": ([[0, "topk", [SIZE], 2]], bytes(backwards)),
        "out-of-range": ([[0, "topk", [2 ** 39], 1]], struct.pack("<if", 0, 1.0)),
        "length-mismatch": ([[0, "int8", [SIZE], 4]], b"\x00" * (4 * 4 + SIZE - 1)),
        "bad-dtype": ([[0, "int4", [SIZE], 4]], b"\x00" * 8),
    }
    for seq, (code, (desc, frame)) in enumerate(lies.items(), start=20):
        reply = srv.request([msgpack.packb({**header, "s": seq, "d": desc}), frame], port=port)
        assert reply.type == ERROR and reply.meta[Key.CODE] == code, (code, reply)
    nan16 = grad(1).to(torch.bfloat16)
    nan16[3] = float("nan")
    reply = peer.push(30, nan16)
    assert reply.type == ERROR and reply.meta[Key.CODE] == "non-finite", reply
    peer.send(PULL, 31, meta={Key.PULL_DTYPE: "int8"})
    reply = peer.reply()
    assert reply.type == ERROR and reply.meta[Key.CODE] == "bad-dtype", reply
    assert torch.equal(observe(srv, port, SIZE), expected)
    assert applied(peer.push(40, grad(1)))
    assert shard_stats(srv, port)["updates"] == len(pushes) + 1
    peer.close()


def test_the_widest_packed_pushes_the_spec_allows_are_answered(server):
    """Top-k with k = n (8 bytes a value) and int8 with one scale a value (5): main's frame
    limit, 128 KiB + 4 bytes a value, dropped both without a reply."""
    n = 1 << 18  # a 1 MiB float32 slice: frames of 2 MiB and 1.25 MiB
    srv = server("--task", TASK, "--samples", n, "--shards", 1, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port, worker="wide")
    values = torch.arange(1, n + 1, dtype=torch.float32) / 1024
    topk, int8 = pack_topk(values, 1.0), pack_int8(values.flip(0), 1)
    assert (topk.param, topk.nbytes, int8.nbytes) == (n, 8 * n, 5 * n)
    assert applied(peer.push(1, topk)) and applied(peer.push(2, int8))
    expected = -expand_packed(topk) - expand_packed(int8)
    assert torch.equal(observe(srv, port, n), expected)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--compress", "int8", "--pull-dtype", "bf16"),
                                   ("--compress", "topk:0.05"),
                                   ("--push-dtype", "fp16", "--pull-dtype", "fp16")],
                         ids=["int8+bf16", "topk", "fp16"])
def test_compressing_workers_train_to_the_target(server, cli_env, flags):
    """Two workers over TCP on mnist1d-cnn (each reached 85% in 7-13 s here)."""
    srv = server("--task", "mnist1d-cnn", "--workers", 2, "--target", 0.85,
                 "--max-seconds", 240)
    results = finish([worker(cli_env, srv.address, rank, 2, "--task", "mnist1d-cnn",
                             "--epochs", 1000, *flags) for rank in range(2)], timeout=300)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    srv.wait()
    summary = read_json(srv.out / "summary.json")
    assert summary["stopped_by"] == "target" and summary["best_metric"] >= 0.85, summary


def test_bad_compression_settings_are_one_clear_line(run_cli_here):
    one_line_error(run_cli_here("worker", "--compress", "topk:0.6"),
                   "--compress 'topk:0.6'", "0 < RATIO <= 0.5")
    one_line_error(run_cli_here("worker", "--compress", "int8", "--push-dtype", "bf16",
                                "--server", "tcp://127.0.0.1:9"),
                   "--compress int8 and --push-dtype bf16")
    one_line_error(run_cli_here("worker", "--pull-dtype", "bf16", "--transport", "shared",
                                "--server", "tcp://127.0.0.1:9"),
                   "--transport shared moves float32")


def test_random_compressed_pushes_keep_the_exact_oracle(server):
    """Pushes in every format, in random order, each format's Compressor kept across its
    pushes as a worker keeps it: the shard's parameters are minus the sum of what it
    expanded, exactly; and with the residuals, minus the gradients' sum (error feedback
    across the wire, to float32 rounding)."""
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port, worker="mix")
    rng = random.Random(5)
    compressors = {"int8": Compressor("int8"), "topk": Compressor("topk", 0.25),
                   "bf16": Compressor(push_dtype="bf16"), "fp16": Compressor(push_dtype="fp16")}
    expected, total = torch.zeros(SIZE), torch.zeros(SIZE, dtype=torch.float64)
    rounded = torch.zeros(SIZE, dtype=torch.float64)  # what casting (no feedback) lost
    for seq in range(1, 61):
        kind = rng.choice(sorted(compressors))
        g = torch.tensor([rng.uniform(-2, 2) for _ in range(SIZE)])
        total += g.double()
        [seg] = compressors[kind].segments(0, g)
        if kind in ("bf16", "fp16"):
            rounded += g.double() - seg.data.double()
        assert applied(peer.push(seq, seg.data))
        expected -= expand(seg, SIZE).data
    params = observe(srv, port, SIZE)
    assert torch.equal(params, expected)
    owed = sum(c.residuals[0].double() for c in compressors.values() if c.residuals)
    # sent + owed + rounded = every gradient, to float32 rounding of the sums (|sum| < 120)
    gap = (-params.double() + owed + rounded - total).abs().max()
    assert float(gap) < 1e-4, float(gap)
    peer.close()


def test_packed_pushes_cannot_make_a_shard_allocate_more_than_its_slice(server):
    """Top-k segments of 8 bytes each claiming the whole slice: overlapping ones in one
    push, or parts of one push that together claim more than the slice, are refused
    before anything is expanded; a PARAMS reply or a pull cannot carry packed segments,
    and an observer's pull_dtype is checked like a worker's."""
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port, worker="amp")
    whole = pack_topk(grad(5), 1 / SIZE)  # [SIZE] values in one index and one value
    peer.sock.send_multipart(encode(Message(type=PUSH, worker="amp", incarnation=1, seq=1,
                                            shard=0, segments=[Segment(0, whole)] * 2,
                                            token=peer.token(1))))
    reply = peer.reply()
    assert reply.type == ERROR and reply.meta[Key.CODE] == "bad-descriptor", reply
    assert "overlap" in reply.meta[Key.ERROR]
    parts = in_parts(Message(type=PUSH, worker="amp", incarnation=1, seq=2, shard=0,
                             segments=[Segment(0, whole)] * 3, token=peer.token(1)))
    for part in parts:
        peer.sock.send_multipart(encode(part))
    reply = peer.reply()
    assert reply.type == ERROR and reply.meta[Key.CODE] == "out-of-range", reply
    assert "hold more than the shard's" in reply.meta[Key.ERROR]
    assert peer.reply(timeout=1.0) is None  # one error for the push, the rest dropped
    with pytest.raises(ProtocolError, match="packed segments travel in pushes only"):
        decode([bytes(f) for f in encode(Message(type=PARAMS, segments=[Segment(0, whole)]))])
    reply = srv.request(encode(Message(type=PULL, seq=3, meta={Key.OBSERVER: True,
                                                               Key.PULL_DTYPE: "float64"})),
                        port=port)
    assert reply.type == ERROR and reply.meta[Key.CODE] == "bad-dtype", reply
    assert torch.equal(observe(srv, port, SIZE), torch.zeros(SIZE))
    assert applied(peer.push(4, grad(1)))  # and it serves on
    assert shard_stats(srv, port)["updates"] == 1
    peer.close()


@pytest.mark.parametrize("flags", [(), ("--compress", "int8")], ids=["float32", "int8"])
def test_traffic_is_counted_per_worker_and_in_the_summary(server, run_cli_here, monkeypatch,
                                                          flags):
    """A worker counts every frame it sends and receives: what it says it sent is exactly
    what its sockets took, frame by frame (pushes, pulls, heartbeats, hello and byes
    alike); K pushes of P float32 values send 4PK bytes of values (int8: P + 4 ceil(P /
    256) each) and receive the parameters K + 1 times, plus headers, hello and
    heartbeats; the server's summary has what it reported with its pushes, and
    ``bytes`` is that traffic."""
    values = 4096
    srv = server("--task", TASK, "--samples", values, "--workers", 1)
    taken = {"bytes": 0, "kinds": Counter(), "within": set()}
    send_frame = transport._send_frame

    def counted(sock, part, flags, copy):  # the worker runs here: every frame it sends
        send_frame(sock, part, flags, copy)
        taken["bytes"] += memoryview(part).nbytes
        if sock not in taken["within"]:  # a message's first frame: its header
            taken["kinds"][msgpack.unpackb(bytes(part))["t"]] += 1
        (set.add if flags & zmq.SNDMORE else set.discard)(taken["within"], sock)
    monkeypatch.setattr(transport, "_send_frame", counted)
    result = run_cli_here("worker", "--server", srv.address, "--rank", 0, "--world", 1,
                          "--threads", 1, "--progress", "off", "--task", TASK,
                          "--samples", values, "--epochs", 1, "--transport", "tcp",
                          "--heartbeat", 0.05, *flags)
    monkeypatch.undo()
    assert result.returncode == 0, result.stderr[-3000:]
    pushes = int(re.search(r"(\d+) pushes", result.stdout).group(1))
    sent, received = (int(v.replace(",", "")) for v in re.search(
        r"([\d,]+) bytes sent, ([\d,]+) received", result.stdout).groups())
    # every kind a worker sends was sent, and each byte of each is in its count
    assert set(taken["kinds"]) == {"hello", "pull", "push", "heartbeat", "bye"}, taken
    assert sent == taken["bytes"], (sent, taken)
    per_push = values * 4 if not flags else values + 4 * -(-values // 256)
    overhead = 400 * (pushes + 50)  # headers (~100-200 bytes), hello, heartbeats, bye
    assert pushes * per_push <= sent <= pushes * per_push + overhead, (pushes, sent)
    assert (pushes + 1) * values * 4 <= received <= (pushes + 1) * values * 4 + overhead
    srv.wait()
    summary = read_json(srv.out / "summary.json")
    [reported] = summary["worker_bytes"].values()
    # reported with each push: what was sent before it (the last push and bye are not)
    assert sent - per_push - overhead <= reported["sent"] <= sent, (reported, sent)
    assert received - 2 * values * 4 - overhead <= reported["received"] <= received
    assert summary["bytes"] == reported["sent"] + reported["received"]
