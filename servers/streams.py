"""Pushes that arrive in parts (PROTOCOL.md, "Parts"), collected per worker and checked part by
part, so a shard checks part j while part j + 1 is still on the wire; a push is still applied
whole or not at all (where the shard applies parts as they pass, ``early.py`` keeps that).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

from asyncsgd.wire.compression import segment_values
from asyncsgd.wire.protocol import Code, Key, Message, Rows, parts_of
from asyncsgd.wire.sparse import MAX_MESSAGE_VALUES

log = logging.getLogger(__name__)


@dataclass
class Open:
    seq: int
    incarnation: int
    parts: int
    first: Message  # part 0: its clock, shard and meta stand for the whole push
    started: float
    segments: list = field(default_factory=list)
    received: int = 0  # parts taken so far: the next must be this one
    values: int = 0  # values the parts taken so far hold (packed ones: once expanded)
    rows: int = 0  # row values (n x the table's dim) of the rows parts taken so far
    ids: int = 0  # the same of the ids parts (rows asked back by a push that pulls)
    failed: bool = False


class PushStreams:
    """The open pushes in parts, per worker, each part checked as it arrives.

    Bounded so that a peer that starts pushes and never finishes pins little: one push's
    parts hold at most the shard's slice of values (a packed part is refused past that
    before it is expanded), one open push per worker (a new part 0 replaces it, as a
    worker re-sending after a reconnect does), at most ``max_open`` in all (the oldest
    goes first), and ``expire`` drops those older than a timeout. After a part fails, the
    rest of that push is dropped unanswered, so its worker gets one error for it.

    Row-sparse parts (rows, and the ids of a push that pulls) are bounded as a whole
    message's are: at most ``MAX_MESSAGE_VALUES`` rows x dim each, ``row_width`` giving a
    table's dim (0 for no such table: the part's check refuses it)."""

    def __init__(self, check_part: Callable[[Message], Optional[tuple]], max_values: int,
                 max_open: int = 64, row_width: Callable[[int], int] = lambda table: 0):
        self.check_part = check_part  # (code, detail) when a part must be refused
        self.max_values = max_values  # the shard's slice: what one push's parts may hold
        self.max_open = max_open
        self.row_width = row_width
        self.open: dict = {}  # worker -> Open, oldest first

    def add(self, msg: Message, now: float) -> tuple:
        """Take one part: ``(whole push or None, (code, detail) to answer or None)``.

        Raises ``ProtocolError`` for part numbers that are not numbers.
        """
        part, parts = parts_of(msg)
        stream = self.open.get(msg.worker)
        if part == 0:
            if stream is not None:
                log.info("worker %s started push %d before finishing push %d; dropped that one",
                         msg.worker, msg.seq, stream.seq)
                del self.open[msg.worker]
            while len(self.open) >= self.max_open:
                del self.open[next(iter(self.open))]
            stream = self.open[msg.worker] = Open(msg.seq, msg.incarnation, parts, msg, now)
        elif (stream is None or (stream.seq, stream.incarnation, stream.parts) !=
              (msg.seq, msg.incarnation, parts) or part != stream.received):
            return None, (Code.BAD_FIELD, f"part {part} of {parts} of push {msg.seq} does not "
                                          "follow the parts before it; re-send the push from "
                                          "part 0")
        if stream.failed:
            part_problem = None
        elif len(msg.segments) != 1:
            part_problem = (Code.BAD_FIELD, f"part {part} of a push holds {len(msg.segments)} "
                                            "tensor frames; a part holds one")
        else:
            part_problem = self._count(stream, msg)
            if part_problem is None:
                part_problem = self.check_part(msg)
        stream.received += 1
        last = stream.received == parts
        if stream.failed or part_problem:
            stream.failed = True
            stream.segments = []  # the frames go back now, not at the last part
            if last:
                del self.open[msg.worker]
            return None, part_problem
        stream.segments.append(msg.segments[0])
        if not last:
            return None, None
        del self.open[msg.worker]
        first = stream.first
        meta = {k: v for k, v in first.meta.items() if k not in (Key.PART, Key.PARTS)}
        return Message(type=first.type, worker=first.worker, incarnation=first.incarnation,
                       seq=first.seq, clock=first.clock, shard=first.shard, meta=meta,
                       segments=stream.segments), None

    def _count(self, stream: Open, msg: Message) -> Optional[tuple]:
        """Add a part's values to its push's, or (code, detail) when they pass the bound."""
        data = msg.segments[0].data
        if type(data) is Rows:
            kind = "rows" if data.dim else "ids"
            total = getattr(stream, kind) + data.n * self.row_width(data.table)
            if total > MAX_MESSAGE_VALUES:
                return Code.TOO_LARGE, (f"the {kind} parts of push {msg.seq} hold more than "
                                        f"{MAX_MESSAGE_VALUES} row values")
            setattr(stream, kind, total)
            return None
        values = segment_values(msg.segments[0]) or 0
        if stream.values + values > self.max_values:
            return Code.OUT_OF_RANGE, (f"the parts of push {msg.seq} hold more than the "
                                       f"shard's {self.max_values} values")
        stream.values += values
        return None

    def expire(self, now: float, timeout: float) -> int:
        """Drop open pushes started more than ``timeout`` seconds ago; how many went."""
        old = [w for w, s in self.open.items() if now - s.started > timeout]
        for worker in old:
            del self.open[worker]
        return len(old)
