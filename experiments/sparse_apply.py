"""A shard's cost of one push of rows: with and without the table's second check, and in a
hashed id space as the table grows, before and after the id map's rework (issue 41).

    python experiments/sparse_apply.py            # 4,096 rows x 16, 300 pushes per case, ~20 s
    python experiments/sparse_apply.py --quick    # 50 pushes per case, < 10 s
    python experiments/sparse_apply.py --growth   # hashed, to 2 million rows, ~3 min
    python experiments/sparse_apply.py --growth --quick --before 608e003  # to 262,144 rows
    python experiments/sparse_apply.py --rates RUN_DIR...  # a ps run's samples/s, early, late

ShardTables.check makes every check of a push's rows (wire.sparse.check_rows: ids in
range, this shard's, unique; values finite; lfu's bound); ShardTables.apply then hands the
rows to SparseTable.apply on its trusted path (``checked=True``). Before, the table checked
them again (unique ids by torch.unique, the shard of each id, finite values). This times,
in a tight loop, per push: ``check`` + the table's apply, checked again ("before") and
trusted ("after"), for a fixed table of 10^6 rows and a hashed one under lfu, under sgd and
rowwise adagrad. Ids: 4,096 distinct ones drawn anew each push from a Zipf-like mix, as a
DLRM batch dedups to. Writes nothing; the figures go to experiments/README.md by hand.

``--growth``: pushes of 4,096 ids, 1,024 of them never seen (a counter) and 3,072 drawn
from the ids held, fed alike to the code at git revision ``--before`` (servers/id_map.py and
servers/sparse_table.py as they were, loaded from git) and to this tree's, one push each in
turn, until the table holds ``--rows``. Timed per push: the map alone (``find`` of the 4,096
ids, ``insert`` of the new ones) and a whole hashed table's ``apply`` (sgd, trusted rows)
under ``--evict none`` and ``ttl:3600`` (nothing ages out: what ttl's bookkeeping costs).
Medians per range of table sizes.

``--rates``: a ps run's samples/s from its metrics.jsonl, early (its first training report,
past start-up, to the one nearest 50,000 samples) and late (from there to its last), and
the rows its tables created (summary.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from asyncsgd.core.sparse_ids import hash_id
from asyncsgd.wire.layout import TableSpec
from asyncsgd.wire.sparse import rows_segment
from asyncsgd.servers import id_map
from asyncsgd.servers.shard_tables import ShardTables
from asyncsgd.servers.sparse_rules import make_sparse_rule
from asyncsgd.servers.sparse_table import SparseTable

ROWS, DIM, N = 1_000_000, 16, 4096
NEW = 1024  # never-seen ids of a --growth push


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


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__package__ = "asyncsgd.servers"
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)  # this repository's own code
    return module


def before_code(revision: str) -> tuple:
    """(IdMap, SparseTable) of servers/ at git ``revision``: the old table made with the
    old map (its ``from .id_map import IdMap`` served the old module while it loads)."""
    root = Path(__file__).resolve().parent.parent

    def source(path):
        return subprocess.run(["git", "show", f"{revision}:{path}"], cwd=root, check=True,
                              capture_output=True, text=True).stdout

    old_map = _module("before_id_map", source("servers/id_map.py"))
    current = sys.modules["asyncsgd.servers.id_map"]
    sys.modules["asyncsgd.servers.id_map"] = old_map
    try:
        old_table = _module("before_sparse_table", source("servers/sparse_table.py"))
    finally:
        sys.modules["asyncsgd.servers.id_map"] = current
    return old_map.IdMap, old_table.SparseTable


class Grower:
    """One code's map and tables, fed the same pushes."""

    def __init__(self, id_map: type, sparse_table: type):
        self.map = id_map()
        self.tables = {evict: sparse_table(DIM, make_sparse_rule("sgd", DIM, 0.1),
                                           id_space="hashed", evict=evict)
                       for evict in (("none", 0), ("ttl", 3600.0))}
        self.times: dict = {name: [] for name in ["find", "insert", *self.tables]}

    def push(self, ids: torch.Tensor, new: torch.Tensor, grads: torch.Tensor, now: float,
             size: int) -> None:
        start = time.perf_counter()
        self.map.find(ids)
        found = time.perf_counter()
        self.map.insert(new, torch.arange(size, size + new.numel()))
        self.times["find"].append((size, found - start))
        self.times["insert"].append((size, time.perf_counter() - found))
        for evict, table in self.tables.items():
            start = time.perf_counter()
            table.apply(ids, grads, now, checked=True)
            self.times[evict].append((size, time.perf_counter() - start))


