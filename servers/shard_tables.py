"""A shard's row-sparse tables as one plain object: checks a message's rows and ids, applies a
push's rows, gathers a pull's, and counts them (PROTOCOL.md, Row-sparse tables).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from asyncsgd.errors import ConfigError
from asyncsgd.wire.protocol import Code
from asyncsgd.wire.sparse import check_rows, rows_reply

from .sparse_rules import make_sparse_rule
from .sparse_table import SparseTable


def rows_of(segments: Sequence) -> list:
    """The segments holding row values (a push's rows) of a message's row-sparse ones."""
    return [seg for seg in segments if seg.data.dim]


def ids_of(segments: Sequence) -> list:
    """The segments holding ids alone (rows asked back) of a message's row-sparse ones."""
    return [seg for seg in segments if not seg.data.dim]


class ShardTables:
    """Shard ``shard`` of ``shards``' part of each table in ``specs`` (``TableSpec``, the
    layout's order), one ``SparseTable`` each; ``hash_ids``: the hashed id space's hash
    (core.sparse_ids.hash_id), None for a fixed one."""

    def __init__(self, tables: Sequence[SparseTable], specs: Sequence, shard: int,
                 shards: int, hash_ids: Optional[Callable] = None, lr_ratio: float = 1.0):
        if len(tables) != len(specs):
            raise ConfigError(f"{len(tables)} sparse tables for {len(specs)} table specs")
        for i, (table, spec) in enumerate(zip(tables, specs)):
            if table.dim != spec.dim or (table.shard, table.shards) != (shard, shards) or \
                    table.hashed != (hash_ids is not None):
                raise ConfigError(f"table {i} ({spec.name}) is [.., {table.dim}] for shard "
                                  f"{table.shard} of {table.shards}, hashed={table.hashed}; its "
                                  f"spec is [.., {spec.dim}] for shard {shard} of {shards}, "
                                  f"hashed={hash_ids is not None}")
        self.tables, self.specs = list(tables), list(specs)
        self.shard, self.shards, self.hash_ids = shard, shards, hash_ids
        self.lr_ratio = lr_ratio  # --table-lr / --lr: the tables' lr follows the schedule
        self.pulled = self.pushed = 0  # rows gathered for replies, rows applied

    def __len__(self) -> int:
        return len(self.tables)

    def check(self, segments: Sequence, finite: bool = True,
              creates: bool = True) -> Optional[tuple]:
        """(code, detail) when a message's row-sparse ``segments`` must be refused, else
        None: its rows and its ids are two sets, each checked by ``wire.sparse.check_rows``
        (a push that pulls asks back rows it also pushes), and an lfu table refuses more
        rows at once than it holds (the table's own check would come too late, after
        another table was written); ``creates`` False (an observer's pull, which creates
        nothing) lifts that bound."""
        for part in (rows_of(segments), ids_of(segments)):
            if not part:
                continue
            problem = check_rows(part, self.specs, self.shard, self.shards, self.hash_ids,
                                 finite=finite)
            if problem:
                return problem
            counts: dict = {}
            for seg in part:
                counts[seg.data.table] = counts.get(seg.data.table, 0) + seg.data.n
            for t, n in counts.items():
                kind, cap = self.tables[t].evict
                if creates and kind == "lfu" and n > cap:
                    return Code.TOO_LARGE, (f"{n} rows of table {t} in one message, above its "
                                            f"--evict lfu:{cap} (a worker's --local-steps H "
                                            "asks for the rows of H batches at once)")
        return None

    def values(self, segments: Sequence) -> list:
        """``[(table, ids, grads float32 [n, dim])]`` of a push's rows segments, one entry a
        table (its segments joined: one push is one step of the table's rule)."""
        joined: dict = {}
        for seg in rows_of(segments):
            data = seg.data
            joined.setdefault(data.table, ([], []))
            joined[data.table][0].append(data.ids)
            joined[data.table][1].append(data.values.to(torch.float32))
        return [(t, ids[0] if len(ids) == 1 else torch.cat(ids),
                 vals[0] if len(vals) == 1 else torch.cat(vals))
                for t, (ids, vals) in sorted(joined.items())]

    @staticmethod
    def squares(segments: Sequence) -> float:
        """The sum of squares of a push's row values (its share of the gradient norm)."""
        return sum(float(seg.data.values.double().pow(2).sum()) for seg in rows_of(segments))

    def apply(self, segments: Sequence, now: float, lr: float, lr_scale: float = 1.0) -> None:
        """One step of each table's rule, at ``lr`` (the shard's schedule) times ``lr_ratio``
        and ``lr_scale``, on the rows of a push's ``segments``, which ``check`` passed: the
        tables trust them, as checking again cost 0.30 of 1.11 ms a push of 4,096 rows x 16
        (fixed, sgd; 0.36 of 3.21 ms hashed, rowwise adagrad: experiments/sparse_apply.py)."""
        for t, ids, grads in self.values(segments):
            table = self.tables[t]
            table.rule.lr = lr * self.lr_ratio
            table.apply(ids, grads, now, lr_scale, checked=True)
            self.pushed += ids.numel()

    def gather(self, segments: Sequence, now: float, dtype: Optional[torch.dtype] = None,
               observer: bool = False) -> list:
        """The ``params`` reply's rows segments for a pull's checked ids ``segments``, in
        order, as ``dtype`` when asked. ``observer`` (the server's evaluator): rows not held
        come back as they would start, and nothing is created, touched or counted."""
        out = []
        for seg in ids_of(segments):
            table = self.tables[seg.data.table]
            ids = seg.data.ids
            values = table.peek(ids) if observer else table.gather(ids, now, checked=True)
            if not observer:
                self.pulled += ids.numel()
            out.append(rows_reply(seg, values, dtype))
        return out

    def expire(self, now: float) -> int:
        """ttl: the rows aged out at ``now`` in every table; how many."""
        return sum(table.expire(now) for table in self.tables)

    def stats(self) -> dict:
        """Per table (by name) rows held, created, evicted and bytes; rows pulled and pushed."""
        return {"tables": {spec.name: table.stats() for spec, table in
                           zip(self.specs, self.tables)},
                "rows_pulled": self.pulled, "rows_pushed": self.pushed}

    def state_dict(self) -> dict:
        return {"tables": [table.state_dict() for table in self.tables],
                "rows_pulled": self.pulled, "rows_pushed": self.pushed}

    def load_state_dict(self, state: Optional[dict], now: Optional[float] = None) -> None:
        saved = (state or {}).get("tables", [])
        if len(saved) != len(self.tables):
            raise ConfigError(f"checkpoint holds {len(saved)} sparse tables, this shard "
                              f"{len(self.tables)}: resume with the settings it was saved with "
                              "(--embeddings, the task's tables)")
        for table, table_state in zip(self.tables, saved):
            table.load_state_dict(table_state, now)
        self.pulled, self.pushed = int(state["rows_pulled"]), int(state["rows_pushed"])



# --table-optimizer auto: the sparse counterpart of each --optimizer
AUTO_RULES = {"sgd": "sgd", "momentum": "sgd", "nesterov": "sgd", "delayed-nesterov": "sgd",
              "adagrad": "adagrad", "adam": "lazy_adam"}


def table_rule(optimizer: str, table_optimizer: str) -> str:
    """The sparse rule (sparse_rules.SPARSE_RULES) of --table-optimizer, auto resolved."""
    if table_optimizer == "auto":
        return AUTO_RULES[optimizer]
    return table_optimizer.replace("-", "_")


def build_tables(specs: Sequence, shard: int, shards: int, id_space: str, evict: tuple,
                 rule: str, lr: float, seed: int, scales: Sequence,
                 initial: Optional[Sequence] = None) -> list:
    """Shard ``shard``'s ``SparseTable`` of each table in ``specs``: in a fixed id space
    holding ``initial`` (its rows ``weight[shard::shards]`` of the model's tables, so a
    server starts from the weights the other modes start from); in a hashed one empty,
    rows made on first touch, seeded per table, uniform within ``scales[t]``."""
    tables = []
    for t, spec in enumerate(specs):
        sparse = make_sparse_rule(rule, spec.dim, lr)
        if id_space == "fixed":
            tables.append(SparseTable(spec.dim, sparse, shard=shard, shards=shards,
                                      rows=spec.rows, evict=evict, init=initial[t]))
        else:
            tables.append(SparseTable(spec.dim, sparse, shard=shard, shards=shards,
                                      id_space="hashed", evict=evict, seed=(seed << 16) + t,
                                      init_scale=scales[t]))
    return tables
