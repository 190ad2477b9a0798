"""Consistency policies: when a shard applies a push and when it answers a pull.

``Async`` answers everything at once, ``SSP(bound)`` holds a worker that runs too far ahead,
``Sync`` applies a round once every live worker (but the backup workers) has pushed. A policy
only decides; the shard (``shard.py``) keeps the worker records and the parameters and sends
the replies, so this module imports nothing of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Union

import torch

from asyncsgd.errors import ConfigError

from .deadline import RoundDeadline, quorum

# What a policy makes of a push (``Policy.push``).
APPLY = "apply"          # apply it now
GATHERED = "gathered"    # summed into the open round; acknowledged when the round is applied
STALE = "stale"          # acknowledged, never applied


def live_workers(workers: dict) -> list:
    """The live records of ``workers`` (worker id -> the shard's record)."""
    return [w for w in workers.values() if w.alive]


def min_live_clock(workers: dict) -> Optional[int]:
    """The slowest live worker's clock (its pushes), or None when none is live."""
    live = live_workers(workers)
    return min(w.pushes for w in live) if live else None


class Policy(ABC):
    """The interface. ``record`` is the shard's record of one worker (``alive``, ``pushes``,
    ``held_pull``, ``round_pushed``), ``workers`` all of them by id, ``version`` the number of
    updates applied. The policy reads records and keeps its own state (a sync round) apart;
    its effects on the shard's counters come back as answers (a held pull, a stale push, a
    lead). It puts nothing in a checkpoint: an open sync round is not saved, and its pushes
    are re-sent to the restored shard."""

    # No request ever waits: a push's reply is the next reader of the parameters, and its
    # accounting may wait until that reply is sent.
    answers_at_once = False
    # A push's clock ahead of the shard's version reaches ``push`` as a negative staleness
    # instead of as fresh: it was computed on a version a restored shard lost.
    stale_if_ahead = False
    now = 0.0  # the shard's clock as it handles a message or ticks (seconds)

    @abstractmethod
    def may_answer(self, record, workers: dict, version: int) -> bool:
        """Whether a pull from ``record`` is answered now; if not, it is held."""

    def lead(self, record, workers: dict) -> Optional[int]:
        """How many clocks ``record`` is ahead of the slowest live worker as it is answered
        (the ``max_pull_lead`` stat), or None when the policy does not bound it."""
        return None

    def push(self, record, segments: list, seq: int, staleness: int, version: int,
             weight: float = 1.0) -> str:
        """APPLY, GATHERED (``segments`` are summed into the open round, ``weight`` times
        under a weighted round) or STALE."""
        return APPLY

    def releasable(self, workers: dict, version: int) -> list:
        """The records whose held pull may be answered now. The shard asks after anything
        that can free one: a push counted, a worker that joins, leaves or goes silent."""
        live = live_workers(workers)
        return [r for r in live if r.held_pull is not None and self.may_answer(r, workers, version)]

    def round_update(self, workers: dict, version: int) -> Optional[torch.Tensor]:
        """The open round's update (its sum or mean) once the round is complete, else None.
        The shard applies it, then calls ``next_round``."""
        return None

    def next_round(self) -> list:
        """Close the applied round: the (record, seq) of its pushes, to acknowledge."""
        return []

    def wake_at(self, workers: dict) -> Optional[float]:
        """When the open round closes by the clock alone (the shard ticks then), or None."""
        return None


class Async(Policy):
    """A push is applied on arrival, a pull answered at once: nothing is ever held."""

    answers_at_once = True

    def may_answer(self, record, workers: dict, version: int) -> bool:
        return True

    def releasable(self, workers: dict, version: int) -> list:
        return []


class SSP(Policy):
    """Stale synchronous parallel: pushes apply on arrival; a pull from a worker more than
    ``bound`` clocks (pushes) ahead of the slowest live worker is held until that worker
    catches up or is dropped. No pull is answered before every expected worker has come."""

    def __init__(self, bound: int, expected_workers: int = 1):
        self.bound = bound
        self.expected_workers = expected_workers

    def may_answer(self, record, workers: dict, version: int) -> bool:
        if len(workers) < self.expected_workers:
            return False
        return record.pushes - min_live_clock(workers) <= self.bound

    def lead(self, record, workers: dict) -> Optional[int]:
        return record.pushes - (min_live_clock(workers) or 0)


class Sync(Policy):
    """Pushes of one round are summed; once all live workers but ``backup_workers`` have
    pushed (Chen et al. 2016), the round's mean (or sum) is applied once. A worker's pull
    waits until the round it pushed to is applied; a push computed before the round began,
    or a second one in a round, is stale; so is one computed on a round that a shard
    restored from an older checkpoint has not applied (its clock is ahead): it belongs to no
    round here, and its worker pulls and computes the round again (kill + resume then
    repeats the uninterrupted run exactly). ``backup_workers="auto"``: the round closes when
    its ``RoundDeadline`` says (``deadline.py``). ``weighted`` (--balance batch): each
    push counts by its weight, its samples, and the round is the weighted mean, the mean
    over all the samples of the pushes that made it."""

    stale_if_ahead = True

    def __init__(self, size: int, expected_workers: int = 1, reduce: str = "mean",
                 backup_workers: Union[int, str] = 0, weighted: bool = False):
        self.expected_workers = expected_workers
        self.weighted = weighted
        self.weight = 0.0  # the open round's weights, summed (weighted rounds)
        self.reduce = reduce
        self.backup_workers = backup_workers
        self.deadline = RoundDeadline() if backup_workers == "auto" else None
        self.round = 0  # the version the open round's pushes were computed from
        self.total = torch.zeros(size)
        self.members: list = []  # (record, seq) of the pushes summed into the open round

    def may_answer(self, record, workers: dict, version: int) -> bool:
        if len(workers) < self.expected_workers:
            return False
        return record.round_pushed is None or version > record.round_pushed

    def push(self, record, segments: list, seq: int, staleness: int, version: int,
             weight: float = 1.0) -> str:
        if staleness != 0 or record.round_pushed == version:
            # Computed before this round began (it was dropped and came back) or on a round
            # since lost, or a second push in one round: it must not skew the round's mean.
            if self.deadline is not None and staleness > 0:
                self.deadline.arrived(version - staleness, self.now)
            return STALE
        for seg in segments:
            if self.weighted:
                self.total[seg.offset:seg.offset + len(seg.data)].add_(seg.data, alpha=weight)
            else:
                self.total[seg.offset:seg.offset + len(seg.data)].add_(seg.data)
        self.weight += weight
        record.round_pushed = version
        self.members.append((record, seq))
        self.round = version
        if self.deadline is not None:
            self.deadline.arrived(version, self.now)
        return GATHERED

    def round_update(self, workers: dict, version: int) -> Optional[torch.Tensor]:
        if not self.members or len(workers) < self.expected_workers:
            return None
        live = live_workers(workers)
        pushed = sum(w.round_pushed == version for w in live)
        if self.deadline is not None:
            if not self.deadline.due(version, pushed, len(live), self.now):
                return None
        elif pushed < max(1, len(live) - self.backup_workers):
            return None
        if self.weighted:
            self.total.div_(self.weight)
        elif self.reduce == "mean" and len(self.members) > 1:
            self.total.div_(len(self.members))
        return self.total

    def next_round(self) -> list:
        members, self.members = self.members, []
        self.total.zero_()
        self.weight = 0.0
        if self.deadline is not None:
            self.deadline.closed(self.round, self.now)
        return members

    def wake_at(self, workers: dict) -> Optional[float]:
        # Only a round that the deadline alone would close: else the shard would wake for
        # nothing, again and again, once the time has passed.
        if self.deadline is None or not self.members or len(workers) < self.expected_workers:
            return None
        live = live_workers(workers)
        if sum(w.round_pushed == self.round for w in live) < quorum(len(live)):
            return None
        return self.deadline.at(self.round)


def make_policy(kind: str, bound: int = 0, *, size: int, expected_workers: int = 1,
                reduce: str = "mean", backup_workers: Union[int, str] = 0,
                weighted: bool = False) -> Policy:
    """The policy of a parsed ``--consistency`` (``kind``: async, ssp or sync; ``bound``:
    ssp's K) for a shard of ``size`` values; ``weighted``: sync rounds weighted by samples."""
    if reduce not in ("mean", "sum"):
        raise ConfigError(f"sync reduce {reduce!r}: use mean or sum")
    if weighted and (kind != "sync" or reduce != "mean"):
        raise ConfigError(f"--balance batch weights the pushes of sync rounds: it needs "
                          f"--consistency sync and --sync-reduce mean, not {kind} and {reduce}")
    if kind == "async":
        return Async()
    if kind == "ssp":
        return SSP(bound, expected_workers)
    if kind == "sync":
        return Sync(size, expected_workers, reduce, backup_workers, weighted)
    raise ConfigError(f"consistency {kind!r}: use async, ssp or sync")
