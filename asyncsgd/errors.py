"""Domain exceptions.

Everything a user can get wrong (flags, config, data, checkpoints) raises an
``AsyncSGDError`` subclass whose message says what is wrong and how to fix it.
The CLI prints that message as one line and exits non-zero, without a
traceback. Any other exception is a bug in asyncsgd and keeps its traceback.
"""


class AsyncSGDError(Exception):
    """Base class of every error asyncsgd reports to its user."""

    exit_code = 1


class ConfigError(AsyncSGDError):
    """A setting is invalid or settings contradict each other."""

    exit_code = 2


class TaskError(AsyncSGDError):
    """A task name or import path cannot be resolved into a task."""

    exit_code = 2


class DataError(AsyncSGDError):
    """Training data is missing, unreadable or malformed."""


class CheckpointError(AsyncSGDError):
    """A checkpoint or run directory is missing, unsafe or incompatible."""


class WorkerError(AsyncSGDError):
    """A worker process failed; the message names it and carries its traceback."""

    def __init__(self, worker: int, message: str):
        self.worker = worker
        super().__init__(message)


class SecurityError(AsyncSGDError):
    """Authentication is unavailable or failed: CURVE keys, libzmq without CURVE, a refusal."""

    exit_code = 2
