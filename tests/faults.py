"""Fault-injection tools for the reliability tests and ``experiments/reliability.py``.

- ``GarbageFlood``: raw TCP clients that send random bytes, half ZMTP greetings
  and stalled handshakes to a server's ports, reconnecting, until stopped.
- ``oversized_frame``: a raw ZMTP peer that completes the NULL handshake, then
  announces one frame of 2**62 bytes.
- ``tree_fds`` / ``tree_rss``: open file descriptors and resident memory of a
  process and its descendants (the server and its shards).
- ``observe``: the parameters a shard holds, read like the server's evaluator does.
- ``record_figure``: appends a measured figure to $ASYNCSGD_FIGURES (JSON lines)
  so the reliability report shows what the tests measured.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import threading
import time

import psutil
import torch

from asyncsgd.protocol import PARAMS, PULL, Message, encode

GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def record_figure(scenario: str, **figures) -> None:
    """Append ``figures`` of ``scenario`` to $ASYNCSGD_FIGURES, when set."""
    path = os.environ.get("ASYNCSGD_FIGURES")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"scenario": scenario, **figures}) + "\n")


class GarbageFlood:
    """``clients`` threads throwing garbage at ``ports`` on 127.0.0.1 until ``stop``."""

    def __init__(self, ports: list, clients: int = 4, seed: int = 0):
        self.ports, self.seed = ports, seed
        self.sent = 0  # connections made, each carrying one kind of garbage
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]

    def __enter__(self) -> "GarbageFlood":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
            assert not t.is_alive(), "a garbage client did not stop"

    def _run(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while not self._stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", rng.choice(self.ports)), 2) as s:
                    s.settimeout(0.5)
                    self._garbage(s, rng)
                self.sent += 1
            except OSError:  # the server hung up on us: that is the point
                self.sent += 1

    @staticmethod
    def _garbage(s: socket.socket, rng: random.Random) -> None:
        kind = rng.randrange(4)
        if kind == 0:    # random bytes
            s.sendall(rng.randbytes(rng.randrange(1, 4096)))
        elif kind == 1:  # half a greeting, then silence
            s.sendall(GREETING[:rng.randrange(1, len(GREETING))])
            time.sleep(rng.uniform(0.05, 0.3))
        elif kind == 2:  # a whole greeting, then random bytes where the handshake should be
            s.sendall(GREETING + rng.randbytes(rng.randrange(1, 512)))
        else:            # a greeting announcing a mechanism nobody speaks
            s.sendall(GREETING[:12] + b"EVIL".ljust(20, b"\x00") + b"\x00" * 32)
        try:
            s.recv(4096)
        except OSError:
            pass


def oversized_frame(port: int, size: int = 2 ** 62, timeout: float = 5.0) -> float:
    """Handshake as a NULL DEALER, announce a frame of ``size`` bytes; seconds until hung up."""
    with socket.create_connection(("127.0.0.1", port), timeout) as s:
        s.sendall(GREETING)
        props = b"".join(bytes([len(k)]) + struct.pack(">I", len(v)) + k + v
                         for k, v in [(b"Socket-Type", b"DEALER"), (b"Identity", b"")])
        ready = b"\x05READY" + props
        s.sendall(b"\x04" + bytes([len(ready)]) + ready)
        s.sendall(b"\x02" + struct.pack(">Q", size) + b"\x00" * 1024)  # long frame header
        started = time.monotonic()
        try:
            while s.recv(65536):  # the server's greeting and READY, then its hang-up
                pass
        except ConnectionResetError:
            pass
        return time.monotonic() - started


def tree(pid: int) -> list:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_fds(pid: int) -> int:
    return sum(p.num_fds() for p in tree(pid))


def tree_rss(pid: int) -> int:
    return sum(p.memory_info().rss for p in tree(pid))


def observe(server, port: int, size: int) -> torch.Tensor:
    """Shard parameters, fetched by an observer pull (joins no barrier) through ``server``."""
    reply = server.request(encode(Message(type=PULL, seq=1, meta={"observer": True})), port=port)
    assert reply.type == PARAMS, reply
    flat = torch.empty(size)
    for seg in reply.segments:
        flat[seg.offset:seg.offset + len(seg.data)] = seg.data
    return flat
