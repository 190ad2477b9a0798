"""The virtual clock's cost models: how long a step, a transfer and an apply take.

Values are parsed from the command line's text (``2ms``, ``lognormal:2ms:0.5``, ``100MB``,
``25gbit``, ``20us``) once, into plain frozen objects the engine reads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}
_BYTES = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_NUMBER = r"(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)"


def _split(text: str, units: dict, what: str, example: str) -> tuple:
    found = re.fullmatch(_NUMBER + r"\s*([A-Za-zµ/]*)", str(text).strip())
    unit = found.group(2).lower() if found else None
    if found is None or unit not in units:
        raise ConfigError(f"{text!r} is not a {what}; write e.g. {example}")
    return float(found.group(1)), units[unit]


def parse_duration(text: str) -> float:
    """'120ms', '20us', '1.5s' (a bare number is seconds) -> seconds."""
    value, scale = _split(text, {**_SECONDS, "": 1.0}, "duration", "120ms, 20us or 1.5s")
    return value * scale


def parse_size(text: str) -> int:
    """'100MB', '4KiB', '512' (bytes) -> bytes; MB is 10^6, MiB 2^20."""
    value, scale = _split(text, {**_BYTES, "": 1}, "size", "100MB, 4KiB or 512")
    if value * scale < 1:
        raise ConfigError(f"{text!r}: a size is at least 1 byte")
    return int(round(value * scale))


def parse_rate(text: str) -> float:
    """'25gbit', '100mbit', '1GB/s' -> bytes per second."""
    units = {**{k: v / 8 for k, v in _BITS.items()},
             **{f"{k}/s": v for k, v in _BYTES.items()}}
    value, scale = _split(text, units, "rate", "25gbit, 100mbit or 1GB/s")
    if value <= 0:
        raise ConfigError(f"{text!r}: a rate must be above 0, e.g. 25gbit")
    return value * scale


@dataclass(frozen=True)
class StepTime:
    """A worker's compute time per step: ``median`` seconds, times exp(sigma·N(0,1)) per step
    when ``sigma`` > 0 (a lognormal, Chen et al. 2016's straggler model)."""

    median: float
    sigma: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "StepTime":
        """'2ms' (constant) or 'lognormal:2ms:0.5' (median 2 ms, sigma 0.5)."""
        parts = str(text).strip().split(":")
        if len(parts) == 1:
            step = cls(parse_duration(parts[0]))
        elif len(parts) == 3 and parts[0] == "lognormal":
            try:
                sigma = float(parts[2])
            except ValueError:
                sigma = -1.0
            if not (sigma >= 0 and math.isfinite(sigma)):
                raise ConfigError(f"{text!r}: sigma must be a number >= 0, e.g. "
                                  "lognormal:2ms:0.5")
            step = cls(parse_duration(parts[1]), sigma)
        else:
            raise ConfigError(f"{text!r} is not a step time; write e.g. 2ms or "
                              "lognormal:2ms:0.5")
        if step.median <= 0:
            raise ConfigError(f"{text!r}: a step takes more than 0 s, e.g. 2ms")
        return step

    def draw(self, rng) -> float:
        """One step's seconds; ``rng``: a ``random.Random``."""
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)) if self.sigma \
            else self.median

    def describe(self) -> str:
        ms = f"{self.median * 1e3:.3g} ms"
        return f"lognormal, median {ms}, sigma {self.sigma:g}" if self.sigma else ms


@dataclass(frozen=True)
class Link:
    """A full-duplex link: ``bandwidth`` bytes/s each way, ``latency`` seconds one way."""

    bandwidth: float
    latency: float

    def transfer(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def ring_allreduce(self, nbytes: float, n: int) -> float:
        """A ring all-reduce of ``nbytes`` among ``n``: reduce-scatter then all-gather,
        2(n-1) steps of nbytes/n each."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n * nbytes / self.bandwidth + 2 * (n - 1) * self.latency


@dataclass(frozen=True)
class Costs:
    """Everything the virtual clock charges for: steps, links, the server's apply."""

    step: StepTime
    link: Link
    apply_per_byte: float  # the server's apply, seconds per gradient byte
    gradient_bytes: Optional[int] = None  # None: 4 x the model's parameters
    slow_share: float = 0.0  # this share of the workers (chosen by the seed) ...
    slow_factor: float = 1.0  # ... takes this many times as long per step
    slowdown: tuple = ()  # (rank, factor), as --slowdown
    speed_sigma: float = 0.0  # --worker-speeds lognormal:SIGMA: each worker's factor, drawn once
    delay: Optional[str] = None  # as --delay: a wait after each step
