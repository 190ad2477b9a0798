"""A shard's parameters and the update rule that writes them, as a plain object: ``ShardState``
decides whether and how a push is applied, the store holds what is updated.
"""

from __future__ import annotations

from typing import Optional

import torch

from asyncsgd.wire.protocol import split

from .rules import UpdateRule


class ParamStore:
    """The parameters (``buffer``) and their update rule; updates apply at once, which is
    all a test or an in-process caller needs (the shard process uses
    ``zero_copy.ZeroCopyStore``)."""

    def __init__(self, params: torch.Tensor, rule: UpdateRule):
        self.buffer = params  # the current parameter buffer (a subclass may move to another)
        self.rule = rule
        self._views_of: Optional[torch.Tensor] = None
        self._views: list = []
        self._spare: Optional[torch.Tensor] = None  # the buffer ``swap`` replaced, for reuse

    @property
    def params(self) -> torch.Tensor:
        """The parameters with every update applied."""
        self.apply_pending()
        return self.buffer

    def views(self) -> list:
        """The segments a PARAMS reply sends: ``split(buffer)``, made once per buffer.

        They view the buffer: whoever sends them applies what is pending on them
        first (``apply_pending``)."""
        if self._views_of is not self.buffer:
            self._views_of, self._views = self.buffer, split(self.buffer)
        return self._views

    def update(self, segments: list, lr_scale: float = 1.0, deferrable: bool = False) -> None:
        """One optimizer step with ``segments`` [(offset, grad)], already checked.

        ``deferrable``: the next to read the parameters is the reply to this update,
        so a store may apply it part by part as that reply is sent."""
        self.rule.apply(self._writable(), segments, lr_scale=lr_scale)

    def spare(self) -> torch.Tensor:
        """A buffer like the parameters that nothing reads, its values undefined: a push
        in parts is applied into it (``early.EarlyPush``), and ``swap`` makes it the
        parameters, or ``give_back`` returns it."""
        spare, self._spare = self._spare, None
        return spare if spare is not None else torch.empty_like(self.buffer)

    def swap(self, new: torch.Tensor) -> None:
        """Make ``new`` (from ``spare``, every element written) the parameters; the old
        buffer becomes the spare."""
        self.apply_pending()
        self._spare, self.buffer = self.buffer, new

    def give_back(self, spare: torch.Tensor) -> None:
        """A buffer from ``spare`` that did not become the parameters."""
        self._spare = spare

    def load(self, params: torch.Tensor) -> None:
        """Replace the parameters' values (a checkpoint being restored)."""
        self._writable().copy_(params)

    def apply_pending(self, until: Optional[int] = None) -> None:
        """Apply what is pending on elements before ``until`` (all by default): nothing here."""

    def _writable(self) -> torch.Tensor:
        self.apply_pending()
        return self.buffer
