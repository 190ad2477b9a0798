"""A worker's same-host areas: one shared mapping per shard, or None where tensors go as frames.

The worker side of ``asyncsgd.wire.shared``: which shards to attach to, how many tries a shard
gets, mapping what a shard's ``attach`` answer names, and letting every mapping go on close.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from asyncsgd.wire.protocol import Key
from asyncsgd.wire.shared import Area, AreaUnavailable

log = logging.getLogger(__name__)

ATTACH_TRIES = 3  # failed attaches to a shard in a row: past that, frames for good


class SharedAreas:
    """``areas[i]``: shard ``i``'s mapped area, or None. ``insist`` (``--transport shared``):
    a shard that cannot be attached to is an error, not a fall-back to frames."""

    def __init__(self, shards: int, insist: bool = False):
        self.insist = insist
        self._areas: list = [None] * shards
        self.slots = [self._slot(i) for i in range(shards)]  # made once: the hot path's decode
        self._tries = [0] * shards
        self.pending: set = set()  # shards still to attach to

    def __getitem__(self, i: int) -> Optional[Area]:
        return self._areas[i]

    def __iter__(self):
        return iter(self._areas)

    def __len__(self) -> int:
        return len(self._areas)

    def want_all(self) -> None:
        """Attach to every shard before the next exchange."""
        self.pending = set(range(len(self._areas)))

    def attach_pending(self, attach: Callable[[int], Optional[str]]) -> Optional[str]:
        """Attach to each pending shard by ``attach(i)`` (None when mapped, else why not);
        frames where none comes. Insisting: why a shard could not be had, else None."""
        for i in sorted(self.pending):
            self.pending.discard(i)
            why = f"{ATTACH_TRIES} attaches in a row failed"
            while self._tries[i] < ATTACH_TRIES:  # auto: one try now, more later
                self._tries[i] += 1
                why = attach(i)
                if why is None or not self.insist:
                    break
            if why is None:
                self._tries[i] = 0  # counts failures in a row
                continue
            if self.insist:
                return why
            log.info("shard %d: tensors go over TCP (%s)", i, why)
        return None

    def map(self, i: int, meta: dict) -> Optional[str]:
        """Map the area shard ``i``'s ``attach`` answer names; None when done, else why not."""
        try:
            self._areas[i] = Area.open(meta.get(Key.PID), meta.get(Key.FD), meta.get(Key.LINK),
                                       meta.get(Key.ELEMENTS), bytes.fromhex(meta.get(Key.TAG)))
        except (AreaUnavailable, TypeError, ValueError) as exc:
            return f"its area could not be mapped: {exc}"
        return None

    def _slot(self, i: int):
        """Resolves a reply's area link to shard ``i``'s parameter slot (``decode``)."""
        def slot(link: int, _worker: str, _incarnation: int):
            area = self._areas[i]
            return area.params if area is not None and area.link == link else None
        return slot

    def drop(self, i: int, why: str) -> None:
        """Shard ``i`` no longer knows our area (restarted, or it evicted it): frames now,
        and attach again before the next exchange."""
        if self._areas[i] is not None:
            log.info("shard %d: shared area gone (%s); frames until attached again", i, why)
        self._areas[i] = None
        self.pending.add(i)

    def close(self) -> None:
        """Let every mapping go: each is unmapped once no tensor views it any more."""
        for area in self._areas:
            if area is not None:
                area.close()
        self._areas = [None] * len(self._areas)
