"""The same-host path: a push's gradient and a reply's parameters in a shared memory area, only
the headers over the socket.

Saves a socket's copies where worker and shard share a host; the rules (sealed memfd areas,
checks, one per worker incarnation) are PROTOCOL.md's "Same host", the figures
experiments/README.md's "Same-host areas".
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
from dataclasses import dataclass, field
from typing import Optional

import torch

log = logging.getLogger(__name__)

HEADER_BYTES = 4096  # one page: the tag, and page-aligned slots after it
TAG_BYTES = 16
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(
    fcntl, "F_SEAL_SHRINK") else 0


def supported() -> bool:
    """Whether this platform has sealed memory files (Linux with Python >= 3.8)."""
    return SEALS != 0 and hasattr(os, "memfd_create")


class AreaUnavailable(Exception):
    """An area could not be made or mapped here; the worker stays on frames."""


@dataclass
class Area:
    """One worker's slots in one shard: ``grads`` (worker writes) and ``params`` (shard
    writes), float32 tensors of the shard's slice, views of one shared mapping."""

    link: int
    elements: int
    grads: torch.Tensor
    params: torch.Tensor
    mapping: mmap.mmap = field(repr=False)
    fd: int = -1  # the shard's descriptor, open while the area lives (workers map through it)
    tag: bytes = b""
    worker: str = ""
    incarnation: int = 0

    @classmethod
    def create(cls, link: int, elements: int, worker: str = "", incarnation: int = 0) -> "Area":
        """A new sealed area for ``elements`` float32 values per slot (in the shard)."""
        if not supported():
            raise AreaUnavailable("sealed memory files (memfd) are not available here")
        size = _size(elements)
        fd = os.memfd_create(f"asyncsgd-area-{link}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise AreaUnavailable(f"cannot make a shared area of {size} bytes: {exc}") from exc
        tag = secrets.token_bytes(TAG_BYTES)
        mapping[:TAG_BYTES] = tag
        return cls._of(mapping, link, elements, fd=fd, tag=tag, worker=worker,
                       incarnation=incarnation)

    @classmethod
    def open(cls, pid: int, fd: int, link: int, elements: int, tag: bytes) -> "Area":
        """Map the area shard process ``pid`` made (in the worker); checked, or
        ``AreaUnavailable`` saying why not."""
        path = f"/proc/{pid}/fd/{fd}"
        try:
            own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise AreaUnavailable(f"cannot open {path}: {exc.strerror} (another host, pid "
                                  "namespace or user)") from exc
        try:
            size = os.fstat(own).st_size
            if size != _size(elements):
                raise AreaUnavailable(f"{path} holds {size} bytes, not {_size(elements)}: "
                                      "not the area the shard announced")
            if SEALS and fcntl.fcntl(own, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise AreaUnavailable(f"{path} is not sealed: not an area a shard made")
            mapping = mmap.mmap(own, size)
        except OSError as exc:
            raise AreaUnavailable(f"cannot map {path}: {exc.strerror}") from exc
        finally:
            os.close(own)
        if len(tag) != TAG_BYTES or mapping[:TAG_BYTES] != tag:
            mapping.close()
            raise AreaUnavailable(f"{path} does not hold the tag the shard announced")
        return cls._of(mapping, link, elements, tag=tag)

    @classmethod
    def _of(cls, mapping: mmap.mmap, link: int, elements: int, **kw) -> "Area":
        slot = _slot(elements)
        whole = torch.frombuffer(mapping, dtype=torch.float32)
        first = HEADER_BYTES // 4
        return cls(link=link, elements=elements, mapping=mapping,
                   grads=whole[first:first + elements],
                   params=whole[first + slot // 4:first + slot // 4 + elements], **kw)

    def close(self) -> None:
        """Give the descriptor back; the memory goes once no tensor views it any more."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError as exc:
                if exc.errno != errno.EBADF:
                    raise
            self.fd = -1


def _slot(elements: int) -> int:
    """Bytes of one slot, rounded up to whole pages."""
    return -(-elements * 4 // mmap.PAGESIZE) * mmap.PAGESIZE


def _size(elements: int) -> int:
    return HEADER_BYTES + 2 * _slot(elements)


class Areas:
    """A shard's areas, by link number: at most ``limit``, one per (worker, incarnation);
    past the limit the least recently used goes (its worker is told ``unknown-link`` and
    attaches again or stays on frames)."""

    def __init__(self, elements: int, limit: int):
        self.elements, self.limit = elements, limit
        self.by_link: dict = {}  # link -> Area, least recently used first
        self.by_peer: dict = {}  # routing id -> link, for replies
        self._next = 1
        self.made = 0
        self.dropped = 0
        # bytes of tensors moved through the areas (pushes in, parameters out): traffic
        # that crosses no socket, so a report can say what the wire's count leaves out
        self.moved = 0
        self._lent = False  # grads_of gave the message being decoded a slot

    def attach(self, worker: str, incarnation: int, peer: bytes) -> Area:
        """A fresh area for ``worker``'s incarnation (replacing one it had)."""
        for link, area in list(self.by_link.items()):
            if area.worker == worker:
                self._drop(link)
        while len(self.by_link) >= self.limit:
            self._drop(next(iter(self.by_link)))
            self.dropped += 1
        area = Area.create(self._next, self.elements, worker, incarnation)
        self._next += 1
        self.made += 1
        self.by_link[area.link] = area
        self.by_peer[peer] = area.link
        return area

    def grads_of(self, link: int, worker: str, incarnation: int, peer: bytes
                 ) -> Optional[torch.Tensor]:
        """The gradient slot of ``link`` when it belongs to this worker and incarnation."""
        area = self.by_link.get(link)
        if area is None or (area.worker, area.incarnation) != (worker, incarnation):
            return None
        self.by_link[link] = self.by_link.pop(link)  # most recently used
        self._lent = True
        if self.by_peer.get(peer) != link:  # a reconnected worker: replies go to its new id
            self._forget_peers(link)
            self.by_peer[peer] = link
        return area.grads

    def received(self, msg) -> None:
        """Count the tensors of ``msg``, just decoded, when they came through an area."""
        if self._lent:
            self.moved += tensor_bytes(msg)
        self._lent = False

    def sent(self, msg) -> None:
        """Count the tensors of ``msg``, just written into an area."""
        self.moved += tensor_bytes(msg)

    def for_peer(self, peer: bytes) -> Optional[Area]:
        """The area replies to ``peer`` are written to, if it has one."""
        link = self.by_peer.get(peer)
        return None if link is None else self.by_link.get(link)

    def drop_worker(self, worker: str) -> None:
        """``worker`` said goodbye: its areas go."""
        for link, area in list(self.by_link.items()):
            if area.worker == worker:
                self._drop(link)

    def _drop(self, link: int) -> None:
        self.by_link.pop(link).close()
        self._forget_peers(link)

    def _forget_peers(self, link: int) -> None:
        for peer in [p for p, lk in self.by_peer.items() if lk == link]:
            del self.by_peer[peer]

    def close(self) -> None:
        for link in list(self.by_link):
            self._drop(link)

    def stats(self) -> dict:
        return {"areas": len(self.by_link), "areas_made": self.made,
                "areas_evicted": self.dropped, "area_bytes": self.moved}


def tensor_bytes(msg) -> int:
    """The bytes of a message's segments: float32, all that an area holds."""
    return 4 * sum(seg.data.shape[0] for seg in getattr(msg, "segments", ()))
