"""Whether a task can be sent to spawned processes, checked before a run directory exists.

A lambda or nested function in a task was found only when the first child started: a long
traceback and a half-written run directory. ``check_sendable`` pickles the task into nothing
first, skipping its tensors (torch sends those through shared memory), so it copies no data.
"""

from __future__ import annotations

import pickle

import torch

from ..errors import TaskError


class _Discard:
    """A file that keeps nothing."""

    @staticmethod
    def write(data) -> int:
        return len(data)


class _ProbePickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return id(obj)
        return None


def check_sendable(task, what: str = "spawned processes") -> None:
    """TaskError in one line when ``task`` cannot be pickled to ``what``."""
    try:
        _ProbePickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(task)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TaskError(
            f"task {getattr(task, 'name', '?')} cannot be sent to the {what} ({reason}): "
            "define its model_fn, loss_fn and data classes at the top level of a module, "
            "not as a lambda or inside a function (functools.partial of a top-level "
            "function works)") from None
