"""Stragglers on purpose: ``--slowdown`` and ``--delay``, the same in every mode.

    asyncsgd ddp --procs 4 --slowdown 1:4                      # rank 1 takes 4x its step time
    asyncsgd hogwild --procs 4 --slowdown 1:4,3:2 --delay const:5ms@0,1

Asynchronous training wins when some workers are slower than others (Chen et al. 2016; Dutta
et al. 2018); on one quiet machine that has to be staged.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigError

DISTRIBUTIONS = ("exp", "const")
_UNITS = {"ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Pacing:
    """Parsed ``--slowdown`` and ``--delay``: who is slowed, and how."""

    slowdown: tuple = ()  # (rank, factor) pairs
    delay_kind: Optional[str] = None  # 'exp' or 'const'
    delay_mean: float = 0.0  # seconds
    delay_ranks: Optional[frozenset] = None  # None: every rank

    @classmethod
    def parse(cls, slowdown: Optional[str], delay: Optional[str]) -> "Pacing":
        return cls(slowdown=parse_slowdown(slowdown), **parse_delay(delay))

    @property
    def active(self) -> bool:
        return bool(self.slowdown) or self.delay_kind is not None

    def factor(self, rank: int) -> float:
        return dict(self.slowdown).get(rank, 1.0)

    def delays(self, rank: int) -> bool:
        return self.delay_kind is not None and (
            self.delay_ranks is None or rank in self.delay_ranks)

    def check_ranks(self, world: int, flag: str) -> None:
        """Every rank named exists among ``world`` processes (``flag`` sets them)."""
        named = {r for r, _ in self.slowdown} | set(self.delay_ranks or ())
        beyond = sorted(r for r in named if r >= world)
        if beyond:
            raise ConfigError(f"--slowdown/--delay name rank(s) "
                              f"{', '.join(map(str, beyond))}, but {flag} runs {world} "
                              f"process(es): rank(s) 0..{world - 1}")

    def describe(self) -> str:
        """One line for logs and reports, e.g. 'rank 1 4x slower, Exp(20 ms) delays'."""
        parts = [f"rank {r} {f:g}x slower" for r, f in self.slowdown]
        if self.delay_kind is not None:
            who = "" if self.delay_ranks is None else \
                " on rank(s) " + ",".join(map(str, sorted(self.delay_ranks)))
            mean = f"{self.delay_mean * 1000:g} ms"
            parts.append(("Exp(mean " + mean + ")" if self.delay_kind == "exp" else mean)
                         + " delay per step" + who)
        return ", ".join(parts) or "no stragglers"

    def flags(self, world: int) -> list:
        """Command-line flags of this pacing for ``world`` processes: the ranks beyond are
        left out (``compare`` gives single, rank 0 alone, only what rank 0 is asked)."""
        out = []
        slowdown = [(r, f) for r, f in self.slowdown if r < world]
        if slowdown:
            out += ["--slowdown", ",".join(f"{r}:{f:g}" for r, f in slowdown)]
        ranks = None if self.delay_ranks is None else sorted(r for r in self.delay_ranks
                                                             if r < world)
        if self.delay_kind is not None and ranks != []:
            where = "" if ranks is None else "@" + ",".join(map(str, ranks))
            out += ["--delay", f"{self.delay_kind}:{self.delay_mean:g}s{where}"]
        return out

    def to_dict(self) -> dict:
        return {"slowdown": {str(r): f for r, f in self.slowdown},
                "delay": None if self.delay_kind is None else {
                    "kind": self.delay_kind, "mean_seconds": self.delay_mean,
                    "ranks": None if self.delay_ranks is None else sorted(self.delay_ranks)}}


def parse_slowdown(text: Optional[str]) -> tuple:
    """'1:4' or '1:4,3:2' -> ((1, 4.0), (3, 2.0))."""
    if not text:
        return ()
    pairs = {}
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*:\s*([0-9.]+)\s*", item)
        if not m:
            raise ConfigError(f"--slowdown {text!r}: each item is RANK:FACTOR, e.g. 1:4 "
                              "(rank 1 takes 4x its step time) or 1:4,3:2")
        rank, factor = int(m.group(1)), _number(m.group(2), "--slowdown factor", text)
        if factor < 1:
            raise ConfigError(f"--slowdown {text!r}: factor {factor:g} of rank {rank} is "
                              "below 1; a rank cannot be made faster than it is")
        if rank in pairs:
            raise ConfigError(f"--slowdown {text!r}: rank {rank} is named twice")
        pairs[rank] = factor
    return tuple(sorted(pairs.items()))


def parse_delay(text: Optional[str]) -> dict:
    """'exp:20ms', 'const:0.5s@1,2' -> the delay fields of ``Pacing``."""
    if not text:
        return {}
    m = re.fullmatch(r"\s*(\w+)\s*:\s*([0-9.]+)\s*(ms|s)\s*(?:@\s*([\d,\s]+))?\s*", text)
    if not m or m.group(1) not in DISTRIBUTIONS:
        raise ConfigError(f"--delay {text!r}: use KIND:MEAN[@RANKS] with KIND one of "
                          f"{', '.join(DISTRIBUTIONS)} and MEAN in ms or s, e.g. exp:20ms or "
                          "exp:0.5s@1,2 (ranks 1 and 2 only)")
    mean = _number(m.group(2), "--delay mean", text) * _UNITS[m.group(3)]
    ranks = None
    if m.group(4):
        try:
            ranks = frozenset(int(r) for r in m.group(4).split(",") if r.strip())
        except ValueError:
            raise ConfigError(f"--delay {text!r}: ranks after @ are integers, e.g. @1,2") \
                from None
    return {"delay_kind": m.group(1), "delay_mean": mean, "delay_ranks": ranks}


def _number(text: str, what: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{what} in {whole!r} is not a number") from None


def pace_event(computed: float, waited: float) -> dict:
    """What a train event adds about the steps it covers: seconds computing and seconds
    waited on purpose (the rest of their time was communication, or waiting for others)."""
    return {"compute_s": round(computed, 4), "waited_s": round(waited, 4)}


def pace_note(computed: float, waited: float, span: float) -> str:
    """For a progress line: where the time of the steps so far went ('' without stragglers
    staged): computing the gradients, waiting on purpose, and the rest, communicating
    (pulls, pushes, all-reduces), applying updates and waiting for the other ranks."""
    if span <= 0 or waited <= 0:
        return ""
    other = max(0.0, span - computed - waited)
    return (f"step time: {100 * computed / span:.0f}% computing, {100 * waited / span:.0f}% "
            f"waited on purpose, {100 * other / span:.0f}% communicating and other")


def other_seconds(computed: float, waited: float, span: float) -> float:
    """Seconds of the steps' span neither computing nor waited on purpose."""
    return round(max(0.0, span - computed - waited), 3)


