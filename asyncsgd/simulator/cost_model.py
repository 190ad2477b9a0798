"""The cost model of a simulate command: the parts given on its command line, parsed once,
and the rest profiled on this machine."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

from ..config import SimulateConfig
from ..config.simulate import parse_slow_workers, parse_worker_speeds
from ..core.pacing import parse_slowdown
from ..errors import ConfigError
from . import profile
from .costs import Costs, Link, StepTime, parse_duration, parse_rate, parse_size


def given(parse, text: Optional[str], flag: str):
    """``text`` parsed, or None when not given; a bad value names ``flag``."""
    if text is None:
        return None
    try:
        return parse(text)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {text!r}: {exc}") from None


@dataclass(frozen=True)
class Given:
    """The parts of the cost model given on the command line, parsed (None: profile it)."""

    step: Optional[StepTime]
    nbytes: Optional[int]
    rate: Optional[float]
    latency: Optional[float]

    @classmethod
    def of(cls, cfg: SimulateConfig) -> "Given":
        return cls(given(StepTime.parse, cfg.step_time, "--step-time"),
                   given(parse_size, cfg.gradient_bytes, "--gradient-bytes"),
                   given(parse_rate, cfg.link, "--link"),
                   given(parse_duration, cfg.latency, "--latency"))


def cost_model(cfg: SimulateConfig, given: Given, task) -> tuple:
    """(Costs, the parts profiled here): what was ``given``, the rest measured."""
    step, nbytes, rate, latency = given.step, given.nbytes, given.rate, given.latency
    share, factor = parse_slow_workers(cfg.slow_workers)
    measured = {"apply"}
    if step is None:
        step = StepTime(statistics.median(profile.step_seconds(task, cfg.batch_size)))
        measured.add("step")
    if nbytes is None:
        nbytes = profile.gradient_bytes(task)
        measured.add("bytes")
    if rate is None and latency is None:
        measured.add("link")
    link = Link(bandwidth=profile.LOOPBACK_BANDWIDTH if rate is None else rate,
                latency=profile.LOOPBACK_LATENCY if latency is None else latency)
    costs = Costs(step=step, link=link, apply_per_byte=profile.apply_seconds_per_byte(nbytes),
                  gradient_bytes=nbytes, slow_share=share, slow_factor=factor,
                  slowdown=parse_slowdown(cfg.slowdown), delay=cfg.delay,
                  speed_sigma=parse_worker_speeds(cfg.worker_speeds))
    return costs, frozenset(measured)


def costs_record(costs: Costs, measured: frozenset) -> dict:
    """The cost model as the report's header keeps it (seconds, bytes, bytes/s)."""
    return {"step_median": costs.step.median, "step_sigma": costs.step.sigma,
            "gradient_bytes": costs.gradient_bytes, "bandwidth": costs.link.bandwidth,
            "latency": costs.link.latency, "apply_per_byte": costs.apply_per_byte,
            "slow_share": costs.slow_share, "slow_factor": costs.slow_factor,
            "slowdown": list(costs.slowdown), "delay": costs.delay,
            "speed_sigma": costs.speed_sigma,
            "profiled": sorted(measured)}