def growth(rows: int, revision: str) -> None:
    before = Grower(*before_code(revision))
    after = Grower(id_map.IdMap, SparseTable)
    gen = torch.Generator().manual_seed(0)
    size = 0
    while size < rows:
        new = torch.arange(size, size + NEW, dtype=torch.int64) * 7919 + 10 ** 12
        held = (torch.randint(0, size, (N - NEW,), generator=gen) if size else
                torch.empty(0, dtype=torch.int64)).unique() * 7919 + 10 ** 12
        ids = torch.cat([new, held])
        grads = torch.randn(ids.numel(), DIM, generator=gen)
        for grower in (before, after) if (size // NEW) % 2 else (after, before):
            grower.push(ids, new, grads, float(size // NEW), size)
        size += NEW
    edges = [0] + [4 ** k for k in range(7, 12) if 4 ** k < rows] + [rows]
    print(f"pushes of {N} ids ({NEW} new) x {DIM}; ms per push while the table held "
          f"[low, high) rows, before ({revision}) -> after (MERGE {id_map.MERGE}), one thread")
    for what, average in (("median", statistics.median), ("mean", statistics.mean)):
        print(f"{what + ', rows held':>22s} " + "".join(
            f"{name:>20s}" for name in ("map find", "map insert", "table none", "table ttl")))
        for low, high in zip(edges, edges[1:]):
            cells = []
            for name in ("find", "insert", ("none", 0), ("ttl", 3600.0)):
                old, new = (average(t for s, t in g.times[name] if low <= s < high)
                            for g in (before, after))
                cells.append(f"{1000 * old:7.3f} -> {1000 * new:6.3f}")
            print(f"{low:>10,d}-{high:<11,d} " + "".join(f"{c:>20s}" for c in cells))


def rates(run: Path) -> str:
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    reports = sorted({(e["samples"], e["t"]) for e in events if e["event"] == "train"})
    reports = [r for i, r in enumerate(reports) if not i or r[0] > reports[i - 1][0]]
    first, last = reports[0], reports[-1]
    mid = min(reports, key=lambda r: abs(r[0] - 50_000))

    def rate(a, b):
        return (b[0] - a[0]) / (b[1] - a[1])
    tables = json.loads((run / "summary.json").read_text()).get("tables", {})
    created = sum(table["created"] for table in tables.values())
    return (f"{run}: early {first[0]:,}-{mid[0]:,} samples {rate(first, mid):,.0f}/s, late "
            f"{mid[0]:,}-{last[0]:,} {rate(mid, last):,.0f}/s, rows created {created:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 pushes per case; "
                        "--growth: to 262,144 rows")
    parser.add_argument("--growth", action="store_true", help="a hashed table growing, "
                        "before and after")
    parser.add_argument("--before", default="608e003", help="--growth: the git revision "
                        "of the code before")
    parser.add_argument("--rows", type=int, default=2_000_000, help="--growth: rows to grow to")
    parser.add_argument("--merge", type=int, default=id_map.MERGE, help="--growth: the "
                        "id map's MERGE factor of the code after")
    parser.add_argument("--rates", nargs="+", type=Path, metavar="RUN_DIR",
                        help="print these ps runs' samples/s, early and late")
    args = parser.parse_args()
    if args.rates:
        print("\n".join(rates(run) for run in args.rates))
        return
    count = 50 if args.quick else 300
    torch.set_num_threads(1)
    if args.growth:
        id_map.MERGE = args.merge
        growth(262_144 if args.quick else args.rows, args.before)
        return
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
