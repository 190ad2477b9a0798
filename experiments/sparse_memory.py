"""A shard's memory under raw ids that grow without bound, with and without --evict.

    python experiments/sparse_memory.py            # 2,000,000 ids, lfu / ttl / none, ~2 min
    python experiments/sparse_memory.py --quick    # 262,144 ids, lfu and none, < 30 s
    python experiments/sparse_memory.py --evict lfu:20000 --ids 400000 --json rows.json

Each setting starts a real ``asyncsgd ps-server`` (ctr:rows=1000, one shard, --id-space
hashed, --table-optimizer sgd, the setting's --evict) and feeds it from one hand-made worker
written from PROTOCOL.md: it says hello to the front, then, step after step, pulls the rows of
4,096 ids never seen before (raw int64 ids, 10^12 + a counter) from table 0 and pushes a
gradient for each of them. The shard process's RSS (psutil) is read before the first push,
after the first eighth of the ids ("warm": an lfu table is full by then), every 16 pushes, and
at the end; the shard's stats give the rows it holds, created and evicted, and the table's
bytes. Prints a markdown table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import zmq

from asyncsgd.core.tasks import load_task
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import (HELLO, PARAMS, PULL, PUSH, STATS, WELCOME, Key, Message,
                                    decode, encode)
from asyncsgd.wire.sparse import ids_segment, rows_segment

TASK, DIM, TABLE = "ctr:rows=1000", 16, "tables.0.weight"
FIRST_ID = 10 ** 12
MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.lru_cache(maxsize=None)
def signature() -> dict:
    """The signature of TASK's model, tables served by row, as a worker says it."""
    task = load_task(TASK, samples=2000)
    model = task.build_model(0)
    return Layout.of(model, task.served_tables(model)).signature()


class Feeder:
    """One ps-server (its process) and one hand-made worker speaking to its shard 0."""

    def __init__(self, evict: str, out: Path):
        self.port = free_port()
        flags = ["--evict", evict] if evict != "none" else []
        self.log = out / "server.log"  # a file, not a pipe: nobody reads a pipe mid-run
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "asyncsgd", "ps-server", "--bind",
                 f"tcp://127.0.0.1:{self.port}", "--out", str(out / "run"), "--task", TASK,
                 "--samples", "2000", "--shards", "1", "--id-space", "hashed",
                 "--table-optimizer", "sgd", "--no-exit-when-done", "--heartbeat-timeout",
                 "600", "--checkpoint-every", "0", "--progress", "off", *flags],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.ctx = zmq.Context()
        try:
            self._meet()
        except BaseException:
            self.close()
            raise

    def _meet(self) -> None:
        """Wait for the server, say hello as worker "feeder", connect to shard 0."""
        probe = self._dealer(self.port)  # asked until it answers, then closed with the rest
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ps-server exited: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("ps-server did not come up within 120 s")
            probe.send_multipart(encode(Message(type=STATS, seq=1)))
            if probe.poll(500):
                break
        shard_port = decode(probe.recv_multipart()).meta["shard_ports"][0]
        probe.close(0)
        self.front = self._dealer(self.port)
        self.front.send_multipart(encode(Message(type=HELLO, worker="feeder", incarnation=1,
                                                 seq=1, meta={Key.SIGNATURE: signature()})))
        welcome = self._reply(self.front)
        if welcome.type != WELCOME:
            raise RuntimeError(f"no welcome: {welcome}")
        self.token = welcome.meta[Key.TOKEN]
        self.shard = self._dealer(shard_port)
        self.seq, self.version = 0, 0
        self.pid = self.stats()["pid"]

    def _dealer(self, port: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    @staticmethod
    def _reply(sock: zmq.Socket, timeout: float = 30.0) -> Message:
        if not sock.poll(int(timeout * 1000)):
            raise RuntimeError(f"no reply within {timeout:g} s")
        return decode(sock.recv_multipart())

    def _send(self, kind: str, segments: list) -> Message:
        self.seq += 1
        self.shard.send_multipart(encode(Message(
            type=kind, worker="feeder", incarnation=1, seq=self.seq, clock=self.version,
            shard=0, segments=segments, token=self.token)))
        reply = self._reply(self.shard)
        if reply.type not in (PARAMS, "ack") or (kind == PUSH and not reply.meta[Key.APPLIED]):
            raise RuntimeError(f"{kind} {self.seq}: {reply}")
        self.version = max(self.version, reply.clock)
        return reply

    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Pull the rows of ``ids``, then push ``grads`` for them: a worker's step."""
        self._send(PULL, [ids_segment(0, ids)])
        self._send(PUSH, [rows_segment(0, ids, grads)])

    def stats(self) -> dict:
        self.shard.send_multipart(encode(Message(type=STATS, seq=1)))
        return self._reply(self.shard).meta

    def rss(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def close(self) -> None:
        try:
            self.proc.terminate()
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        finally:
            self.ctx.destroy(0)


def run(evict: str, ids: int, per_push: int) -> dict:
    """Feed ``ids`` new ids, ``per_push`` a step, to a server under ``evict``: its figures."""
    gen = torch.Generator().manual_seed(0)
    grads = 0.01 * torch.randn(per_push, DIM, generator=gen)
    with tempfile.TemporaryDirectory() as out:
        feeder = Feeder(evict, Path(out))
        try:
            before = feeder.rss()
            pushes = ids // per_push
            warm_at, samples, warm = max(1, pushes // 8), [], None
            start = time.perf_counter()
            for k in range(pushes):
                feeder.step(FIRST_ID + k * per_push + torch.arange(per_push), grads)
                if k + 1 == warm_at:
                    warm = feeder.rss()
                if k % 16 == 15:
                    samples.append(feeder.rss())
            seconds = time.perf_counter() - start
            after = feeder.rss()
            stats = feeder.stats()
        finally:
            feeder.close()
    table = stats["tables"][TABLE]
    return {"evict": evict, "ids_seen": pushes * per_push, "pushes": pushes,
            "seconds": round(seconds, 1), "rss_before_mib": round(before / MIB, 1),
            "rss_warm_mib": round(warm / MIB, 1), "rss_after_mib": round(after / MIB, 1),
            "rss_max_mib": round(max(samples + [after]) / MIB, 1),
            "rows_held": table["rows"], "created": table["created"],
            "evictions": table["evictions"], "table_mib": round(table["bytes"] / MIB, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="262,144 ids; lfu:16384 and none")
    parser.add_argument("--ids", type=int, default=None,
                        help="distinct ids fed (default 2,000,000; 262,144 with --quick)")
    parser.add_argument("--per-push", type=int, default=4096)
    parser.add_argument("--evict", action="append",
                        help="a --evict setting, or none; repeat for several "
                             "(default lfu:100000, ttl:1, none)")
    parser.add_argument("--json", type=Path, help="write the rows there")
    args = parser.parse_args()
    ids = args.ids or (262_144 if args.quick else 2_000_000)
    settings = args.evict or (["lfu:16384", "none"] if args.quick
                              else ["lfu:100000", "ttl:1", "none"])
    rows = []
    print("| --evict | ids seen | s | RSS before | warm | after | max | rows held | "
          "evictions | table MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for evict in settings:
        row = run(evict, ids, args.per_push)
        rows.append(row)
        print(f"| {evict} | {row['ids_seen']:,} | {row['seconds']} | "
              f"{row['rss_before_mib']} | {row['rss_warm_mib']} | {row['rss_after_mib']} | "
              f"{row['rss_max_mib']} | {row['rows_held']:,} | {row['evictions']:,} | "
              f"{row['table_mib']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
