r"""The Python of one push+pull round trip, hot, in a tight loop: no sockets, no processes.

    python experiments/ps_hot_path.py                  # 20 KB; ~10 s
    python experiments/ps_hot_path.py --kb 1000 --blocks 9

Each iteration is one worker's step against one async shard, as the real processes run it
(the shard's ``ZeroCopyStore``, its accounting after the reply): the worker encodes its
push (``encode``, with ``PSClient``'s header cache where the code has one), the shard
decodes it (``decode``), handles it (``ShardState.handle``: checks, exactly-once, the
update, the reply), encodes its reply (with its header cache where it has one) and settles
the push (``settle``: the dedupe window, counters, staleness), and the worker decodes the
reply; frames go from encode to decode as they are (a socket's copy is no Python). Each
phase is timed apart (``perf_counter_ns``, median of ``--blocks`` blocks of
``--iterations``); where the code has a general and a fused path
(``ShardState(fused=...)``) both are measured in alternate blocks of one run. The floor's
rows are what ``ps_floor.py`` does per message: a msgpack header of type and seq each way,
a ``frombuffer`` of the tensor frame.

Then the same step through the shard process's loop (``_serve_one``) on real sockets, over
``inproc://`` in this process: what the loop around ``handle`` adds, without the other
process or libzmq's I/O threads to wake.

Why: issue 42 (the fused common path) asks where a round trip's Python goes, and what the
fused path saves, "measure, don't guess". Run it from a worktree of older code with that
worktree's interpreter to compare (its missing switches are skipped).
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import time

import msgpack
import torch

from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.servers.zero_copy import ZeroCopyStore
from asyncsgd.wire.protocol import PUSH, Key, Message, decode, encode, split
from asyncsgd.wire.transport import shared_frames

try:  # cached headers (issue 42); older code encodes every message whole
    from asyncsgd.wire.protocol import HeaderCache
except ImportError:
    HeaderCache = None
try:  # the shard loop's headers per part; before it, one HeaderCache
    from asyncsgd.wire.protocol import PartsCache
except ImportError:
    PartsCache = HeaderCache

PEER = b"\x00peer"
TOKEN = "0123456789abcdef0123456789abcdef"


class Loop:
    """One worker and one shard, stepping; ``phase`` times one part of the step."""

    def __init__(self, elements: int, fused=None):
        kw = {} if fused is None else {"fused": fused}
        cfg = ShardConfig(index=0, start=0, end=elements, lr=1e-6)
        self.state = ShardState(cfg, torch.zeros(elements), store=ZeroCopyStore,
                                settle_later=True, **kw)
        self.grads = torch.full((elements,), 1e-3)
        self.segments = shared_frames(split(self.grads))
        self.cache = HeaderCache() if HeaderCache is not None else None
        self.reply_cache = HeaderCache() if HeaderCache is not None else None
        self.seq = 0
        self.version = 0
        self.times = {k: 0 for k in ("client encode", "shard decode", "shard handle",
                                     "shard encode", "shard settle", "client decode")}

    def step(self) -> None:
        t = self.times
        clock = time.perf_counter_ns
        self.seq += 1
        a = clock()
        msg = Message(type=PUSH, worker="bench-0", incarnation=7, seq=self.seq,
                      clock=self.version, shard=0, meta={Key.PULL: True},
                      segments=self.segments, token=TOKEN)
        frames = encode(msg) if self.cache is None else encode(msg, cache=self.cache)
        b = clock()
        got = decode(frames, None, PEER)
        d = clock()
        (_, reply), = self.state.handle(PEER, got, 1.0)
        e = clock()
        self.state.store.apply_pending()
        out = encode(reply) if self.reply_cache is None else \
            encode(reply, cache=self.reply_cache)
        f = clock()
        self.state.settle()
        g = clock()
        params = decode(out)
        h = clock()
        self.version = params.clock
        t["client encode"] += b - a
        t["shard decode"] += d - b
        t["shard handle"] += e - d
        t["shard encode"] += f - e
        t["shard settle"] += g - f
        t["client decode"] += h - g


def loop_times(elements: int, iterations: int, blocks: int, fused) -> list:
    """us a round trip through the shard process's own loop (``shard_process._serve_one``:
    receive, decode, admit, handle, reply, settle) on a ROUTER, from a DEALER worker in this
    process over ``inproc://`` (no I/O thread, no other process to wake): per block."""
    import zmq

    from asyncsgd.servers import shard_process
    from asyncsgd.servers.sessions import Sessions
    from asyncsgd.wire.busy_poll import BusyPoll
    from asyncsgd.wire.security import Gatekeeper
    from asyncsgd.wire.shared import Areas
    from asyncsgd.wire.transport import recv, send

    loop = Loop(elements, fused)
    ctx = zmq.Context()
    shard, worker = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    shard.bind("inproc://hot")
    worker.connect("inproc://hot")
    sessions = Sessions(b"k" * 32)
    token = sessions.token("bench-0", 7)
    args = [shard, loop.state, Gatekeeper(ctx, None), sessions, Areas(elements, 8),
            BusyPoll(0.0), shard_process._Saver(loop.state, 0)]
    if "headers" in inspect.signature(shard_process._serve_one).parameters:
        args.append(PartsCache())
    cache = {"cache": HeaderCache()} if HeaderCache is not None else {}
    out = []
    try:
        for block in range(blocks + 1):  # the first warms up
            began = time.perf_counter_ns()
            for _ in range(iterations):
                loop.seq += 1
                send(worker, Message(type=PUSH, worker="bench-0", incarnation=7, seq=loop.seq,
                                     clock=loop.version, shard=0, meta={Key.PULL: True},
                                     segments=loop.segments, token=token), copy=False, **cache)
                shard_process._serve_one(*args)
                loop.version = recv(worker).clock
            if block:
                out.append((time.perf_counter_ns() - began) / iterations / 1000)
    finally:
        shard.close(0)
        worker.close(0)
        ctx.term()
    return out


