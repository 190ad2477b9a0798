"""A collision-free map from int64 ids to row slots, held as a few sorted runs (log-structured),
so that a batch's lookups and insertions are vectorized and cost what the batch holds.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

# A new run is merged into the one before while that one is at most MERGE times its size,
# so runs shrink geometrically: at most log_MERGE(n / batch) + 1 of them, and each id is
# copied by about that many merges over its life. 4 against 2 and 8: see experiments/
# README.md, "Sparse tables: the id map's cost".
MERGE = 4
_MIN_CAPACITY = 1024  # entries (16 KiB) held by the smallest map


class IdMap:
    """Sorted runs of (int64 id, slot) in one buffer, the largest and oldest first.

    A removed id stays in its run as a tombstone (slot -1) until a merge drops it; an id is
    live in one run at most, so a lookup takes the one live hit of any run. When the
    tombstones pass half the live ids, every run is merged into one. Memory: 16 bytes an
    entry, entries at most 1.5 times the live ids (plus a batch), in a buffer grown by half
    and shrunk when an eighth of it is used.
    """

    def __init__(self, keys: torch.Tensor = None, slots: torch.Tensor = None):
        """An empty map, or one holding ``keys`` (sorted, unique int64) at ``slots``."""
        keys = torch.empty(0, dtype=torch.int64) if keys is None else keys
        slots = torch.empty(0, dtype=torch.int64) if slots is None else slots
        if keys.dtype != torch.int64 or slots.dtype != torch.int64 or keys.dim() != 1 or \
                keys.shape != slots.shape:
            raise ValueError("an id map takes int64 keys and slots of one length")
        if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
            raise ValueError("an id map's keys must be sorted and unique")
        if bool((slots < 0).any()):
            raise ValueError("an id map's slots must be >= 0")
        n = keys.numel()
        self._keys = torch.empty(max(n, _MIN_CAPACITY), dtype=torch.int64)
        self._slots = torch.empty_like(self._keys)
        self._keys[:n], self._slots[:n] = keys, slots
        self._ends: List[int] = [n] if n else []  # each run's end in the buffer
        self.live, self.dead = n, 0

    def __len__(self) -> int:
        return self.live

    def _runs(self) -> List[Tuple[int, int]]:
        return list(zip([0] + self._ends[:-1], self._ends))

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where the id has none."""
        out = torch.full_like(ids, -1)
        for a, b in self._runs():
            keys = self._keys[a:b]
            pos = torch.searchsorted(keys, ids).clamp_(max=b - a - 1)
            got = self._slots[a:b][pos]
            got.masked_fill_(keys[pos] != ids, -1)
            torch.maximum(out, got, out=out)  # one live hit at most; the rest are -1
        return out

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``ids`` (unique, none live yet) at ``slots`` (>= 0): a new run, then merges."""
        m = ids.numel()
        if not m:
            return
        order = torch.argsort(ids)
        end = self._ends[-1] if self._ends else 0
        self._reserve(end + m)
        self._keys[end:end + m], self._slots[end:end + m] = ids[order], slots[order]
        self._ends.append(end + m)
        self.live += m
        while len(self._ends) > 1 and self._size(-2) <= MERGE * self._size(-1):
            self._merge_last()

    def remove(self, ids: torch.Tensor) -> None:
        """Drop ``ids`` (each live): tombstones in their runs."""
        if not ids.numel():
            return
        for a, b in self._runs():
            keys = self._keys[a:b]
            pos = torch.searchsorted(keys, ids).clamp_(max=b - a - 1)
            hit = keys[pos] == ids
            self._slots[a + pos[hit]] = -1
        self.live -= ids.numel()
        self.dead += ids.numel()
        if 2 * self.dead > self.live:
            self.compact()

    def remap(self, moved: torch.Tensor) -> None:
        """Each live slot ``s`` becomes ``moved[s]`` (a table compacting its rows)."""
        self.compact()
        n = self.live
        self._slots[:n] = moved[self._slots[:n]]

    def compact(self) -> None:
        """Merge every run into one, dropping the tombstones; shrink a mostly empty buffer."""
        while len(self._ends) > 1:
            self._merge_last()
        if self.dead:  # one run left that holds tombstones
            keep = self._slots[:self._ends[0]] >= 0
            keys, slots = self._keys[:self._ends[0]][keep], self._slots[:self._ends[0]][keep]
            self._keys[:self.live], self._slots[:self.live] = keys, slots
            self._ends = [self.live] if self.live else []
            self.dead = 0
        capacity = self._keys.numel()
        if capacity > _MIN_CAPACITY and 8 * self.live <= capacity:
            self._resize(max(2 * self.live, _MIN_CAPACITY))

    def items(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(keys, slots): the live ids, sorted, and their slots (copies; the map unchanged)."""
        keys, slots = [], []
        for a, b in self._runs():
            live = self._slots[a:b] >= 0
            keys.append(self._keys[a:b][live])
            slots.append(self._slots[a:b][live])
        if not keys:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
        keys, slots = torch.cat(keys), torch.cat(slots)
        order = torch.argsort(keys)
        return keys[order], slots[order]

    def nbytes(self) -> int:
        """Bytes of the buffer, entries unused included."""
        return 2 * self._keys.numel() * 8

    # -- runs ---------------------------------------------------------------
    def _size(self, i: int) -> int:
        end = self._ends[i]
        start = self._ends[i - 1] if i - 1 >= -len(self._ends) else 0
        return end - start

    def _merge_last(self) -> None:
        """Merge the last two runs into one, dropping their tombstones: a linear merge."""
        a, b, c = (self._ends[-3] if len(self._ends) > 2 else 0), self._ends[-2], self._ends[-1]
        first = self._slots[a:b] >= 0
        second = self._slots[b:c] >= 0
        k1, s1 = self._keys[a:b][first], self._slots[a:b][first]
        k2, s2 = self._keys[b:c][second], self._slots[b:c][second]
        n, m = k1.numel(), k2.numel()
        self.dead -= (c - a) - (n + m)
        # each element's place in the merged run: its own index plus the other run's before it
        place = torch.searchsorted(k1, k2)
        at_new = a + place + torch.arange(m)
        # second-run ids before k1[i]: those placed at or before i (linear, not n searches)
        at_old = a + torch.arange(n) + torch.bincount(place, minlength=n + 1)[:n].cumsum(0)
        self._keys[at_old], self._keys[at_new] = k1, k2
        self._slots[at_old], self._slots[at_new] = s1, s2
        self._ends[-2:] = [a + n + m] if n + m else []

    def _reserve(self, entries: int) -> None:
        capacity = self._keys.numel()
        if entries > capacity:
            self._resize(max(entries, capacity + capacity // 2))

    def _resize(self, capacity: int) -> None:
        end = self._ends[-1] if self._ends else 0
        keys = torch.empty(capacity, dtype=torch.int64)
        slots = torch.empty_like(keys)
        keys[:end], slots[:end] = self._keys[:end], self._slots[:end]
        self._keys, self._slots = keys, slots
