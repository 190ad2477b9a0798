"""Whether a task can be sent to spawned processes, checked before a run directory exists.

Hogwild's workers and DDP's ranks are spawned (``process_group.context``: never
forked), so the task (its ``model_fn``, ``loss_fn`` and data) travels to them by
pickle. A lambda or a function defined inside another function cannot: found
only when the first child starts, it was a 47-line traceback and a run
directory half written, which blocked the same ``--out`` and could not be
resumed. ``check_sendable`` pickles the task into nothing first, skipping its
tensors (torch sends those through shared memory, not the pickle stream: the
check costs no copy of the data).
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
