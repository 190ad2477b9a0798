"""The floor under any parameter server on pyzmq here: raw round trips plus the work no
server can skip, waiting as asyncsgd waits.

    python experiments/ps_floor.py                 # 20 KB, 1 MB, 10 MB, 40 MiB; ~40 s
    python experiments/ps_floor.py --seconds 0.5

Raw pyzmq round trips (``raw_zmq.py``) move bytes and nothing else. Every
step, a parameter server must also do the following, and the floor does this
and nothing more:

- the worker puts a header on each message (msgpack: type, seq, part, parts)
  and the server reads it, and checks what it must before applying anything:
  the part's index is in range and its frame holds exactly that part's bytes
  (a malformed message must never be applied);
- the server reads the gradient once to refuse NaN and Inf (one sum), then
  applies it (SGD reads parameters and gradient and writes the parameters);
- the server answers with a header and the parameters, the worker reads the
  header, checks it answers this push (seq and part), and copies the
  parameters out of libzmq's buffers into its own (libzmq cannot receive
  into a caller's memory).

It waits as asyncsgd waits, so that no waiting policy of a server can beat
it: both its server and its worker poll the socket before each receive with
asyncsgd's own ``BusyPoll`` at asyncsgd's default budget
(``wire/busy_poll.py``: up to 400 µs while messages come that fast and are
no larger than 256 KiB), and its server keeps freed memory as a shard does
(``keep_freed_memory``) and runs the torch threads ps-server gives its one
shard (half the cores: 1 here, 8 on a 16-core host). It sends as asyncsgd
sends: the worker's gradient frames of 64 KiB or more go out as ``zmq.Frame``
objects made once (``shared_frames``), smaller ones copied, and the server's
reply frames uncopied from the parameters.

And it does it in the fastest order a correct server may: the gradient goes out
as one message per 4 MiB frame, the server checks each frame as it arrives, and
once the last has passed, either applies and answers each in turn (asyncsgd's
order) or swaps in a second buffer the parts were applied to as they came
(``--early-parts on``'s); a push of several frames is measured both ways and the
faster counts. The worker copies each answer as it comes. It keeps no
bookkeeping, no dedupe, no staleness, no liveness, so no correct server that
sends as it does can beat it: it bounds what any speed target can ask of
asyncsgd on a machine. ``ps_throughput.py`` runs it beside raw pyzmq and
asyncsgd in the same loop and checks it is never the slower (results:
experiments/README.md).

A third order is measured and reported apart, not counted as the floor: each
part applied and answered as it arrives, so both directions are on the wire
together. It is not all-or-nothing: a bad frame late in a push would leave the
earlier ones applied, and their new values sent. Every correct server holds its
answer until the whole push has passed (a push is "applied whole": tests/PROMISES.md,
asyncsgd/wire/PROTOCOL.md), so that order shows what giving up the promise would buy
(experiments/README.md, "Parameter-server round trips").
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

from asyncsgd.run.process_group import available_cores
from asyncsgd.wire.busy_poll import BUSY_POLL_US, BusyPoll
from asyncsgd.wire.memory import keep_freed_memory
from asyncsgd.wire.transport import COPY_BELOW
from raw_zmq import SIZES, WARMUP_ROUND_TRIPS, measure_raw, time_against_server

FRAME = 4 * 2 ** 20
LR = 1e-6
# Sent as asyncsgd sends (wire/transport.py): frame by frame through the Cython send with
# plain int flags, not send_multipart (~9 us more a message, experiments/README.md,
# "Frames and sends")
_SEND_FRAME = zmq.backend.Socket.send
_MORE = int(zmq.SNDMORE)


def _socket(ctx: zmq.Context, kind: int, timeout_ms: int) -> zmq.Socket:
    """A socket that never hangs on close and gives up on a silent peer."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    return sock


def _send(sock: zmq.Socket, parts: list) -> None:
    """``parts`` as one message, those of COPY_BELOW bytes or more uncopied."""
    last = len(parts) - 1
    for j, part in enumerate(parts):
        _SEND_FRAME(sock, part, _MORE if j < last else 0, len(part) < COPY_BELOW)


