"""Domain exceptions: everything a user can get wrong raises an ``AsyncSGDError`` whose message
says what and how to fix it; the CLI prints it as one line, without a traceback.
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


class CallbackError(AsyncSGDError):
    """A run's on_eval callback or --log-to logger raised; the run stopped and was saved."""
