"""Row-sparse segments: a push's rows of an embedding table, a sparse pull's ids and the
rows its ``params`` reply carries back (PROTOCOL.md, Row-sparse tables).

How senders make them and how a shard checks them against its tables before anything is
applied; the shard's table (servers.sparse_table) applies them.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy
import torch

from .layout import TableSpec, holds
from .protocol import (DTYPE_NAMES, MAX_SEGMENT_ROWS, MAX_SEGMENT_VALUES, WIRE_FLOATS, Code,
                       Rows, Segment, rows_bytes)

# A message's rows x dim, all its row-sparse segments together: what a sparse pull makes a
# shard allocate for its reply (64 MiB of float32), and a push's rows to check
MAX_MESSAGE_VALUES = 1 << 24


def rows_segment(table: int, ids: torch.Tensor, values: torch.Tensor,
                 dtype: str = "float32") -> Segment:
    """Rows ``values`` [n, dim] of ``ids`` (int64 [n]) of table ``table``, travelling as
    ``dtype`` (float32, bfloat16 or float16): one frame, ids then values."""
    if dtype not in WIRE_FLOATS:
        raise ValueError(f"rows travel as {', '.join(WIRE_FLOATS)}, not {dtype!r}")
    n, dim = values.shape
    if ids.dtype != torch.int64 or ids.shape != (n,):
        raise ValueError(f"ids must be int64 [{n}], got {ids.dtype} {tuple(ids.shape)}")
    payload = torch.empty(rows_bytes(n, dim, dtype), dtype=torch.uint8)
    payload[:8 * n] = ids.contiguous().view(torch.uint8)
    wire = values.detach().to(getattr(torch, dtype)).contiguous()
    payload[8 * n:] = wire.view(-1).view(torch.uint8)
    return Segment(table, Rows(table, n, dim, dtype, payload), transient=True)


def ids_segment(table: int, ids: torch.Tensor) -> Segment:
    """A sparse pull's request for the rows ``ids`` (int64, unique) of table ``table``."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"ids must be 1-D int64, got {ids.dtype} {tuple(ids.shape)}")
    payload = ids.contiguous().view(torch.uint8).clone()
    return Segment(table, Rows(table, len(ids), 0, "int64", payload), transient=True)


