"""A ctr push's cost to a shard, whole or in parts: why a worker sends a push of rows whole.

A ctr step pushes 26 tables' gradient rows and asks for the next batch's 26 sets of ids:
with the dense slice, 53 segments of a few hundred bytes each. Sent in parts that is 53
messages for the shard to decode and handle; whole, one. Measures decode + ShardState.handle
per push, in one process (no sockets), and the worker's cost of making the segments.

    python experiments/sparse_push_parts.py [--pushes 300]
"""

from __future__ import annotations

import argparse
import time

import torch

from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.servers.sparse_rules import make_sparse_rule
from asyncsgd.servers.sparse_table import SparseTable
from asyncsgd.wire.layout import TableSpec
from asyncsgd.wire.protocol import PUSH, Message, decode, encode, in_parts, split
from asyncsgd.wire.sparse import split_rows

ROWS, DIM, TABLES, DENSE, UNIQUE = 1000, 16, 26, 10_000, 25  # ctr:rows=1000, batch 32


def shard() -> ShardState:
    specs = [TableSpec(f"t{t}", ROWS, DIM) for t in range(TABLES)]
    cfg = ShardConfig(index=0, start=0, end=DENSE, rule="sgd", lr=0.1, consistency="async",
                      expected_workers=1, heartbeat_timeout=5.0)
    tables = [SparseTable(DIM, make_sparse_rule("sgd", DIM, 0.1), rows=ROWS,
                          init=torch.zeros(ROWS, DIM)) for _ in specs]
    return ShardState(cfg, torch.zeros(DENSE), tables=tables, table_specs=specs, shards=1)


def segments() -> list:
    """One step's segments: the dense slice, each table's rows, each table's next ids."""
    out = list(split(torch.zeros(DENSE)))
    for t in range(TABLES):
        out += split_rows(t, torch.randperm(ROWS)[:UNIQUE].sort().values,
                          torch.randn(UNIQUE, DIM))
    for t in range(TABLES):
        out += split_rows(t, torch.randperm(ROWS)[:UNIQUE].sort().values)
    return out


def per_push(whole: bool, pushes: int) -> float:
    """Seconds a shard spends decoding and handling one push."""
    wires = []
    for seq in range(1, pushes + 1):
        msg = Message(type=PUSH, worker="w", incarnation=1, seq=seq, shard=0,
                      meta={"pull": True}, segments=segments())
        wires.append([[bytes(f) for f in encode(m)] for m in ([msg] if whole else in_parts(msg))])
    state = shard()
    began = time.perf_counter()
    for frames in wires:
        for part in frames:
            state.handle(b"p", decode(part), 0.0)
    return (time.perf_counter() - began) / pushes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pushes", type=int, default=300)
    args = parser.parse_args()
    for whole in (True, False, True, False):
        print(f"{'whole' if whole else 'parts'}: {per_push(whole, args.pushes) * 1e3:.2f} ms "
              "a push (decode + handle)")
    began = time.perf_counter()
    for _ in range(args.pushes):
        segments()
    print(f"making a step's segments: {(time.perf_counter() - began) / args.pushes * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
