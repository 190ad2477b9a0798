"""DyLU on shard 0: each worker's local steps sized to its measured speed (--local-steps auto).

A worker running ``auto:H`` says with each push how many steps are behind it and the
seconds they took; this object keeps each worker's steps a second and answers the H it
runs next (``core.balance.local_steps``), the fastest running H. No sockets: the shard
calls ``read`` on a push's meta, then ``note`` and ``steps_for``.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from asyncsgd.core.balance import local_steps
from asyncsgd.wire.protocol import Code, Key, ProtocolError

MAX_STEPS = 1 << 20  # a push's steps (and the H asked) above this are no worker's


def _whole(meta: dict, key: str) -> int:
    value = meta.get(key)
    if type(value) is not int or not 1 <= value <= MAX_STEPS:
        raise ProtocolError(Code.BAD_FIELD, f"push field {key!r} is {value!r:.40}, not a "
                                            f"whole number in [1, {MAX_STEPS}]")
    return value


def read_compute(meta: dict) -> Optional[float]:
    """A push's ``compute`` (seconds of computation behind it), checked; None when absent."""
    if Key.COMPUTE not in meta:
        return None
    value = meta[Key.COMPUTE]
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ProtocolError(Code.BAD_FIELD, f"push field {Key.COMPUTE!r} is {value!r:.40}, not "
                                            "a finite number of seconds >= 0")
    return float(value)


def read(meta: dict) -> Optional[tuple]:
    """``(compute seconds, steps, fastest H)`` of an auto worker's push, checked as any
    network field (a ProtocolError refuses the push); None for a push that asks no H."""
    compute = read_compute(meta)
    if Key.AUTO_STEPS not in meta:
        return None
    fastest, steps = _whole(meta, Key.AUTO_STEPS), _whole(meta, Key.LOCAL_STEPS)
    if compute is None:
        raise ProtocolError(Code.BAD_FIELD, f"a push asking {Key.AUTO_STEPS!r} needs "
                                            f"{Key.COMPUTE!r}, the seconds its steps took")
    return compute, steps, fastest


class DyLU:
    """Each worker's steps a second, from its pushes, and the local steps it runs next.

    It sizes steps only: a sync round still takes the plain mean of the pseudo-gradients.
    One over fewer steps is about that much shorter already, so each worker's samples
    count in proportion; weighting it by its steps too would discount them twice (DyLU,
    Liu et al. 2024, sizes the steps and applies each pseudo-gradient as it comes)."""

    def __init__(self):
        self.speeds: dict = {}  # worker -> steps a second over its latest push
        self.fastest: dict = {}  # worker -> the H it asked for (the fastest worker's)
        self.assigned: dict = {}  # worker -> the H last answered

    def note(self, worker: str, compute: float, steps: int, fastest: int) -> None:
        """A push of ``steps`` steps that took ``compute`` seconds. A push measured at 0 s
        (a clock too coarse) says nothing of its speed: the previous measure stays."""
        self.fastest[worker] = fastest
        if compute > 0:
            self.speeds[worker] = steps / compute

    def forget(self, worker: str) -> None:
        """A forgotten worker's entries go, so that no stream of names grows them."""
        for table in (self.speeds, self.fastest, self.assigned):
            table.pop(worker, None)

    def steps_for(self, worker: str, among: Iterable[str]) -> int:
        """The H ``worker`` runs next: its share of the fastest's among the measured
        workers of ``among`` (the live ones); H itself until it is measured."""
        fastest = self.fastest.get(worker, 1)
        if worker not in self.speeds:
            steps = fastest
        else:
            names = sorted({w for w in among if w in self.speeds} | {worker})
            sized = local_steps([self.speeds[w] for w in names], fastest)
            steps = sized[names.index(worker)]
        self.assigned[worker] = steps
        return steps
