"""A shard's cost of one push of rows, with and without the table's second check.

    python experiments/sparse_apply.py            # 4,096 rows x 16, 300 pushes per case, ~20 s
    python experiments/sparse_apply.py --quick    # 50 pushes per case, < 10 s

ShardTables.check makes every check of a push's rows (wire.sparse.check_rows: ids in
range, this shard's, unique; values finite; lfu's bound); ShardTables.apply then hands the
rows to SparseTable.apply on its trusted path (``checked=True``). Before, the table checked
them again (unique ids by torch.unique, the shard of each id, finite values). This times,
in a tight loop, per push: ``check`` + the table's apply, checked again ("before") and
trusted ("after"), for a fixed table of 10^6 rows and a hashed one under lfu, under sgd and
rowwise adagrad. Ids: 4,096 distinct ones drawn anew each push from a Zipf-like mix, as a
DLRM batch dedups to. Writes nothing; the figures go to experiments/README.md by hand.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncsgd.core.sparse_ids import hash_id
from asyncsgd.wire.layout import TableSpec
from asyncsgd.wire.sparse import rows_segment
from asyncsgd.servers.shard_tables import ShardTables
from asyncsgd.servers.sparse_rules import make_sparse_rule
from asyncsgd.servers.sparse_table import SparseTable

ROWS, DIM, N = 1_000_000, 16, 4096


def table(id_space: str, rule: str) -> ShardTables:
    sparse = make_sparse_rule(rule, DIM, 0.1)
    if id_space == "fixed":
        one = SparseTable(DIM, sparse, rows=ROWS)
    else:
        one = SparseTable(DIM, sparse, id_space="hashed", evict=("lfu", 4 * N))
    spec = TableSpec("t.weight", ROWS if id_space == "fixed" else 0, DIM)
    return ShardTables([one], [spec], 0, 1, hash_id if id_space == "hashed" else None)


def pushes(count: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randperm(ROWS, generator=gen)[:N]
        out.append([rows_segment(0, ids, torch.randn(N, DIM, generator=gen))])
    return out


def time_case(tables: ShardTables, batches: list, trusted: bool) -> float:
    """Median ms per push of check + apply."""
    times = []
    for segments in batches:
        start = time.perf_counter()
        assert tables.check(segments) is None
        if trusted:
            tables.apply(segments, now=0.0, lr=0.1)
        else:  # the path before: the table checked the rows again
            for t, ids, grads in tables.values(segments):
                tables.tables[t].apply(ids, grads, 0.0)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 pushes per case")
    args = parser.parse_args()
    count = 50 if args.quick else 300
    torch.set_num_threads(1)
    batches = pushes(count, 0)
    print(f"{N} rows x {DIM} per push, {count} pushes per case, median ms per push "
          "(check + apply)")
    for id_space in ("fixed", "hashed"):
        for rule in ("sgd", "rowwise_adagrad"):
            before = time_case(table(id_space, rule), batches, trusted=False)
            after = time_case(table(id_space, rule), batches, trusted=True)
            print(f"{id_space:6s} {rule:16s} before {before:6.3f}  after {after:6.3f}  "
                  f"saved {before - after:6.3f} ms ({100 * (before - after) / before:4.1f}%)")


if __name__ == "__main__":
    main()
