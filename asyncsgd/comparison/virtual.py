"""``compare --clock virtual``: the comparison handed to the simulator, --procs as its
workers and the task's profile as its cost model, into the same report directory layout.

--link keeps its meaning, each host's link rate, on simulated links instead of network
namespaces; the flags that start or shape real processes mean nothing there and are
refused rather than ignored.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional, TextIO

from ..config import CompareConfig, SimulateConfig
from ..errors import ConfigError
from ..run.process_group import available_cores
from ..simulator.simulate import SimulateResult, simulate

# compare's settings that mean nothing on the virtual clock: why, as the refusal says it
REAL_ONLY = {
    "mode_args": "passes flags to the commands of real processes",
    "shards": "sets the parameter server's shard processes",
    "ddp_backend": "picks torch.distributed's backend for real ranks",
    "grace": "gives real processes time to start and exit",
    "tensorboard": "is written by the real modes only",
    "log_to": "logs the real modes' runs only",
}


def refuse_real_only(cfg: CompareConfig) -> None:
    """A ConfigError naming the first setting, away from its default, that only a real
    run reads."""
    defaults = {f.name: f.default for f in dataclasses.fields(CompareConfig)}
    for name, why in REAL_ONLY.items():
        if getattr(cfg, name) != defaults[name]:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} means nothing with --clock virtual (it {why}); drop it, "
                              "or run with --clock real")


def settings_of(cfg: CompareConfig) -> SimulateConfig:
    """The simulate settings of a compare: the same task, modes, budget, seeds and
    stragglers, --procs workers, every cost the task's profile (or --link's rate)."""
    refuse_real_only(cfg)
    shared = {f.name for f in dataclasses.fields(SimulateConfig)} & \
        {f.name for f in dataclasses.fields(CompareConfig)}
    return SimulateConfig(**{name: getattr(cfg, name) for name in shared},
                          workers=cfg.procs or available_cores())


def compare_virtual(cfg: CompareConfig, argv: Optional[list] = None,
                    stream: TextIO = sys.stderr) -> SimulateResult:
    return simulate(settings_of(cfg), argv=argv, stream=stream, command="compare")
