"""One shard's part of a row-sparse embedding table, as a plain object: pulls gather the rows
asked, pushes apply a sparse rule to the rows named, and in a hashed id space rows are
created on first touch and evicted (--evict ttl:SECONDS or lfu:ROWS) to bound memory.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from asyncsgd.core.sparse_ids import seeded_rows, shard_of
from asyncsgd.errors import ConfigError
from asyncsgd.wire.protocol import Code, ProtocolError

from .id_map import IdMap
from .sparse_rules import SparseRule

ID_SPACES = ("fixed", "hashed")
_GROW_FROM = 1024  # first capacity of a hashed table, in rows
_INIT_CHUNK = 1 << 16  # rows made at once by a fixed table's seeded init


class RowsRefused(ProtocolError):
    """A pull or push of rows the table refuses; checked before anything changed, so the
    shard answers it as any malformed request (``code``, ``detail``)."""


class SparseTable:
    """The rows of ``shards``' table that shard ``shard`` holds, float32 [rows, dim].

    ``fixed``: ids [0, ``rows``) with ``id % shards == shard``, at local row ``id // shards``.
    ``hashed``: any int64 id with ``hash_id(id) % shards == shard``, kept in slots found
    through an ``IdMap``; a row is created on first touch (a pull or a push) with
    ``seeded_rows``, and slots freed by eviction are reused. Ids in one pull or push must
    be unique (the worker dedups), else the whole request is refused. ``now`` is the
    shard's clock (monotonic seconds), by which ttl ages rows.
    """

    def __init__(self, dim: int, rule: SparseRule, *, shard: int = 0, shards: int = 1,
                 id_space: str = "fixed", rows: int = 0, evict: tuple = ("none", 0),
                 seed: int = 0, init_scale: float = 0.01, init: Optional[torch.Tensor] = None):
        if id_space not in ID_SPACES:
            raise ConfigError(f"--id-space {id_space!r}: use fixed or hashed")
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not in [0, {shards})")
        if rule.dim != dim:
            raise ValueError(f"the rule is for rows of {rule.dim}, the table's are {dim}")
        self.dim, self.rule, self.shard, self.shards = dim, rule, shard, shards
        self.hashed, self.n, self.evict = id_space == "hashed", rows, evict
        self.seed, self.init_scale = seed, init_scale
        self.created = self.evictions = 0
        self.clock = 0.0
        if self.hashed:
            if rows:
                raise ConfigError("--id-space hashed takes no row count: rows are created "
                                  "on first touch")
            self.map = IdMap()
            self._resize(0)
            self._requeue()
            return
        if evict[0] != "none":
            raise ConfigError(f"--evict {evict[0]} needs --id-space hashed: a fixed id space "
                              "holds every row from the start")
        if rows < 1:
            raise ConfigError(f"a fixed id space needs rows >= 1, got {rows}")
        local = max(0, (rows - shard + shards - 1) // shards)
        ids = shard + shards * torch.arange(local, dtype=torch.int64)
        if init is not None and tuple(init.shape) != (local, dim):
            raise ValueError(f"init must be [{local}, {dim}] (this shard's rows), "
                             f"got {tuple(init.shape)}")
        if init is not None:
            self.weight = init.to(torch.float32).clone()
        else:
            self.weight = torch.empty(local, dim, dtype=torch.float32)
            # in chunks: seeded_rows' int64 temporaries are 4x to 8x the rows they make
            for at in range(0, local, _INIT_CHUNK):
                self.weight[at: at + _INIT_CHUNK] = seeded_rows(
                    ids[at: at + _INIT_CHUNK], dim, seed, init_scale)
        self.rule.resize(local)
        self.created = local

    # -- pulls and pushes -------------------------------------------------
    def gather(self, ids: torch.Tensor, now: float = 0.0, checked: bool = False
               ) -> torch.Tensor:
        """float32 [len(ids), dim]: the rows of ``ids`` (unique), in their order, a copy;
        ``checked`` as for ``apply``."""
        if not checked:
            self._check(ids)
        slots = self._slots(ids, now)  # first: creating rows may grow ``weight``
        return self.weight[slots]

    def peek(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), dim]: the rows of ``ids`` (unique) as they are, a row not held
        as it would start; nothing is created, touched or evicted (an observer's read)."""
        self._check(ids, creates=False)
        if not self.hashed:
            return self.weight[ids // self.shards]
        slots = self.map.find(ids)
        out = seeded_rows(ids, self.dim, self.seed, self.init_scale)
        held = slots >= 0
        out[held] = self.weight[slots[held]]
        return out

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, now: float = 0.0,
              lr_scale: float = 1.0, checked: bool = False) -> None:
        """One step of the rule on the rows ``ids`` (unique) with ``grads`` [len(ids), dim].
        ``checked``: the caller already made this table's checks (``ShardTables.check``: ids
        in range, this shard's, unique; rows finite, float32 [len(ids), dim]; lfu's bound),
        so they are not made twice."""
        if not checked:
            self._check(ids, grads)
        slots = self._slots(ids, now)  # first: creating rows may grow ``weight``
        self.rule.apply(self.weight, slots, grads, lr_scale)

    def expire(self, now: float) -> int:
        """Evict the rows ttl has aged out at ``now`` (the shard's tick); how many."""
        self.clock = max(self.clock, now)
        if not self.hashed or self.evict[0] != "ttl":
            return 0
        stale = self._aged(now)
        self._drop(stale)
        capacity = self.weight.shape[0]
        if stale.numel() and capacity > _GROW_FROM and 4 * len(self) <= capacity:
            self._compact()
        return stale.numel()

    # -- checks -----------------------------------------------------------
    def _check(self, ids, grads=None, creates: bool = True) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise RowsRefused(Code.BAD_DTYPE, "ids must be a 1-D int64 tensor")
        n = ids.numel()
        if grads is not None:
            if not isinstance(grads, torch.Tensor) or grads.dtype != torch.float32:
                raise RowsRefused(Code.BAD_DTYPE, "row gradients must be a float32 tensor")
            if grads.dim() != 2 or grads.shape[1] != self.dim:
                raise RowsRefused(Code.BAD_FIELD, f"row gradients must be [n, {self.dim}], "
                                                  f"got {tuple(grads.shape)}")
            if grads.shape[0] != n:
                raise RowsRefused(Code.LENGTH_MISMATCH, f"{n} ids but {grads.shape[0]} rows "
                                                        "of gradients")
            if n == 0:
                raise RowsRefused(Code.BAD_FIELD, "an empty push of rows")
            if not bool(torch.isfinite(grads).all()):
                raise RowsRefused(Code.NON_FINITE, "row gradients hold NaN or infinity")
        if not self.hashed:
            bad = (ids < 0) | (ids >= self.n)
            if bool(bad.any()):
                raise RowsRefused(Code.OUT_OF_RANGE, f"id {int(ids[bad][0])} is outside "
                                                     f"[0, {self.n})")
        mine = shard_of(ids, self.shards, self.hashed) == self.shard
        if not bool(mine.all()):
            stray = int(ids[~mine][0])
            raise RowsRefused(Code.OUT_OF_RANGE, f"id {stray} belongs to shard "
                                                 f"{shard_of(stray, self.shards, self.hashed)}, "
                                                 f"not {self.shard}")
        if torch.unique(ids).numel() != n:
            uniq, counts = torch.unique(ids, return_counts=True)
            raise RowsRefused(Code.BAD_FIELD, f"id {int(uniq[counts > 1][0])} appears twice; "
                                              "ids in one request must be unique")
        if creates and self.hashed and self.evict[0] == "lfu" and n > self.evict[1]:
            raise RowsRefused(Code.TOO_LARGE, f"{n} rows asked at once, above lfu's "
                                              f"{self.evict[1]} rows")

    # -- slots of a hashed table -----------------------------------------
    def _slots(self, ids: torch.Tensor, now: float) -> torch.Tensor:
        if not self.hashed:
            return ids // self.shards
        self.expire(now)
        slots = self.map.find(ids)
        new = slots < 0
        if bool(new.any()):
            slots[new] = self._create(ids[new], keep=slots[~new])
        self.touched[slots] = now
        self.uses[slots] += 1
        if self.evict[0] == "ttl":
            self._queue(slots, now)
        return slots

    def _create(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Slots for new ``ids``, freshly initialized; lfu first evicts rows not in ``keep``."""
        m = ids.numel()
        if self.evict[0] == "lfu":
            over = len(self) + m - self.evict[1]
            if over > 0:  # a linear selection over the rows held, at most lfu's ROWS
                spare = self.used.clone()
                spare[keep] = False
                self._drop(self._least_used(spare.nonzero().flatten(), over))
        if self.free_count < m:
            cap = max(2 * self.weight.shape[0], len(self) + m, _GROW_FROM)
            if self.evict[0] == "lfu":
                cap = min(cap, self.evict[1])
            self._resize(cap)
        # the top of the free stack, lowest slot first (a fresh stack is descending)
        self.free_count -= m
        slots = self.free[self.free_count:self.free_count + m].flip(0)
        self.weight[slots] = seeded_rows(ids, self.dim, self.seed, self.init_scale)
        self.rule.reset(slots)
        self.ids_at[slots], self.used[slots] = ids, True
        self.uses[slots] = 0
        self.map.insert(ids, slots)
        self.created += m
        return slots

    # -- ttl's queue of touches, oldest first --------------------------------
    def _queue(self, slots: torch.Tensor, now: float) -> None:
        """Append a touch of ``slots`` at ``now``: ttl then finds the rows it ages out
        among the oldest touches, not by a scan of every row."""
        head, tail, cap = self._q_head, self._q_tail, self._q_slot.numel()
        n, m = tail - head, slots.numel()
        if now < self._q_last or n + m > 2 * len(self) + _GROW_FROM:
            # a clock that went back (the queue would be unsorted), or touches of rows
            # touched again since that outnumber the rows: rebuilt from the rows held
            self._requeue()
            return
        if tail + m > cap:
            grown = cap if 2 * (n + m) <= cap else max(2 * cap, n + m)
            self._q_slot = _grown(self._q_slot[head:tail], (grown,), torch.int64)
            self._q_time = _grown(self._q_time[head:tail], (grown,), torch.float64)
            head, tail = 0, n
        self._q_slot[tail:tail + m], self._q_time[tail:tail + m] = slots, now
        self._q_head, self._q_tail, self._q_last = head, tail + m, now

    def _requeue(self) -> None:
        """The queue made anew: each row held, by its last touch (ties by slot)."""
        ttl = self.evict[0] == "ttl"  # other tables keep no queue
        held = self.used.nonzero().flatten() if ttl else self.ids_at[:0]
        times, order = torch.sort(self.touched[held], stable=True)
        size = max(2 * held.numel(), _GROW_FROM) if ttl else 0
        self._q_slot = _grown(held[order], (size,), torch.int64)
        self._q_time = _grown(times, (size,), torch.float64)
        self._q_head, self._q_tail = 0, held.numel()
        self._q_last = float(times[-1]) if held.numel() else -math.inf

    def _aged(self, now: float) -> torch.Tensor:
        """The slots (ascending) of the rows untouched for more than ttl at ``now``, their
        touches taken off the queue: those rows' last touches are its oldest entries."""
        ttl = self.evict[1]
        times = self._q_time[self._q_head:self._q_tail]
        # a bound above the ages' boundary (float rounding), then the exact test on the prefix
        near = int(torch.searchsorted(times, now - ttl + 1e-9 * (abs(now) + ttl + 1.0),
                                      right=True))
        count = int((now - times[:near] > ttl).sum())
        slots = torch.unique(self._q_slot[self._q_head:self._q_head + count])
        self._q_head += count
        return slots[self.used[slots] & (now - self.touched[slots] > ttl)]

    def _least_used(self, candidates: torch.Tensor, count: int) -> torch.Tensor:
        """``count`` of ``candidates`` (ascending slots): the least used, ties by oldest touch,
        then by lowest slot; selections in linear time, as a full sort of a large table
        cost more than the rest of a push."""
        below, tied = _smallest(candidates, self.uses[candidates], count)
        count -= below.numel()
        older, tied = _smallest(tied, self.touched[tied], count)
        return torch.cat([below, older, tied[:count - older.numel()]])

    def _drop(self, slots: torch.Tensor) -> None:
        if not slots.numel():
            return
        self.map.remove(self.ids_at[slots])
        self.used[slots] = False
        self.free[self.free_count:self.free_count + slots.numel()] = slots.flip(0)
        self.free_count += slots.numel()
        self.evictions += slots.numel()

    def _compact(self) -> None:
        """Move the rows held to the first slots and shrink to twice their number: memory
        follows the rows in use after ttl has aged out a burst."""
        keep = self.used.nonzero().flatten()
        rows = max(2 * keep.numel(), _GROW_FROM)
        moved = torch.full((self.weight.shape[0],), -1, dtype=torch.int64)
        moved[keep] = torch.arange(keep.numel())
        self.map.remap(moved)
        self.rule.compact(keep, rows)
        for name in ("weight", "ids_at", "used", "touched", "uses"):
            old = getattr(self, name)
            new = torch.zeros((rows,) + tuple(old.shape[1:]), dtype=old.dtype)
            new[:keep.numel()] = old[keep]
            setattr(self, name, new)
        self.free = _grown(_descending(keep.numel(), rows), (rows,), torch.int64)
        self.free_count = rows - keep.numel()
        self._requeue()

    def _resize(self, rows: int) -> None:
        old = getattr(self, "weight", None)
        held = 0 if old is None else old.shape[0]
        self.free = _grown(getattr(self, "free", None), (rows,), torch.int64)
        count = getattr(self, "free_count", 0)
        # the new slots go below the free ones (taken after them), the lowest on top
        self.free[rows - held:rows - held + count] = self.free[:count].clone()
        self.free[:rows - held] = _descending(held, rows)
        self.free_count = count + rows - held
        self.weight = _grown(old, (rows, self.dim), torch.float32)
        self.ids_at = _grown(getattr(self, "ids_at", None), (rows,), torch.int64)
        self.used = _grown(getattr(self, "used", None), (rows,), torch.bool)
        self.touched = _grown(getattr(self, "touched", None), (rows,), torch.float64)
        self.uses = _grown(getattr(self, "uses", None), (rows,), torch.int64)
        self.rule.resize(rows)

    # -- figures and checkpoints -------------------------------------------
    def __len__(self) -> int:
        return len(self.map) if self.hashed else self.weight.shape[0]

    def nbytes(self) -> int:
        """Bytes held: rows, optimizer state, and (hashed) the id map and slot bookkeeping."""
        held = [self.weight] + ([self.ids_at, self.used, self.touched, self.uses, self.free,
                                 self._q_slot, self._q_time] if self.hashed else [])
        extra = self.map.nbytes() if self.hashed else 0
        return sum(t.numel() * t.element_size() for t in held) + self.rule.nbytes() + extra

    def stats(self) -> dict:
        return {"rows": len(self), "bytes": self.nbytes(), "created": self.created,
                "evictions": self.evictions}

    def state_dict(self) -> dict:
        """Rows, rule state, id map and counters: tensors, ints, floats and strings only."""
        out = {"id_space": "hashed" if self.hashed else "fixed", "dim": self.dim,
               "shard": self.shard, "shards": self.shards, "rows": self.n,
               "weight": self.weight.clone(), "rule": self.rule.state_dict(),
               "created": self.created, "evictions": self.evictions, "clock": self.clock}
        if self.hashed:
            keys, slots = self.map.items()
            out.update(ids_at=self.ids_at.clone(), used=self.used.clone(),
                       touched=self.touched.clone(), uses=self.uses.clone(),
                       map_keys=keys, map_slots=slots,
                       free=self.free[:self.free_count].clone())
        return out

    def load_state_dict(self, state: dict, now: Optional[float] = None) -> None:
        """Continue from ``state``. With ``now`` (a restarted shard's clock), ages carry over:
        each row is as long untouched at ``now`` as it was when saved."""
        mine = ("hashed" if self.hashed else "fixed", self.dim, self.shard, self.shards, self.n)
        saved = tuple(state.get(k) for k in ("id_space", "dim", "shard", "shards", "rows"))
        if saved != mine:
            raise ConfigError(f"checkpoint of a sparse table (id space, dim, shard, shards, "
                              f"rows) {saved} does not fit this one {mine}")
        weight = state["weight"]
        if weight.dtype != torch.float32 or tuple(weight.shape[1:]) != (self.dim,):
            raise ConfigError(f"checkpoint rows are {weight.dtype} {tuple(weight.shape)}, "
                              f"not float32 [rows, {self.dim}]")
        held = {k: t.shape[0] for k, t in state["rule"]["state"].items()}
        if any(rows != weight.shape[0] for rows in held.values()):
            raise ConfigError(f"checkpoint's optimizer state rows {held} do not match its "
                              f"{weight.shape[0]} table rows")
        self.rule.load_state_dict(state["rule"])
        self.weight = weight.clone()
        self.created, self.evictions = int(state["created"]), int(state["evictions"])
        self.clock = float(state["clock"])
        if self.hashed:
            self.ids_at, self.used = state["ids_at"].clone(), state["used"].clone()
            self.touched, self.uses = state["touched"].clone(), state["uses"].clone()
            self.map = IdMap(state["map_keys"].clone(), state["map_slots"].clone())
            rows = self.weight.shape[0]
            # a checkpoint from before the free stack: the free slots, lowest taken first
            free = state["free"] if "free" in state else \
                (~self.used).nonzero().flatten().flip(0)
            if free.numel() + len(self.map) != rows:
                raise ConfigError(f"checkpoint holds {len(self.map)} ids and {free.numel()} "
                                  f"free slots for {rows} rows")
            self.free, self.free_count = _grown(free, (rows,), torch.int64), free.numel()
            if now is not None:
                self.touched += now - self.clock
                self.clock = now
            self._requeue()


def _smallest(items: torch.Tensor, keys: torch.Tensor, count: int) -> tuple:
    """The ``items`` whose keys are below the ``count``-th smallest key, and those at it."""
    if count <= 0:
        return items[:0], items[:0]
    kth = torch.kthvalue(keys, count).values
    return items[keys < kth], items[keys == kth]


def _descending(low: int, high: int) -> torch.Tensor:
    """Slots ``high - 1`` down to ``low``: a free stack whose top is the lowest."""
    return torch.arange(high - 1, low - 1, -1, dtype=torch.int64)


def _grown(old: Optional[torch.Tensor], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    new = torch.zeros(shape, dtype=dtype)
    if old is not None:
        keep = min(shape[0], old.shape[0])
        new[:keep] = old[:keep]
    return new
