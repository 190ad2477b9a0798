"""Raw pyzmq round trips against 1 and 2 "shards": what a second shard costs with no work at all.

    python experiments/raw_zmq_shards.py                     # 1 and 4 clients, sleep and poll
    python experiments/raw_zmq_shards.py --clients 1 --repeats 3

Each client process (a DEALER per server) sends every server its share of ``--bytes`` and
waits for as many bytes back from each, as an asyncsgd worker's step does with its shards;
each server is a ROUTER in a process of its own that answers every message with a buffer
of its own, doing nothing else (no decoding, no update). 1 server and 2 alternate every
repeat, each in fresh processes, and the medians are compared: the ratio is the most a
second asyncsgd shard could give on this host. ``poll``: both sides poll for their
message (yielding the core) for up to 400 us before sleeping in recv, as asyncsgd's
BusyPoll does; ``sleep``: they sleep in recv at once. Figures: experiments/README.md,
"Shards".
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import numpy as np
import zmq

POLL_SECONDS = 400e-6  # asyncsgd's default --busy-poll-us
TIMEOUT_MS = 10_000  # a dead peer fails the run instead of hanging it
WARMUP = 200


def _ready(sock: zmq.Socket, poll: bool) -> None:
    """Poll ``sock`` for a message for up to POLL_SECONDS (when ``poll``), yielding the core."""
    end = time.perf_counter() + POLL_SECONDS
    while poll and not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN and time.perf_counter() < end:
        os.sched_yield()


def _serve(conn, nbytes: int, clients: int, poll: bool) -> None:
    """Answer every message with ``nbytes``; return once ``clients`` said goodbye (1 byte)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.RCVTIMEO = TIMEOUT_MS
    conn.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    reply = np.ones(nbytes, np.uint8)
    left = clients
    try:
        while left:
            _ready(sock, poll)
            peer, msg = sock.recv_multipart(copy=False)
            if len(msg) == 1:
                left -= 1
            else:
                sock.send_multipart([peer, reply], copy=False)
    finally:
        sock.close(0)
        ctx.term()


def _client(ports: list, nbytes: int, seconds: float, poll: bool) -> float:
    """Seconds per round trip: a message to every server, then every answer."""
    ctx = zmq.Context()
    socks = []
    for port in ports:
        sock = ctx.socket(zmq.DEALER)
        sock.RCVTIMEO = TIMEOUT_MS
        sock.connect(f"tcp://127.0.0.1:{port}")
        socks.append(sock)
    push = np.ones(nbytes, np.uint8)

    def round_trip() -> None:
        for sock in socks:
            sock.send(push, copy=False)
        for sock in socks:
            _ready(sock, poll)
            sock.recv(copy=False)

    for _ in range(WARMUP):
        round_trip()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        round_trip()
        count += 1
    took = (time.perf_counter() - start) / count
    for sock in socks:
        sock.send(b"x")
        sock.close(0)
    ctx.term()
    return took


def measure(servers: int, clients: int, nbytes: int, seconds: float, poll: bool) -> float:
    """Round trips per second of ``clients`` together against ``servers`` fresh servers."""
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(servers)]
    procs = [ctx.Process(target=_serve, args=(end, nbytes // servers, clients, poll),
                         daemon=True) for _, end in pipes]
    for proc in procs:
        proc.start()
    ports = [conn.recv() for conn, _ in pipes]
    with ctx.Pool(clients) as pool:
        per_client = pool.starmap(_client, [(ports, nbytes // servers, seconds, poll)] * clients)
    for proc in procs:
        proc.join(TIMEOUT_MS / 1000)
    return sum(1 / s for s in per_client)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=20_000, help="bytes each way per step")
    parser.add_argument("--clients", default="1,4", help="client counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="timed seconds per cell")
    args = parser.parse_args()
    for clients in [int(c) for c in args.clients.split(",")]:
        for poll in (False, True):
            rates: dict = {1: [], 2: []}
            for _ in range(args.repeats):
                for servers in (1, 2):
                    rates[servers].append(measure(servers, clients, args.bytes, args.seconds,
                                                  poll))
            one, two = statistics.median(rates[1]), statistics.median(rates[2])
            print(f"{clients} client(s), {'poll' if poll else 'sleep'}: 1 server {one:,.0f} "
                  f"round trips/s, 2 servers {two:,.0f}/s: {two / one:.2f}x "
                  f"(1-min load {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
