"""asyncsgd: asynchronous SGD on PyTorch (Hogwild!, parameter server, comparisons).

The Python API mirrors the commands (``asyncsgd.hogwild``, ``asyncsgd.ps.serve``,
``asyncsgd.load_run``, ...); the names below are re-exported lazily, so ``asyncsgd --help``
answers at once instead of first importing torch.
"""

import importlib

from .version import __version__

_EXPORTS = {
    "hogwild": "api", "single": "api", "ddp": "api", "compare": "api", "plot": "api",
    "simulate": "api", "load_run": "api",
    "Run": "run.reader", "CompareResult": "comparison.runner",
    "SimulateResult": "simulator.simulate",
    "HogwildConfig": "config", "TrainConfig": "config",
    "SingleConfig": "config", "DDPConfig": "config", "ServerConfig": "config",
    "WorkerConfig": "config", "CompareConfig": "config", "PlotConfig": "config",
    "SimulateConfig": "config",
    "AsyncSGDError": "errors", "CheckpointError": "errors", "ConfigError": "errors",
    "DataError": "errors", "SecurityError": "errors", "TaskError": "errors",
    "WorkerError": "errors",
    "RunDir": "run.rundir", "RunResult": "run.recorder",
    "Split": "core.tasks", "Task": "core.tasks", "load_task": "core.tasks",
    "DatasetSplit": "core.datasets",
    "Metric": "core.scoring", "ACCURACY": "core.scoring", "PERPLEXITY": "core.scoring",
    "MSE": "core.scoring", "LOSS": "core.scoring", "AUC": "core.scoring",
}

_MODULES = ("ps",)  # submodules re-exported whole: asyncsgd.ps.serve, asyncsgd.ps.work

__all__ = sorted(_EXPORTS) + list(_MODULES) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in _MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'asyncsgd' has no attribute {name!r}")
