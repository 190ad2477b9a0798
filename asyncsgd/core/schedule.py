"""Learning-rate schedules: the lr of step k, a linear warm-up then the schedule's decay.

Every mode asks the same rule with its own count of steps (a parameter server's shard:
its applied updates), so one run follows one schedule whatever its processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

KINDS = ("constant", "cosine", "linear", "step")
SAMPLES = "samples"  # --warmup 16000samples: a warm-up counted in samples, not steps


def _whole(text: str, minimum: int) -> Optional[int]:
    return int(text) if text.isascii() and text.isdecimal() and int(text) >= minimum else None


def parse_schedule(text: str) -> tuple:
    """``(kind, steps, every, gamma)`` of a --lr-schedule value: ``cosine`` -> ("cosine",
    None, 0, 1.0), steps None meaning the run's own length; ``cosine:5000``; ``step:100:0.5``
    -> ("step", None, 100, 0.5)."""
    kind, _, rest = str(text).strip().partition(":")
    if kind == "constant" and not rest:
        return kind, None, 0, 1.0
    if kind in ("cosine", "linear") and (not rest or _whole(rest, 1)):
        return kind, _whole(rest, 1), 0, 1.0
    if kind == "step":
        every, _, gamma = rest.partition(":")
        try:
            factor = float(gamma)
        except ValueError:
            factor = -1.0
        if _whole(every, 1) and 0 < factor <= 1:
            return kind, None, int(every), factor
    raise ConfigError(f"--lr-schedule {text!r}: use constant, cosine[:STEPS], linear[:STEPS] "
                      "or step:EVERY:GAMMA (e.g. cosine, cosine:5000, step:1000:0.5 with "
                      "0 < GAMMA <= 1)")


def parse_warmup(text) -> tuple:
    """``(amount, unit)`` of a --warmup value: ``500`` -> (500, "steps"); ``16000samples``
    -> (16000, "samples")."""
    raw = str(text).strip()
    number = raw[:-len(SAMPLES)] if raw.endswith(SAMPLES) else raw
    amount = _whole(number.strip(), 0)
    if amount is None:
        raise ConfigError(f"--warmup {text!r}: use a whole number of steps (500) or of "
                          "samples (16000samples)")
    return amount, SAMPLES if number != raw else "steps"


@dataclass(frozen=True)
class Schedule:
    """The lr of step ``k`` (counted from 0, the first step of the run) at peak ``lr``.

    Warm-up, ``warmup`` steps: ``lr * (k + 1) / warmup``, as torch's ``LinearLR(start_factor
    =1/warmup, total_iters=warmup-1)``: the first step at ``lr / warmup``, never 0, and step
    ``warmup - 1`` at ``lr``. Then, with ``s = k - warmup`` and ``S = steps - warmup``:
    constant ``lr``; cosine ``lr * (1 + cos(pi * s / S)) / 2`` (``CosineAnnealingLR(T_max=S)``);
    linear ``lr * (1 - s / S)``; step ``lr * gamma ** (s // every)`` (``StepLR``). Cosine and
    linear reach 0 at step ``steps`` and stay there beyond it.
    """

    lr: float
    kind: str = "constant"
    steps: Optional[int] = None
    every: int = 0
    gamma: float = 1.0
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown schedule {self.kind!r}")
        if self.kind in ("cosine", "linear") and (self.steps is None
                                                  or self.steps <= self.warmup):
            raise ConfigError(f"--lr-schedule {self.kind} over {self.steps} steps with "
                              f"--warmup {self.warmup}: the decay needs steps after the "
                              f"warm-up; give more --epochs or a longer {self.kind}:STEPS")

    def __call__(self, k: int) -> float:
        if k < self.warmup:
            return self.lr * (k + 1) / self.warmup
        s = k - self.warmup
        if self.kind == "cosine":
            span = self.steps - self.warmup
            return self.lr * (1 + math.cos(math.pi * min(s, span) / span)) / 2
        if self.kind == "linear":
            span = self.steps - self.warmup
            return self.lr * (1 - min(s, span) / span)
        if self.kind == "step":
            return self.lr * self.gamma ** (s // self.every)
        return self.lr

    @property
    def constant(self) -> bool:
        """Whether every step has the peak lr (no schedule, no warm-up)."""
        return self.kind == "constant" and not self.warmup


def schedule(lr: float, text: str = "constant", warmup="0", *, steps: Optional[int] = None,
             samples_per_step: Optional[int] = None, counted: str = "steps") -> Schedule:
    """The Schedule of --lr-schedule ``text`` and --warmup ``warmup`` at peak ``lr``.

    ``steps``: the run's length in the steps counted, for ``cosine``/``linear`` without a
    length (None where unknown: they are refused). ``samples_per_step`` converts a warm-up
    in samples into steps, rounding up (None where a step's samples are unknown: refused).
    ``counted`` names the steps in errors ("updates" on a parameter server).
    """
    kind, length, every, gamma = parse_schedule(text)
    amount, unit = parse_warmup(warmup)
    if unit == SAMPLES:
        if not samples_per_step:
            raise ConfigError(f"--warmup {warmup}: here a step's samples vary, so give the "
                              f"warm-up in {counted} (e.g. --warmup 100)")
        amount = -(-amount // samples_per_step)
    if kind in ("cosine", "linear") and length is None:
        if steps is None:
            raise ConfigError(f"--lr-schedule {kind}: the run's length in {counted} is not "
                              f"known here; give it, e.g. --lr-schedule {kind}:5000")
        length = steps
    return Schedule(lr, kind, length, every, gamma, amount)
