"""Copy-on-write for parameters that replies send without copying.

A shard answers a pull with views of its parameter tensor, and libzmq's I/O
thread reads them while it writes them to the socket, after ``send`` has
returned. Copying every reply first costs a full pass over memory (7 ms for
40 MiB here, a sixth of a round trip); sending in place is free but an update
applied while the bytes are still going out would tear the reply.

``InFlight`` keeps the MessageTracker of every zero-copy reply with the tensor
it reads. Before the shard writes its parameters it calls ``writable``: when
no send still reads them (the common case: a worker pushes again only after it
has received its reply) they are written in place; otherwise the shard moves to
a spare buffer holding a copy, and the old one is recycled once its sends are
done. At most ``max_buffers`` buffers exist; beyond that ``zero_copy`` says no
and replies are copied as they are sent, so a peer that stops reading can pin
only a bounded amount of memory.
"""

from __future__ import annotations

import logging

import torch
import zmq

log = logging.getLogger(__name__)


class InFlight:
    def __init__(self, max_buffers: int = 3):
        self.max_buffers = max_buffers
        self.sends: list = []  # (tensor, MessageTracker) of replies still being sent
        self.spares: list = []  # buffers no send reads, ready to become the parameters
        self.copies = 0  # writes that had to move to another buffer

    def _settle(self) -> None:
        if self.sends:
            self.sends = [(t, tr) for t, tr in self.sends if not tr.done]

    def _busy(self, tensor: torch.Tensor) -> bool:
        return any(t is tensor for t, _ in self.sends)

    def zero_copy(self, tensor: torch.Tensor) -> bool:
        """Whether a reply viewing ``tensor`` may be sent without copying."""
        self._settle()
        held = {id(t) for t, _ in self.sends} | {id(tensor)}
        return len(held) < self.max_buffers or self._busy(tensor)

    def sent(self, tensor: torch.Tensor, tracker: zmq.MessageTracker) -> None:
        if not tracker.done:
            self.sends.append((tensor, tracker))

    def writable(self, params: torch.Tensor) -> torch.Tensor:
        """``params``, or a copy of it in a buffer no send reads (``ShardState.before_write``)."""
        self._settle()
        if not self._busy(params):
            return params
        spare = None
        while self.spares and spare is None:
            candidate = self.spares.pop()
            if not self._busy(candidate):
                spare = candidate
        if spare is None:
            spare = torch.empty_like(params)
        spare.copy_(params)
        self.copies += 1
        self._recycle(params)
        return spare

    def _recycle(self, old: torch.Tensor) -> None:
        # Busy now, free later: _busy is checked again before a spare is reused.
        if len(self.spares) + 1 < self.max_buffers:
            self.spares.append(old)
