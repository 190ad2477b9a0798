"""The virtual clock: real update rules and real gradients, in simulated time."""

from .costs import Costs, Link, StepTime, parse_duration, parse_rate, parse_size
from .engine import VirtualSetup
from .run import simulate_run

__all__ = ["Costs", "Link", "StepTime", "VirtualSetup", "parse_duration", "parse_rate",
           "parse_size", "simulate_run"]
