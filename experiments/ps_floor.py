"""The floor under any parameter server on pyzmq here: raw round trips plus the work no
server can skip.

    python experiments/ps_floor.py                 # 20 KB, 1 MB, 10 MB, 40 MiB; ~30 s
    python experiments/ps_floor.py --seconds 0.5

Raw pyzmq round trips (``raw_zmq.py``) move bytes and nothing else. A
parameter server must also, every step: read the gradient once to refuse NaN
and Inf, apply it (SGD reads parameters and gradient and writes the
parameters), put a header on each message and read the one on each reply,
and on the worker copy the returned parameters out of libzmq's buffers into
its own (libzmq cannot receive into a caller's memory). This benchmark does
exactly that and nothing more, in the fastest order there is: the gradient
goes out as one message per 4 MiB frame, the server checks, applies and
answers each frame as it arrives (so both directions are on the wire at
once), and the worker copies each answer as it comes. It keeps no
bookkeeping, no dedupe, no staleness, no liveness, and it is not
all-or-nothing (a bad frame late in a push would leave the earlier ones
applied), so no correct server that sends as it does can beat it: it bounds
what any speed target can ask of asyncsgd on a machine. It sends with
pyzmq's ``copy=False``, a new Frame for every uncopied frame; asyncsgd's
workers send their gradients as Frames made once (``shared_frames`` in
``asyncsgd/wire/transport.py``), which saves pyzmq's bookkeeping and a
wake-up of its garbage-collector thread per frame. ``ps_throughput.py`` runs it
beside raw pyzmq and asyncsgd in the same loop (results: experiments/README.md).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import msgpack
import torch
import zmq

from raw_zmq import SIZES, WARMUP_ROUND_TRIPS, measure_raw, time_against_server

FRAME = 4 * 2 ** 20
LR = 1e-6


def _socket(ctx: zmq.Context, kind: int, timeout_ms: int) -> zmq.Socket:
    """A socket that never hangs on close and gives up on a silent peer."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    return sock


def _serve(conn, nbytes: int) -> None:
    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = _socket(ctx, zmq.ROUTER, 60_000)
    try:
        conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
        conn.close()
        params = torch.zeros(nbytes // 4)
        views = [memoryview(params[i:i + FRAME // 4].numpy()).cast("B")
                 for i in range(0, len(params), FRAME // 4)]
        while True:
            peer, head, *frames = sock.recv_multipart(copy=False)
            header = msgpack.unpackb(head.buffer)
            if header["t"] == "bye":
                sock.send_multipart([peer, b""])
                return
            part = header["part"]
            grad = torch.frombuffer(frames[0].buffer, dtype=torch.float32)
            if not math.isfinite(float(grad.sum())):
                raise RuntimeError("non-finite gradient")
            lo = part * (FRAME // 4)
            params[lo:lo + len(grad)].sub_(grad, alpha=LR)
            reply = msgpack.packb({"t": "params", "s": header["s"], "part": part,
                                   "version": header["s"]})
            sock.send_multipart([peer, reply, views[part]], copy=len(views[part]) < 65536)
    finally:
        sock.close()
        ctx.term()


class FloorClient:
    """The floor's worker: ``round_trip()`` pushes the gradient and copies the parameters
    back, frame by frame; ``close()`` says bye (the server then exits) and closes."""

    def __init__(self, port: int, nbytes: int):
        torch.set_num_threads(1)
        self.ctx = zmq.Context()
        self.sock = _socket(self.ctx, zmq.DEALER, 10_000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.grads = torch.full((nbytes // 4,), 1e-3)
        self.params = torch.zeros(nbytes // 4)
        self.frames = [memoryview(self.grads[i:i + FRAME // 4].numpy()).cast("B")
                       for i in range(0, len(self.grads), FRAME // 4)]
        self.seq = 0

    def round_trip(self) -> None:
        sock, frames = self.sock, self.frames
        self.seq += 1
        for part, frame in enumerate(frames):
            head = msgpack.packb({"t": "push", "s": self.seq, "part": part, "parts": len(frames)})
            sock.send_multipart([head, frame], copy=len(frame) < 65536)
        for _ in frames:
            head, data = sock.recv_multipart(copy=False)
            header = msgpack.unpackb(head.buffer)
            lo = header["part"] * (FRAME // 4)
            got = torch.frombuffer(data.buffer, dtype=torch.float32)
            self.params[lo:lo + len(got)].copy_(got)

    def close(self, bye: bool = True) -> None:
        try:
            if bye:
                self.sock.send(msgpack.packb({"t": "bye"}))
                self.sock.recv()
        finally:
            self.sock.close()
            self.ctx.term()


def _round_trips(port: int, nbytes: int, seconds: float) -> list:
    client = FloorClient(port, nbytes)
    done = False
    try:
        for _ in range(WARMUP_ROUND_TRIPS):
            client.round_trip()
        durations = []
        end = time.perf_counter() + seconds
        while len(durations) < 5 or time.perf_counter() < end:
            start = time.perf_counter()
            client.round_trip()
            durations.append(time.perf_counter() - start)
        done = True
        return durations
    finally:
        client.close(bye=done)


def measure_floor(nbytes: int, seconds: float = 2.0) -> dict:
    """Median round trip of the minimal parameter server for ``nbytes`` of float32."""
    durations = time_against_server(_serve, (nbytes,), "ps-floor server",
                                    lambda port: _round_trips(port, nbytes, seconds))
    median = statistics.median(durations)
    return {"nbytes": nbytes, "ms_per_round_trip": median * 1e3, "round_trips": len(durations),
            "gbps": 2 * nbytes / median / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    for label, nbytes in SIZES:
        raw = measure_raw(nbytes, FRAME, args.seconds)["ms_per_round_trip"]
        floor = measure_floor(nbytes, args.seconds)["ms_per_round_trip"]
        print(f"{label:>6}: raw pyzmq (4 MiB frames) {raw:8.3f} ms   floor {floor:8.3f} ms   "
              f"floor - raw {1000 * (floor - raw):8.0f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