def floor_times(elements: int, iterations: int) -> dict:
    """ps_floor.py's per-message Python: its headers packed and read, its frames viewed."""
    grad = bytes(torch.full((elements,), 1e-3).numpy().tobytes())
    t = {"floor encode": 0, "floor decode": 0}
    clock = time.perf_counter_ns
    for seq in range(iterations):
        a = clock()
        head = msgpack.packb({"t": "params", "s": seq, "part": 0, "parts": 1})
        b = clock()
        header = msgpack.unpackb(head)
        torch.frombuffer(grad, dtype=torch.float32)
        c = clock()
        assert header["s"] == seq
        t["floor encode"] += b - a
        t["floor decode"] += c - b
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kb", type=float, default=20.0, help="model size in KB (1000 B)")
    parser.add_argument("--iterations", type=int, default=2000, help="steps a block")
    parser.add_argument("--blocks", type=int, default=7, help="blocks (median reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    elements = int(args.kb * 1000) // 4
    fused = "fused" in inspect.signature(ShardState).parameters
    loops = {"fused": Loop(elements, True), "general": Loop(elements, False)} if fused \
        else {"code": Loop(elements)}
    results = {name: [] for name in loops}
    floors = []
    for name, loop in loops.items():  # warm up
        for _ in range(200):
            loop.step()
    for _ in range(args.blocks):
        for name, loop in loops.items():
            loop.times = dict.fromkeys(loop.times, 0)
            for _ in range(args.iterations):
                loop.step()
            results[name].append({k: v / args.iterations / 1000 for k, v in loop.times.items()})
        floors.append({k: v / args.iterations / 1000
                       for k, v in floor_times(elements, args.iterations).items()})
    load = os.getloadavg()[0]
    print(f"{args.kb:g} KB, {sys.prefix}, median of {args.blocks} blocks of "
          f"{args.iterations} steps, 1-min load {load:.2f} (us a step):")
    for name, blocks in results.items():
        medians = {k: statistics.median(b[k] for b in blocks) for k in blocks[0]}
        total = statistics.median(sum(b.values()) for b in blocks)
        print(f"  {name:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in medians.items()) +
              f"  | all {total:.2f}")
    print("  floor    " + "  ".join(f"{k} {statistics.median(b[k] for b in floors):.2f}"
                                    for k in floors[0]))
    for name in loops:
        rounds = loop_times(elements, args.iterations, args.blocks,
                            None if name == "code" else name == "fused")
        print(f"  {name:8s} through _serve_one over inproc sockets: "
              f"{statistics.median(rounds):.2f} us a round trip (fastest block "
              f"{min(rounds):.2f}: the least preempted)")


if __name__ == "__main__":
    main()
