"""Raw pyzmq push+pull round trips over TCP on 127.0.0.1: the baseline for the parameter server.

    python experiments/raw_zmq.py                  # 4 sizes x 2 layouts x 2 receive modes, ~40 s
    python experiments/raw_zmq.py --seconds 0.5    # quicker, noisier

One round trip is what a parameter-server worker does per step: the client
(a DEALER in this process) sends N bytes to the server (the "push" of a
gradient) and waits for N bytes back (the "pull" of the parameters).  The
server is a ROUTER in a separate spawned process that answers every message
with its own pre-allocated N-byte buffer, so the figures include both
directions of TCP loopback traffic, libzmq's I/O threads and the Python
calls on both sides, and nothing else: no serialisation and no arithmetic.

Both sides send zero-copy (copy=False) from buffers allocated and touched once
before timing, so the only per-message allocations left are libzmq's own
receive buffers.  Each configuration is measured in a fresh server process,
after a few untimed warm-up round trips, for ``--seconds`` (at least
5 timed trips); the table shows the median round trip and the throughput it
implies, counting push and pull bytes (GB = 1e9 bytes).

Layouts: "one frame" sends the payload as a single frame; "4 MiB frames"
splits it into a multipart message of frames of at most 4 MiB.  Frames over
32 MiB are slow to receive because glibc serves each such fresh buffer with
a new mmap, which then page-faults; smaller frames are recycled by malloc.

Receive modes: "frames" is ``recv_multipart(copy=False)`` (libzmq's buffer
is handed to Python as a Frame); "recv_into" (pyzmq >= 26.4) copies each
frame into a slice of a pre-allocated buffer, as a parameter server that
keeps its parameters in one flat array would.  The server receives the same
way as the client, so a row's mode applies to both push and pull.  recv_into
is libzmq's zmq_recv, which still receives into a message buffer of libzmq's
own and then copies it out: it adds one copy per frame and does not avoid the
cost of frames over 32 MiB.

``measure_raw`` is importable by other benchmarks (with ``experiments/`` on
``sys.path``) to put this baseline next to their own figures.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Sequence

import numpy as np
import zmq

RECV_INTO_AVAILABLE = hasattr(zmq.Socket, "recv_into")
MODES = ("frames", "recv_into") if RECV_INTO_AVAILABLE else ("frames",)

WARMUP_ROUND_TRIPS = 5
MIN_TIMED_ROUND_TRIPS = 5
# Long enough for a 40 MiB round trip on a busy machine, short enough that a
# dead server fails the benchmark quickly instead of hanging it.
CLIENT_TIMEOUT_MS = 10_000
# The server gives up after this long without a message, so that a client
# killed without saying goodbye cannot leave it running for ever.
SERVER_IDLE_TIMEOUT_MS = 60_000
SERVER_START_TIMEOUT_S = 60.0
SERVER_EXIT_TIMEOUT_S = 10.0
# Different fill bytes on each side, so the final check can tell a genuine
# reply from the client's own push echoed back.
CLIENT_FILL = 0x11
SERVER_FILL = 0x22


def frame_views(buffer: np.ndarray, frame_bytes: int | None) -> list[memoryview]:
    """Split ``buffer`` into consecutive views of at most ``frame_bytes`` bytes (one view if
    None)."""
    view = memoryview(buffer).cast("B")
    if frame_bytes is None:
        return [view]
    return [view[start:start + frame_bytes] for start in range(0, len(view), frame_bytes)]


def preallocated_buffer(nbytes: int, fill: int) -> np.ndarray:
    """A buffer whose pages are all written now, so no page fault lands in a timed round trip."""
    return np.full(nbytes, fill, dtype=np.uint8)


def receive_into(sock: zmq.Socket, view: memoryview) -> int:
    """Receive one multipart message into ``view``, each frame right after the previous one.

    Returns the total number of bytes received.  recv_into copies at most the
    length of the view it is given and returns the full frame size, so a frame
    that did not fit shows up as a returned size larger than the space left.
    """
    received = 0
    while True:
        frame_size = sock.recv_into(view[received:])
        if received + frame_size > len(view):
            raise RuntimeError(f"frame of {frame_size} bytes truncated: only "
                               f"{len(view) - received} bytes of buffer left")
        received += frame_size
        if not sock.getsockopt(zmq.RCVMORE):
            return received


def serve_round_trips(conn, nbytes: int, frame_bytes: int | None, mode: str) -> None:
    """Server process: answer each N-byte message with N bytes until an empty message arrives.

    Reports its port through ``conn``.  An empty message is the client's
    goodbye; it is acknowledged with an empty frame so that the client
    knows the server has finished before it closes its socket.
    """
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, SERVER_IDLE_TIMEOUT_MS)
    try:
        conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
        conn.close()
        reply_views = frame_views(preallocated_buffer(nbytes, SERVER_FILL), frame_bytes)
        pull_view = memoryview(preallocated_buffer(nbytes, 0)) if mode == "recv_into" else None
        while True:
            if mode == "recv_into":
                identity = sock.recv()
                received = receive_into(sock, pull_view)
            else:
                identity, *payload = sock.recv_multipart(copy=False)
                received = sum(len(frame) for frame in payload)
                del payload  # release libzmq's receive buffers before the next message
            if received == 0:
                sock.send_multipart([identity, b""])
                return
            if received != nbytes:
                raise RuntimeError(f"server expected {nbytes} bytes, received {received}")
            sock.send_multipart([identity, *reply_views], copy=False)
    finally:
        sock.close()
        context.term()


def push_pull_frames(sock: zmq.Socket, push_views: Sequence[memoryview], nbytes: int) -> list:
    """One round trip receiving the reply as zmq Frames; returns them."""
    sock.send_multipart(push_views, copy=False)
    reply = sock.recv_multipart(copy=False)
    received = sum(len(frame) for frame in reply)
    if received != nbytes:
        raise RuntimeError(f"client expected {nbytes} bytes, received {received}")
    return reply


def push_pull_into(sock: zmq.Socket, push_views: Sequence[memoryview],
                   pull_view: memoryview) -> list:
    """One round trip receiving the reply into ``pull_view``; returns [pull_view]."""
    sock.send_multipart(push_views, copy=False)
    received = receive_into(sock, pull_view)
    if received != len(pull_view):
        raise RuntimeError(f"client expected {len(pull_view)} bytes, received {received}")
    return [pull_view]


def time_round_trips(port: int, nbytes: int, frame_bytes: int | None, seconds: float,
                     mode: str) -> list[float]:
    """Connect to the server, time round trips for ``seconds``, say goodbye; returns durations
    in s."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    # A dead server must make the caller fail, not hang: finite timeouts,
    # and nothing left queued to block context.term().
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, CLIENT_TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, CLIENT_TIMEOUT_MS)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        # Zero-copy sends keep referring to these buffers until libzmq has
        # written them out; that is safe because nothing writes to them again.
        push_views = frame_views(preallocated_buffer(nbytes, CLIENT_FILL), frame_bytes)
        if mode == "recv_into":
            pull_view = memoryview(preallocated_buffer(nbytes, 0))

            def round_trip() -> list:
                return push_pull_into(sock, push_views, pull_view)
        else:
            def round_trip() -> list:
                return push_pull_frames(sock, push_views, nbytes)

        for _ in range(WARMUP_ROUND_TRIPS):
            round_trip()
        durations = []
        deadline = time.perf_counter() + seconds
        while len(durations) < MIN_TIMED_ROUND_TRIPS or time.perf_counter() < deadline:
            start = time.perf_counter()
            reply = round_trip()
            durations.append(time.perf_counter() - start)
        if not all((np.frombuffer(part, dtype=np.uint8) == SERVER_FILL).all() for part in reply):
            raise RuntimeError("the reply does not hold the server's bytes")

        sock.send(b"")
        sock.recv()  # the server's acknowledgement: it has stopped and can be joined
        return durations
    except zmq.Again as exc:
        raise RuntimeError(f"raw zmq server on port {port} did not answer within "
                           f"{CLIENT_TIMEOUT_MS / 1000:g} s ({nbytes} bytes, mode {mode})") from exc
    finally:
        sock.close()
        context.term()


