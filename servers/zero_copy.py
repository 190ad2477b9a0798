"""Parameters sent without copying: copy-on-write, and updates applied as replies go out.

libzmq's I/O thread reads a reply's views of the parameters after ``send`` has returned;
copying every reply first costs a full pass over memory, and writing in place meanwhile would
tear it, so writes move aside while a send still reads (figures: experiments/README.md,
"Zero-copy replies").
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from asyncsgd.wire.protocol import Message
from asyncsgd.wire.transport import COPY_BELOW, Reading

from .rules import UpdateRule
from .store import ParamStore

log = logging.getLogger(__name__)


class InFlight:
    """The ``Reading`` of every zero-copy reply (``send_tracked``) with the tensor it reads.

    Before the shard writes its parameters it asks ``writable``: when no send still reads
    them (the common case: a worker pushes again only after its reply came) they are
    written in place; otherwise the shard moves to a spare buffer holding a copy, and the
    old one is recycled once its sends are done. Past ``max_buffers`` buffers,
    ``zero_copy`` says no and replies are copied as they are sent, so a peer that stops
    reading pins only a bounded amount of memory."""

    def __init__(self, max_buffers: int = 3):
        self.max_buffers = max_buffers
        self.sends: list = []  # (tensor, Reading) of replies still being sent
        self.spares: list = []  # buffers no send reads, ready to become the parameters
        self.copies = 0  # writes that had to move to another buffer (``move``)

    def _settle(self) -> None:
        if self.sends:
            self.sends = [(t, r) for t, r in self.sends if not r.done]

    def _busy(self, tensor: torch.Tensor) -> bool:
        return bool(self.sends) and any(t is tensor for t, _ in self.sends)

    def zero_copy(self, tensor: torch.Tensor) -> bool:
        """Whether a reply viewing ``tensor`` may be sent without copying."""
        self._settle()
        held = {id(t) for t, _ in self.sends} | {id(tensor)}
        return len(held) < self.max_buffers or self._busy(tensor)

    def sent(self, tensor: torch.Tensor, reading: Reading) -> None:
        if not reading.done:
            self.sends.append((tensor, reading))

    def reads(self, tensor: torch.Tensor) -> bool:
        """Whether a send still reads ``tensor``."""
        self._settle()
        return self._busy(tensor)

    def writable(self, params: torch.Tensor) -> torch.Tensor:
        """``params``, or a copy of it in a buffer no send reads."""
        if not self.reads(params):
            return params
        spare = self.move(params)
        spare.copy_(params)
        return spare

    def move(self, params: torch.Tensor) -> torch.Tensor:
        """A buffer like ``params`` (which a send reads) that no send reads, its values
        undefined: the caller fills it. ``params`` is recycled once its sends are done."""
        spare = None
        while self.spares and spare is None:
            candidate = self.spares.pop()
            if not self._busy(candidate):
                spare = candidate
        if spare is None:
            spare = torch.empty_like(params)
        self.copies += 1
        self.recycle(params)
        return spare

    def free(self, like: torch.Tensor) -> torch.Tensor:
        """A spare no send reads (kept among the spares if others are busy), or a new one
        like ``like``; unlike ``move``, the current buffer stays where it is."""
        self._settle()
        for i, candidate in enumerate(self.spares):
            if not self._busy(candidate):
                return self.spares.pop(i)
        return torch.empty_like(like)

    def recycle(self, old: torch.Tensor) -> None:
        # Busy now, free later: _busy is checked again before a spare is reused.
        if len(self.spares) + 1 < self.max_buffers:
            self.spares.append(old)


class ZeroCopyStore(ParamStore):
    """A ``ParamStore`` whose replies are sent from the parameter buffer itself.

    An update of parameters a send still reads writes its result to a spare buffer,
    reading the old one (one pass, no copy first). An update whose reply is the next
    reader (an async push that asks for the parameters back) is applied part by part,
    each just before the reply's part that covers it goes out, so updating part j + 1
    overlaps sending part j. Every other read or write first applies what is pending."""

    def __init__(self, params: torch.Tensor, rule: UpdateRule, max_buffers: int = 3):
        super().__init__(params, rule)
        self.inflight = InFlight(max_buffers)
        # A deferred update: (segments last-first, lr, the buffer it reads: None when it
        # writes in place); when it reads another, the first ``_done`` elements are written.
        self._pending: Optional[tuple] = None
        self._done = 0

    def update(self, segments: list, lr_scale: float = 1.0, deferrable: bool = False) -> None:
        self.apply_pending()
        # A reply still reads the parameters (another worker's, with several pushing at
        # once): the update reads them and writes another buffer, in one pass. Copying
        # them first and updating the copy was a second pass over memory, as costly as the
        # update itself (experiments/README.md, "Zero-copy replies").
        moves = bool(self.inflight.sends) and self.inflight.reads(self.buffer)
        # Deferred, each part is applied just before its part of the reply goes out; a
        # push of one part is answered in one part: deferring it gains nothing
        if not moves and not (deferrable and len(segments) > 1):
            self.rule.apply(self.buffer, segments, lr_scale=lr_scale)
            return
        source = None
        if moves:
            source, self.buffer = self.buffer, self.inflight.move(self.buffer)
        self._pending = (sorted(segments, key=lambda s: -s[0]), self.rule.begin(lr_scale),
                         source)
        self._done = 0
        if not deferrable:
            self.apply_pending()

    def apply_pending(self, until: Optional[int] = None) -> None:
        """Write what the deferred update has pending on elements before ``until`` (all by
        default): its segments that start there, and, when it moved to another buffer,
        the elements no segment covers, copied."""
        if self._pending is None:
            return
        segments, lr, source = self._pending
        end = self.buffer.numel() if until is None else min(until, self.buffer.numel())
        while segments and segments[-1][0] < end:
            offset, grad = segments.pop()
            if source is None:
                self.rule.apply_one(self.buffer, offset, grad, lr)
            else:
                self._copy(source, offset)
                self.rule.apply_one_into(self.buffer, source, offset, grad, lr)
                self._done = offset + grad.shape[0]
        if source is not None:
            self._copy(source, end)
        if not segments and (source is None or self._done == self.buffer.numel()):
            self._pending = None

    def spare(self) -> torch.Tensor:
        return self.inflight.free(self.buffer)

    def swap(self, new: torch.Tensor) -> None:
        self.apply_pending()
        old, self.buffer = self.buffer, new
        self.inflight.recycle(old)  # a reply may still read it: reused once it is done

    def give_back(self, spare: torch.Tensor) -> None:
        self.inflight.recycle(spare)

    def _copy(self, source: torch.Tensor, end: int) -> None:
        if end > self._done:
            self.buffer[self._done:end].copy_(source[self._done:end])
            self._done = end

    def _writable(self) -> torch.Tensor:
        if self._pending is None and not self.inflight.sends:
            return self.buffer  # nothing pending, no send reading it (every reply at 20 KB)
        self.apply_pending()
        self.buffer = self.inflight.writable(self.buffer)
        return self.buffer

    def sends_in_place(self, reply: Message) -> bool:
        """Whether ``reply`` goes out from the buffer itself: it carries the current
        buffer's views, the buffer is large enough for zero-copy to pay, and no more
        buffers are pinned by sends than allowed."""
        return (bool(reply.segments) and reply.segments is self._views
                and self._views_of is self.buffer and self.buffer.numel() * 4 >= COPY_BELOW
                and self.inflight.zero_copy(self.buffer))

    def sending(self, buffer: torch.Tensor, reading: Optional[Reading]) -> None:
        """A part of a reply went out from ``buffer``; ``reading`` says when libzmq is done
        reading it (None: nothing is read any more)."""
        if reading is not None:
            self.inflight.sent(buffer, reading)
