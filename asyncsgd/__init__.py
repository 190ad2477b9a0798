"""asyncsgd: asynchronous SGD on PyTorch (Hogwild!, parameter server, comparisons).

The names below are re-exported lazily, so ``asyncsgd --help`` and option
errors answer at once instead of first importing torch.

Where things live: ``core`` (tasks, data, models), ``wire`` (the parameter
server's protocol, transport and security), ``run`` (run directory, metrics,
checkpoints, owned processes), ``modes`` (Hogwild, single, DDP), ``analysis``
(compare, reports, plots); the parameter server itself is ``asyncsgd.servers``
and ``asyncsgd.workers`` (in the repository, ``servers/`` and ``workers/`` beside
this folder: setup.cfg maps them here, so nothing generic lands in site-packages).
"""

import importlib

from .version import __version__

_EXPORTS = {
    "HogwildConfig": "config", "TrainConfig": "config",
    "SingleConfig": "config", "DDPConfig": "config", "ServerConfig": "config",
    "WorkerConfig": "config", "CompareConfig": "config",
    "AsyncSGDError": "errors", "CheckpointError": "errors", "ConfigError": "errors",
    "DataError": "errors", "SecurityError": "errors", "TaskError": "errors",
    "WorkerError": "errors",
    "RunDir": "run.rundir", "RunResult": "run.recorder",
    "Split": "core.tasks", "Task": "core.tasks", "load_task": "core.tasks",
    "Metric": "core.scoring", "ACCURACY": "core.scoring", "PERPLEXITY": "core.scoring",
    "MSE": "core.scoring", "LOSS": "core.scoring",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'asyncsgd' has no attribute {name!r}")