def stop_process(process: multiprocessing.process.BaseProcess) -> None:
    """Make sure ``process`` is gone: terminate, then kill if it ignores that."""
    if process.is_alive():
        process.terminate()
        process.join(SERVER_EXIT_TIMEOUT_S)
    if process.is_alive():
        process.kill()
        process.join()


def time_against_server(serve, args: tuple, name: str, client) -> list:
    """Run ``serve(port_writer, *args)`` in a spawned process and ``client(port)`` here.

    The server reports its port through the pipe and must exit 0 once the
    client has said goodbye; returns what ``client`` returns. Raises
    RuntimeError if the server sends no port, dies first or ends badly, and
    never leaves it running.
    """
    spawn = multiprocessing.get_context("spawn")
    port_reader, port_writer = spawn.Pipe(duplex=False)
    server = spawn.Process(target=serve, name=name, args=(port_writer, *args), daemon=True)
    server.start()
    port_writer.close()  # so that the reader sees EOF if the server dies before sending its port
    try:
        if not port_reader.poll(SERVER_START_TIMEOUT_S):
            raise RuntimeError(f"{name} sent no port within {SERVER_START_TIMEOUT_S:g} s")
        try:
            port = port_reader.recv()
        except EOFError:
            server.join(SERVER_EXIT_TIMEOUT_S)
            raise RuntimeError(f"{name} exited before binding "
                               f"(exit code {server.exitcode})") from None
        result = client(port)
        server.join(SERVER_EXIT_TIMEOUT_S)
        if server.exitcode != 0:
            raise RuntimeError(f"{name} ended badly (exit code {server.exitcode})")
        return result
    finally:
        stop_process(server)
        port_reader.close()


