"""Every command's settings as dataclasses; the CLI's options and the Python API's checks
come from them (``knobs`` declares, ``options`` converts, the rest are the settings)."""

from .compare import COMPARE_MODES, CompareConfig, PlotConfig
from .jobs import JobConfig, RayJobConfig
from .options import RENAMED, click_options, config_from_dict, identity_fields, make_config
from .ps import ServerConfig, WorkerConfig
from .shared import DEFAULT_EPOCHS, NO_EPOCH_LIMIT, RunConfig, TrainConfig
from .simulate import SimulateConfig
from .training import DDPConfig, HogwildConfig, SingleConfig
from .values import (Compression, Consistency, parse_comm_hook, parse_compress,
                     parse_consistency, parse_local_steps)

__all__ = ["COMPARE_MODES", "DEFAULT_EPOCHS", "NO_EPOCH_LIMIT", "RENAMED", "CompareConfig",
           "Compression", "Consistency", "DDPConfig", "HogwildConfig", "JobConfig", "PlotConfig",
           "RayJobConfig", "RunConfig", "ServerConfig", "SimulateConfig", "SingleConfig",
           "TrainConfig", "WorkerConfig", "click_options", "config_from_dict", "identity_fields",
           "make_config", "parse_comm_hook", "parse_compress", "parse_consistency",
           "parse_local_steps"]