class Pacer:
    """One rank's pace: ``begin()`` before its step's computation, ``end()`` once its
    gradient is computed; ``end`` waits what the rank is slowed by and returns it.

    A slowed rank waits (FACTOR - 1) x the time its computation took, plus a delay drawn
    from its own seeded stream, before its gradient is applied, pushed or all-reduced, so
    it arrives as late as a slower machine's would. What it waits on purpose is counted
    apart from what it computes (``waited``, ``computed``), so reports can say which is
    which. (Hogwild with run tokens: a slowed rank waits holding its token, as a slow
    machine's core stays busy.)"""

    def __init__(self, pacing: Pacing, rank: int, seed: int,
                 synchronize: Optional[Callable[[], None]] = None):
        self.factor = pacing.factor(rank)
        self.kind = pacing.delay_kind if pacing.delays(rank) else None
        self.mean = pacing.delay_mean
        # Seeded per rank: the same delays in every mode and every repeat with this seed.
        self.rng = random.Random(f"asyncsgd-delay-{seed}-{rank}")
        self.active = self.factor > 1 or self.kind is not None
        # CUDA: a slowdown needs the step's kernels done to time them (unpaced: not worth
        # a synchronisation per step, so its compute time there is the time to launch them)
        self.synchronize = synchronize if self.active else None
        self.computed = self.waited = 0.0
        self.steps = 0
        self._began = 0.0
        self._first: Optional[float] = None

    def begin(self) -> None:
        self._began = time.perf_counter()
        if self._first is None:
            self._first = self._began

    @property
    def span(self) -> float:
        """Seconds since the first step began: computing, waiting on purpose and the rest."""
        return 0.0 if self._first is None else time.perf_counter() - self._first

    def end(self) -> float:
        """Seconds waited on purpose after this step's computation."""
        if self.synchronize is not None:
            self.synchronize()
        computed = time.perf_counter() - self._began
        self.computed += computed
        self.steps += 1
        if not self.active:
            return 0.0
        wait = (self.factor - 1) * computed
        if self.kind == "exp":
            wait += self.rng.expovariate(1 / self.mean) if self.mean > 0 else 0.0
        elif self.kind == "const":
            wait += self.mean
        if wait > 0:
            started = time.perf_counter()
            time.sleep(wait)
            wait = time.perf_counter() - started  # what was really waited
        self.waited += wait
        return wait

    def figures(self) -> dict:
        return {"steps": self.steps, "compute_seconds": round(self.computed, 3),
                "waited_seconds": round(self.waited, 3),
                "other_seconds": other_seconds(self.computed, self.waited, self.span)}