def measure_raw(nbytes: int, frame_bytes: int | None, seconds: float = 2.0,
                mode: str = "frames") -> dict:
    """Median push+pull round trip of ``nbytes`` each way between a DEALER and a ROUTER process.

    ``frame_bytes`` None sends the payload as one frame, otherwise as frames
    of at most ``frame_bytes``.  ``mode`` is "frames" (recv_multipart with
    copy=False) or "recv_into" (each frame copied into a pre-allocated buffer;
    only with pyzmq >= 26.4, see ``MODES``).  Raises RuntimeError if the
    server fails to start, stops answering, or exits with an error.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    if frame_bytes is not None and frame_bytes <= 0:
        raise ValueError(f"frame_bytes must be positive or None, got {frame_bytes}")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not available with pyzmq {zmq.__version__}; "
                         f"choose from {MODES}")

    durations = time_against_server(
        serve_round_trips, (nbytes, frame_bytes, mode), "raw-zmq-server",
        lambda port: time_round_trips(port, nbytes, frame_bytes, seconds, mode))

    median_s = statistics.median(durations)
    return {"nbytes": nbytes, "frame_bytes": frame_bytes, "mode": mode,
            "frames": 1 if frame_bytes is None else -(-nbytes // frame_bytes),
            "round_trips": len(durations),
            "ms_per_round_trip": median_s * 1e3,
            "us_per_round_trip": median_s * 1e6,
            "ms_min": min(durations) * 1e3,
            "gbps": 2 * nbytes / median_s / 1e9}


SIZES = [("20 KB", 20_000), ("1 MB", 1_000_000), ("10 MB", 10_000_000), ("40 MiB", 40 * 2**20)]
LAYOUTS = [("one frame", None), ("4 MiB frames", 4 * 2**20)]
# Below this the round trip is latency-bound and reads better in µs.
SMALL_NBYTES = 1_000_000


def markdown_table(rows: list[tuple[str, str, dict]]) -> str:
    lines = ["| payload | layout | receive | frames | round trips | ms / round trip "
             "| µs / round trip | GB/s (push+pull) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for size_label, layout_label, r in rows:
        micros = f"{r['us_per_round_trip']:,.0f}" if r["nbytes"] < SMALL_NBYTES else ""
        lines.append(f"| {size_label} | {layout_label} | {r['mode']} | {r['frames']} "
                     f"| {r['round_trips']:,} | {r['ms_per_round_trip']:.3f} | {micros} "
                     f"| {r['gbps']:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="timed seconds per configuration (default 2)")
    args = parser.parse_args(argv)
    if not RECV_INTO_AVAILABLE:
        print(f"pyzmq {zmq.__version__} has no Socket.recv_into: skipping that mode",
              file=sys.stderr)
    rows = []
    for size_label, nbytes in SIZES:
        for layout_label, frame_bytes in LAYOUTS:
            for mode in MODES:
                result = measure_raw(nbytes, frame_bytes, args.seconds, mode)
                rows.append((size_label, layout_label, result))
                print(f"  {size_label:>6} {layout_label:12} {mode:9}: "
                      f"{result['ms_per_round_trip']:8.3f} ms, {result['gbps']:5.2f} GB/s",
                      file=sys.stderr)
    print(f"Raw pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}) DEALER/ROUTER push+pull "
          f"round trips on tcp://127.0.0.1, median over {args.seconds:g} s per row "
          f"({time.strftime('%Y-%m-%d %H:%M')})\n")
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
