"""The cost model of a task measured on this machine: what ``asyncsgd simulate`` uses
where it is given none.

Measured in this process, with no socket and nothing on disk: a step's forward and
backward, and the real shard applying a push of the model's size; the link is the
loopback's, from figures measured before (``LOOPBACK_*``).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Optional

import torch

from ..core.tasks import Task
from ..servers.shard import ShardConfig, ShardState
from ..wire.protocol import PUSH, Message, Segment
from .costs import Costs, Link, StepTime

WARMUP_STEPS = 5
MEASURED_STEPS = 30
APPLY_PUSHES = 20
# A push larger than this is timed at this size: a per-byte cost is its slope by then,
# and a 100 MB model's copy would cost memory a profile need not take.
APPLY_PROBE_MAX_BYTES = 16 << 20
FLOAT_BYTES = 4
# Loopback (same-host path), measured by experiments/ps_throughput.py: experiments/
# README.md, "Parameter-server round trips", idle, 1 trainer. A round trip is a push and
# a pull: latency is half the 20 KB round trip (3,079/s), bandwidth both 40 MiB transfers
# over the 40 MiB round trip (58/s) less that latency.
LOOPBACK_LATENCY = 0.5 / 3079
LOOPBACK_BANDWIDTH = 2 * (40 << 20) / (1 / 58 - 1 / 3079)


def loopback() -> Link:
    """The link between two processes of this host, as the parameter server uses it."""
    return Link(bandwidth=LOOPBACK_BANDWIDTH, latency=LOOPBACK_LATENCY)


def parameter_count(task: Task) -> int:
    return sum(p.numel() for p in task.build_model().parameters())


def gradient_bytes(task: Task) -> int:
    """Bytes of one float32 gradient of the task's model: what a push or a ring carries."""
    return FLOAT_BYTES * parameter_count(task)


@contextmanager
def _threads(n: int):
    was = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def step_seconds(task: Task, batch_size: Optional[int] = None, threads: int = 1,
                 steps: int = MEASURED_STEPS) -> list:
    """Seconds of each of ``steps`` steps on batches of the training data (after
    ``WARMUP_STEPS`` not counted), as a worker computes its gradient: the batch's rows,
    forward, backward and the loss read back."""
    batch = batch_size or task.batch_size
    model = task.build_model()
    order = torch.randperm(len(task.train), generator=torch.Generator().manual_seed(0))
    taken = []
    with _threads(threads):
        for i in range(WARMUP_STEPS + steps):
            start = (i * batch) % max(1, len(task.train) - batch + 1)
            began = time.perf_counter()
            inputs, targets = task.train.rows(order[start:start + batch])
            model.zero_grad(set_to_none=False)
            loss = task.loss_fn(model(*inputs), targets)
            loss.backward()
            loss.item()
            if i >= WARMUP_STEPS:
                taken.append(time.perf_counter() - began)
    return taken


def apply_seconds_per_byte(nbytes: int, threads: int = 1,
                           pushes: int = APPLY_PUSHES) -> float:
    """Seconds per gradient byte the real shard (``servers.shard``, the sgd rule, async)
    takes to check and apply a push of ``nbytes`` (at most ``APPLY_PROBE_MAX_BYTES``):
    the median over ``pushes`` after one not counted."""
    size = max(1, min(nbytes, APPLY_PROBE_MAX_BYTES) // FLOAT_BYTES)
    state = ShardState(ShardConfig(index=0, start=0, end=size, rule="sgd", lr=1e-3),
                       torch.zeros(size))
    gradient = torch.full((size,), 1e-3)
    taken = []
    with _threads(threads):
        for seq in range(1, pushes + 2):
            msg = Message(type=PUSH, worker="profile", incarnation=1, seq=seq, shard=0,
                          clock=state.version, segments=[Segment(0, gradient)])
            began = time.perf_counter()
            state.handle(b"profile", msg, 0.0)
            if seq > 1:
                taken.append(time.perf_counter() - began)
    return statistics.median(taken) / (size * FLOAT_BYTES)


def profile(task: Task, batch_size: Optional[int] = None, threads: int = 1) -> Costs:
    """The task's cost model on this machine: the median step time, the shard's apply
    cost per byte at the model's size, the model's gradient bytes, the loopback link."""
    nbytes = gradient_bytes(task)
    step = statistics.median(step_seconds(task, batch_size, threads))
    return Costs(step=StepTime(step), link=loopback(),
                 apply_per_byte=apply_seconds_per_byte(nbytes, threads),
                 gradient_bytes=nbytes)


def _seconds(x: float) -> str:
    return f"{x * 1e6:.0f} µs" if x < 1e-3 else f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def _bytes(x: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.0f} B"


def describe(costs: Costs, measured: frozenset = frozenset({"step", "apply", "bytes",
                                                             "link"})) -> list:
    """Lines for a report: each part of the cost model and where it came from,
    ``measured`` naming those profiled here (the others were given)."""
    def source(part: str, how: str) -> str:
        return how if part in measured else "given"

    step = costs.step
    spread = f", lognormal σ {step.sigma:g} around it" if step.sigma else ""
    nbytes = costs.gradient_bytes
    return [
        f"- step (forward + backward of a batch): {_seconds(step.median)} median{spread} "
        f"({source('step', 'measured here: median of steps after a warm-up')})",
        "- gradient: " + (f"{_bytes(nbytes)} a push, pull or all-reduce" if nbytes else
                          "the model's float32 bytes")
        + f" ({source('bytes', '4 bytes per parameter of the model')})",
        f"- link: {_bytes(costs.link.bandwidth)}/s, {_seconds(costs.link.latency)} latency "
        f"({source('link', 'the loopback, measured by experiments/ps_throughput.py')}); the "
        "server's link is shared, the pushes it receives queue on it",
        f"- server apply: {costs.apply_per_byte * 1e9:.3g} ns per gradient byte "
        f"({_seconds(costs.apply_per_byte * (nbytes or 0))} a push; measured here: the "
        "real shard applying pushes, sgd rule)",
    ]
