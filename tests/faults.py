"""Fault-injection tools for the reliability tests and ``experiments/reliability.py``.

- ``GarbageFlood``: raw TCP clients that send random bytes, half ZMTP greetings
  and stalled handshakes to a server's ports, reconnecting, until stopped.
- ``oversized_frame``: a raw ZMTP peer that completes the NULL handshake, then
  announces one frame of 2**62 bytes.
- ``tree_fds`` / ``tree_rss``: open file descriptors and resident memory of a
  process and its descendants (the server and its shards).
- ``observe``: the parameters a shard holds, read like the server's evaluator does.
- ``FaultProxy``: a ZeroMQ proxy that drops and duplicates pushes and acknowledgements.
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

import msgpack
import psutil
import torch
import zmq

from asyncsgd.wire.protocol import (ACK, PARAMS, PULL, PUSH, WELCOME, Message, copy_into, decode,
                                    encode)

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
    copy_into(reply, flat)
    return flat


class FaultProxy:
    """A ZeroMQ proxy between workers and a server that drops and duplicates messages.

    Workers connect to ``address``; the proxy forwards each worker's traffic
    through a DEALER of its own (the server sees one peer per worker), rewrites
    the shard ports in the handshake to ports it listens on itself, and drops
    a share ``drop`` of pushes and of their acknowledgements and sends a share
    ``dup`` of each twice. ``tamper(message)``, when given, may rewrite each
    shard's reply (decoded) before it is passed on, as a hostile server would send
    it. Everything else passes untouched.
    """

    def __init__(self, server_port: int, drop: float, dup: float, seed: int = 0,
                 tamper=None):
        self.drop, self.dup, self.rng, self.tamper = drop, dup, random.Random(seed), tamper
        self.counts = {"pushes": 0, "pushes_dropped": 0, "pushes_duplicated": 0,
                       "acks": 0, "acks_dropped": 0, "acks_duplicated": 0}
        self.ctx = zmq.Context()
        self.front = self._listener()
        self.address = self.front.getsockopt_string(zmq.LAST_ENDPOINT)
        self.upstream = {self.front: server_port}  # listener -> server port it stands for
        self.links: dict = {}  # (listener, worker identity) -> dealer to the server
        self.back: dict = {}  # dealer -> (listener, worker identity)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-proxy")
        self._thread.start()

    def _listener(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind_to_random_port("tcp://127.0.0.1")
        return sock

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "the fault proxy did not stop"
        for sock in [*self.upstream, *self.back]:
            sock.close(0)
        self.ctx.term()

    def _fault(self, kind: str) -> int:
        """How many copies to pass on: 0 (dropped), 1 or 2 (duplicated)."""
        self.counts[kind] += 1
        roll = self.rng.random()
        if roll < self.drop:
            self.counts[kind + "_dropped"] += 1
            return 0
        if roll < self.drop + self.dup:
            self.counts[kind + "_duplicated"] += 1
            return 2
        return 1

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self.upstream:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if sock in self.upstream:
                    self._from_worker(sock, frames[0], frames[1:], poller)
                else:
                    self._from_server(sock, frames, poller)

    def _from_worker(self, listener, identity: bytes, frames: list, poller) -> None:
        link = self.links.get((listener, identity))
        if link is None:
            link = self.ctx.socket(zmq.DEALER)
            link.setsockopt(zmq.LINGER, 0)
            link.connect(f"tcp://127.0.0.1:{self.upstream[listener]}")
            self.links[(listener, identity)] = link
            self.back[link] = (listener, identity)
            poller.register(link, zmq.POLLIN)
        copies = self._fault("pushes") if _kind(frames) == PUSH else 1
        for _ in range(copies):
            link.send_multipart(frames)

    def _from_server(self, link, frames: list, poller) -> None:
        listener, identity = self.back[link]
        kind = _kind(frames)
        if kind == WELCOME:
            msg = decode(frames)
            for shard in msg.meta["shards"]:
                shard_listener = self._listener()
                self.upstream[shard_listener] = shard["port"]
                poller.register(shard_listener, zmq.POLLIN)
                shard["port"] = int(shard_listener.getsockopt_string(zmq.LAST_ENDPOINT)
                                    .rsplit(":", 1)[1])
            frames = [bytes(f) for f in encode(msg)]
        elif self.tamper is not None and listener is not self.front:
            msg = decode([frames[0], *map(bytearray, frames[1:])])  # writable tensors
            self.tamper(msg)
            frames = [bytes(f) for f in encode(msg)]
        copies = self._fault("acks") if kind in (ACK, PARAMS) and listener is not self.front \
            and _carries_ack(frames) else 1
        for _ in range(copies):
            listener.send_multipart([identity, *frames])


def _kind(frames: list):
    try:
        return msgpack.unpackb(frames[0], raw=False).get("t")
    except Exception:
        return None


def _carries_ack(frames: list) -> bool:
    header = msgpack.unpackb(frames[0], raw=False)
    return header["t"] == ACK or "ack" in header.get("m", {})
