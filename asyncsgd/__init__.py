"""asyncsgd: asynchronous SGD on PyTorch (Hogwild!, parameter server, comparisons).

The names below are re-exported lazily, so ``asyncsgd --help`` and option
errors answer at once instead of first importing torch.
"""

import importlib

from .version import __version__

_EXPORTS = {
    "HogwildConfig": "config", "TrainConfig": "config",
    "SingleConfig": "config", "DDPConfig": "config",
    "AsyncSGDError": "errors", "CheckpointError": "errors", "ConfigError": "errors",
    "DataError": "errors", "SecurityError": "errors", "TaskError": "errors",
    "WorkerError": "errors",
    "RunDir": "rundir", "Split": "tasks", "Task": "tasks", "load_task": "tasks",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'asyncsgd' has no attribute {name!r}")