def _received(sock: zmq.Socket, busy: BusyPoll) -> list:
    """The next message's frames, uncopied, after polling for it as asyncsgd does (and read
    as it reads them: ``Frame.more`` rather than recv_multipart's RCVMORE option)."""
    idle = time.perf_counter()
    busy.wait(sock)
    frames = [sock.recv(0, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(0, copy=False))
    busy.waited(time.perf_counter() - idle, sum(len(f.buffer) for f in frames[1:]))
    return frames


ORDERS = ("on arrival", "checked, then applied", "staged")  # a push of several parts


def _serve(conn, nbytes: int, order: str = "checked, then applied") -> None:
    """The floor's server. ``order``, for a push of several parts: each part is checked as
    it arrives, then

    - ``on arrival``: applied and answered at once (not all-or-nothing: a later part that
      fails leaves the earlier ones applied and sent);
    - ``checked, then applied``: once the last has passed, each part is applied and its
      answer sent in turn (asyncsgd's order when parts are not applied early);
    - ``staged``: applied on arrival into a second buffer, which becomes the parameters
      once the last has passed, and then answered (asyncsgd's ``--early-parts on``)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r}: one of {ORDERS}")
    # the threads ps-server gives its one shard: the cores shared by it and the front
    # (servers/supervisor.py); with fewer, a 16-core host's shard sums and applies faster
    torch.set_num_threads(max(1, available_cores() // 2))
    keep_freed_memory()  # as a shard does
    ctx = zmq.Context()
    sock = _socket(ctx, zmq.ROUTER, 60_000)
    busy = BusyPoll(BUSY_POLL_US / 1e6)  # as a shard waits for its next message
    try:
        conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
        conn.close()
        step = FRAME // 4
        params, staged = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)

        def views_of(t):
            return [memoryview(t[i:i + step].numpy()).cast("B") for i in range(0, len(t), step)]

        views, staged_views = views_of(params), views_of(staged)
        checked = []  # (part, gradient, its frame: kept alive while the view is read)
        while True:
            peer, head, *frames = _received(sock, busy)
            header = msgpack.unpackb(head.buffer)
            if header["t"] == "bye":
                sock.send_multipart([peer, b""])
                return
            part = header["part"]
            if not 0 <= part < len(views) or len(frames) != 1 \
                    or len(frames[0].buffer) != len(views[part]):
                raise RuntimeError(f"malformed part {part}")
            grad = torch.frombuffer(frames[0].buffer, dtype=torch.float32)
            if not math.isfinite(float(grad.sum())):
                raise RuntimeError("non-finite gradient")
            lo = part * step
            if order == "staged" and header["parts"] > 1:
                torch.sub(params[lo:lo + len(grad)], grad, alpha=LR,
                          out=staged[lo:lo + len(grad)])
                checked.append((part, None, None))
            else:
                checked.append((part, grad, frames[0]))
            if order != "on arrival" and len(checked) < header["parts"]:
                continue
            if order == "staged" and header["parts"] > 1:  # every part passed: the swap
                params, staged, views, staged_views = staged, params, staged_views, views
            for part, grad, _ in checked:
                lo = part * step
                if grad is not None:
                    params[lo:lo + len(grad)].sub_(grad, alpha=LR)
                reply = msgpack.packb({"t": "params", "s": header["s"], "part": part,
                                       "version": header["s"]})
                _send(sock, [peer, reply, views[part]])
            checked = []
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
        views = [memoryview(self.grads[i:i + FRAME // 4].numpy()).cast("B")
                 for i in range(0, len(self.grads), FRAME // 4)]
        # as asyncsgd's shared_frames: a large frame is made once, then shared at each send
        self.frames = [zmq.Frame(v, copy=False) if len(v) >= COPY_BELOW else v for v in views]
        self.sizes = [len(v) for v in views]
        self.busy = BusyPoll(BUSY_POLL_US / 1e6)  # as asyncsgd's client waits for its reply
        self.seq = 0

    def round_trip(self) -> None:
        sock, frames = self.sock, self.frames
        self.seq += 1
        for part, frame in enumerate(frames):
            head = msgpack.packb({"t": "push", "s": self.seq, "part": part, "parts": len(frames)})
            _send(sock, [head, frame])
        for _ in frames:
            head, data = _received(sock, self.busy)
            header = msgpack.unpackb(head.buffer)
            part = header["part"]
            if header["s"] != self.seq or not 0 <= part < len(frames) \
                    or len(data.buffer) != self.sizes[part]:
                raise RuntimeError(f"a reply to another push, or malformed: {header}")
            lo = part * (FRAME // 4)
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
    """Median round trip of the minimal parameter server for ``nbytes`` of float32. A push
    of several parts is measured in each order (``ORDERS``), one after the other: the
    floor is the faster of the two all-or-nothing ones, which every correct server must
    be (``ms_per_round_trip``); ``on_arrival_ms``: what giving that up would buy."""
    orders = ORDERS if nbytes > FRAME else ORDERS[1:2]  # one part: all orders are one
    timed = {}
    for order in orders:
        durations = time_against_server(_serve, (nbytes, order), "ps-floor server",
                                        lambda port: _round_trips(port, nbytes, seconds))
        timed[order] = (statistics.median(durations), len(durations))
    correct = [o for o in orders if o != "on arrival"] or orders  # one part: one order
    best = min(correct, key=lambda o: timed[o][0])
    median, count = timed[best]
    return {"nbytes": nbytes, "ms_per_round_trip": median * 1e3, "round_trips": count,
            "gbps": 2 * nbytes / median / 1e9, "order": best,
            "orders_ms": {o: t * 1e3 for o, (t, _) in timed.items()},
            "on_arrival_ms": timed.get("on arrival", timed[best])[0] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    for label, nbytes in SIZES:
        raw = measure_raw(nbytes, FRAME, args.seconds)["ms_per_round_trip"]
        floor = measure_floor(nbytes, args.seconds)
        ms = floor["ms_per_round_trip"]
        orders = "   ".join(f"{o} {t:.3f} ms" for o, t in floor["orders_ms"].items())
        print(f"{label:>6}: raw pyzmq (4 MiB frames) {raw:8.3f} ms   floor {ms:8.3f} ms   "
              f"floor - raw {1000 * (ms - raw):8.0f} µs   ({orders})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