def rows_per_segment(dim: int) -> int:
    """The most rows of width ``dim`` one segment may carry."""
    return max(1, min(MAX_SEGMENT_ROWS, MAX_SEGMENT_VALUES // max(dim, 1)))


def split_rows(table: int, ids: torch.Tensor, values: Optional[torch.Tensor] = None,
               dtype: str = "float32") -> list:
    """Segments within the per-segment bounds covering ``ids`` (and their ``values``):
    rows when values are given, else a sparse pull's ids."""
    step = rows_per_segment(values.shape[1] if values is not None else 0)
    return [rows_segment(table, ids[i:i + step], values[i:i + step], dtype)
            if values is not None else ids_segment(table, ids[i:i + step])
            for i in range(0, len(ids), step)]


def apart(segments: Sequence) -> tuple:
    """``(dense, rows)``: a message's segments of the flat slice and its row-sparse ones."""
    dense = [seg for seg in segments if type(seg.data) is not Rows]
    return dense, [seg for seg in segments if type(seg.data) is Rows]


def check_rows(segments: Sequence, tables: Sequence[TableSpec], shard: int, shards: int,
               hash_ids: Optional[Callable] = None, finite: bool = True) -> Optional[tuple]:
    """(code, detail) when a push's rows or a pull's ids (``segments``: its row-sparse ones,
    ``apart``) must be refused, else None; from
    the descriptors first (nothing is scanned before the sizes are known to be bounded),
    then the ids (each in this shard's part of its table, unique across the message's
    segments of that table), then the values (finite). ``hash_ids``: the hashed id space's
    hash (``layout.holds``); ``finite`` False skips the NaN/Inf scan."""
    total = 0
    for seg in segments:
        data = seg.data
        if data.table >= len(tables):
            return Code.BAD_DESCRIPTOR, (f"table {data.table} of a model with "
                                         f"{len(tables)} tables")
        want = tables[data.table].dim
        if data.dim and data.dim != want:
            return Code.BAD_FIELD, (f"rows of table {data.table} are [n, {want}], not "
                                    f"[{data.n}, {data.dim}]")
        total += data.n * want
    if total > MAX_MESSAGE_VALUES:
        return Code.TOO_LARGE, (f"{total} row values in one message, above "
                                f"{MAX_MESSAGE_VALUES}: split it")
    if not segments:
        return None
    # one pass of torch ops over the message's ids, whatever its segments: per segment,
    # ctr's 26 tables made this check 46% of a shard's time (py-spy, 2 workers)
    ids = _joined([seg.data.ids for seg in segments])
    named = [seg.data.table for seg in segments]
    one = named.count(named[0]) == len(named)  # one table (ctr:tables=1): no table column
    counts = None if one else torch.tensor([seg.data.n for seg in segments])
    table_of = None if one else torch.repeat_interleave(torch.tensor(named), counts)
    bound = tables[named[0]].rows if one or hash_ids is not None else torch.repeat_interleave(
        torch.tensor([tables[t].rows for t in named]), counts)
    # one shard of a fixed table holds exactly the ids in range (``within``, one op); the
    # mask, of several ops, is built for the others, or to name an id out of range
    if one and shards == 1 and hash_ids is None and within(ids, bound):
        mine = None
    else:
        mine = holds(ids, shard, shards, bound, hash_ids)
    if mine is not None and not bool(mine.all()):
        at = int((~mine).nonzero()[0])
        table = named[0] if one else int(table_of[at])
        where = "" if hash_ids is not None else f" in [0, {tables[table].rows}) with id % " \
            f"{shards} == {shard}"
        return Code.OUT_OF_RANGE, (f"id {int(ids[at])} of table {table} is not shard "
                                   f"{shard}'s{where}")
    if len(ids) > 1 and one:
        ids_s = sorted_ids(ids)
        twin = ids_s[1:] == ids_s[:-1]
        if bool(twin.any()):
            return Code.BAD_FIELD, (f"id {int(ids_s[:-1][twin][0])} of table {named[0]} "
                                    "appears twice; ids in one message must be unique")
    elif len(ids) > 1:
        # sorted by (table, id): a duplicate within a table lies next to its twin
        ids_s, tab_s = by_table(ids, table_of)
        twin = (ids_s[1:] == ids_s[:-1]) & (tab_s[1:] == tab_s[:-1])
        if bool(twin.any()):
            at = int(twin.nonzero()[0])
            return Code.BAD_FIELD, (f"id {int(ids_s[at])} of table {int(tab_s[at])} appears "
                                    "twice; ids in one message must be unique")
    if finite:
        values = [seg.data.values for seg in segments if seg.data.dim]
        if values and not bool(torch.isfinite(_joined([v.reshape(-1).float()
                                                       for v in values])).all()):
            bad = next(seg for seg in segments if seg.data.dim and
                       not bool(torch.isfinite(seg.data.values).all()))
            return Code.NON_FINITE, (f"rows of table {bad.data.table} hold NaN or Inf "
                                     "values; nothing was applied")
    return None


# numpy sorts, not torch: on one thread torch's CPU sort of int64 is slow. 26,624 ids (a
# ctr batch of 1,024): a sort 73 against 1,143 us, by_table 342 against 2,332; 832 ids (a
# batch of 32): 2.6 against 6.2 and 12 against 27 (experiments/README.md, "Sparse tables:
# a step's fixed costs")


def sorted_ids(ids: torch.Tensor) -> torch.Tensor:
    """int64 ``ids`` (on the CPU) sorted ascending, a copy."""
    return torch.from_numpy(numpy.sort(ids.numpy()))


def unique_ids(ids: torch.Tensor) -> torch.Tensor:
    """int64 ``ids`` (on the CPU) without repeats, sorted ascending: ``torch.unique``'s."""
    ids_s = numpy.sort(ids.numpy())
    if len(ids_s) > 1:
        ids_s = ids_s[numpy.concatenate(([True], ids_s[1:] != ids_s[:-1]))]
    return torch.from_numpy(ids_s)


def within(ids: torch.Tensor, rows: int) -> bool:
    """Whether every one of ``ids`` is in [0, ``rows``): by the least and the greatest, in
    one op (the shard's check, the worker's of one table: 1.9 against 15.8 us for 650 ids by
    a mask)."""
    if not len(ids):
        return True
    low, high = torch.aminmax(ids)
    return int(low) >= 0 and int(high) < rows


def by_table(ids: torch.Tensor, table_of: torch.Tensor) -> tuple:
    """``(ids, table_of)`` sorted by table, then by id within a table, whatever the number of
    tables (the shard's duplicate check, the worker's unique ids): by id, then stably by
    table (a radix sort where the table numbers fit 16 bits)."""
    i, t = ids.numpy(), table_of.numpy()
    order = numpy.argsort(i)
    key = t[order]
    if len(key) and int(key.max()) < 2 ** 15:
        key = key.astype(numpy.int16)
    order = order[numpy.argsort(key, kind="stable")]
    return torch.from_numpy(i[order]), torch.from_numpy(t[order])


def _joined(parts: list) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def widened(seg: Segment) -> tuple:
    """``(table, ids, values)`` of a rows segment, values as float32 [n, dim] (a bf16 or
    fp16 one widened, a float32 one a view of the frame)."""
    data = seg.data
    return data.table, data.ids, data.values.to(torch.float32)


def rows_reply(asked: Segment, values: torch.Tensor, dtype: Optional[torch.dtype] = None
               ) -> Segment:
    """The ``params`` reply's segment for the ids ``asked`` (a sparse pull's segment): those
    ids, in their order, with ``values`` [n, dim] (float32, sent as ``dtype`` when the pull
    asked ``pull_dtype``)."""
    name = DTYPE_NAMES[dtype] if dtype is not None else "float32"
    return rows_segment(asked.data.table, asked.data.ids, values, name)


def reply_mismatch(asked: Sequence, got: Sequence, tables: Sequence[TableSpec]) -> str:
    """Why the rows segments ``got`` of a ``params`` reply are not exactly the rows ``asked``
    (a sparse pull's segments, in order: the same tables and ids, each row of its table's
    dim), or '' when they are: a worker copies nothing of a reply that fails."""
    if len(got) != len(asked):
        return f"{len(got)} rows segments for {len(asked)} asked"
    for j, (want, seg) in enumerate(zip(asked, got)):
        data = seg.data
        if type(data) is not Rows or not data.dim:
            return f"segment {j} of the reply is not rows"
        if data.table != want.data.table or data.n != want.data.n:
            return f"segment {j} holds other rows than asked of table {want.data.table}"
        if data.table >= len(tables) or data.dim != tables[data.table].dim:
            return f"segment {j}'s rows are {data.dim} wide, not the table's"
    # the ids of every segment in one comparison (one per segment cost 2.5% of a step)
    if got and not torch.equal(_joined([seg.data.ids for seg in got]),
                               _joined([seg.data.ids for seg in asked])):
        j = next(j for j, (want, seg) in enumerate(zip(asked, got))
                 if not torch.equal(seg.data.ids, want.data.ids))
        return f"segment {j} holds other rows than asked of table {asked[j].data.table}"
    return ""
