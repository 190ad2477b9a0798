"""asyncsgd: asynchronous SGD on PyTorch (Hogwild!, parameter server, comparisons)."""

from .config import HogwildConfig, TrainConfig
from .errors import (AsyncSGDError, CheckpointError, ConfigError, DataError, TaskError,
                     WorkerError)
from .rundir import RunDir
from .tasks import Split, Task, load_task
from .version import __version__

__all__ = [
    "AsyncSGDError", "CheckpointError", "ConfigError", "DataError", "HogwildConfig", "RunDir",
    "Split", "Task", "TaskError", "TrainConfig", "WorkerError", "__version__", "load_task",
]
