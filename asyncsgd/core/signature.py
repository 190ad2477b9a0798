"""The data signature: what a parameter-server worker and its server compare to know that the
worker trains on the server's data.

The model signature (``wire.layout``) says nothing about data: a worker with another
``--samples``, ``--seed`` or task would train quietly on other rows, so the front refuses a
worker whose map differs (PROTOCOL.md, Handshake). The map comes from the network, so
``data_mismatch`` checks every field's type and never raises.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from .tasks import PARTITION_SCHEME, Task, task_identity

# Parameter-server workers partition the training rows with this seed whatever their
# --seed (which orders their batches): workers started with different seeds still
# read disjoint rows.
PS_PARTITION_SEED = 0

FIELDS = {"task": (str,), "train": (int,), "test": (int,), "seed": (int, type(None)),
          "partition": (str,), "digest": (str,)}
_SHOWN = 80  # characters of a worker's value quoted in an error


def data_signature(task: Task, name: str, seed: int,
                   partition_seed: int = PS_PARTITION_SEED) -> dict:
    """The data signature of ``task``, built as ``name`` with ``seed``, whose training rows
    are partitioned with ``partition_seed``.

    ``task``: the canonical name, every option spelled out; ``train``, ``test``: the
    splits' sample counts; ``seed``: the seed the task's function got (None when it takes
    none); ``partition``: how workers cut the training rows; ``digest``: a cheap
    fingerprint of the data (each split's sample shapes, dtypes and integer labels, or the
    Dataset's class). Not a hash of every input: that would cost seconds on large data,
    and float inputs generated on two hosts may differ in their last bit."""
    canonical, data_seed = task_identity(name, seed)
    digest = hashlib.sha256(
        f"{task.train.fingerprint()}\n{task.test.fingerprint()}".encode()).hexdigest()[:16]
    return {"task": canonical, "train": len(task.train), "test": len(task.test),
            "seed": data_seed, "partition": f"{PARTITION_SCHEME} seed {partition_seed}",
            "digest": digest}


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def _malformed(theirs) -> Optional[str]:
    """What is wrong with the form of a data signature from the network, or None."""
    if not isinstance(theirs, dict):
        return f"the worker's data signature is a {type(theirs).__name__}, not a map"
    for key in theirs:
        if key not in FIELDS:
            return (f"the worker's data signature has a field {_shown(key)} this server "
                    "does not know")
    for key, kinds in FIELDS.items():
        if key not in theirs:
            return f"the worker's data signature lacks the field {key!r}"
        value = theirs[key]
        if type(value) is bool or not isinstance(value, kinds):
            return (f"the worker's data signature has {key} = {_shown(value)} "
                    f"({type(value).__name__})")
    return None


def data_mismatch(ours: dict, theirs, settings: str) -> str:
    """Why a worker's data signature ``theirs`` differs from the server's ``ours``, and the
    fix, in one sentence; '' when they agree. ``settings``: the server's data flags
    (``--task X --samples N``), which the worker should repeat."""
    same_version = ": run the same asyncsgd version on the server and its workers"
    malformed = _malformed(theirs)
    if malformed:
        return malformed + same_version
    if theirs["task"] != ours["task"]:
        problem = f"the worker builds task {_shown(theirs['task'])}, the server {ours['task']!r}"
    elif (theirs["train"], theirs["test"]) != (ours["train"], ours["test"]):
        problem = (f"the worker has {theirs['train']:,} training and {theirs['test']:,} test "
                   f"samples, the server {ours['train']:,} and {ours['test']:,}")
    elif theirs["seed"] != ours["seed"]:
        problem = (f"the worker built its data with seed {theirs['seed']}, the server with "
                   f"seed {ours['seed']}")
    elif theirs["partition"] != ours["partition"]:
        return (f"the worker partitions the data as {_shown(theirs['partition'])}, the server "
                f"as {ours['partition']!r}" + same_version)
    elif theirs["digest"] != ours["digest"]:
        problem = (f"the data themselves differ (data digest {_shown(theirs['digest'])} on the "
                   f"worker, {ours['digest']!r} on the server: other labels, or samples of "
                   "another shape or dtype)")
    else:
        return ""
    return f"{problem}; start the worker with the server's data settings: {settings}"
