"""The virtual clock: real gradients and the real update rules, in simulated time.

One process plays every worker. Each gradient is computed for real, on the real model and
the worker's own batches, from the parameters that worker pulled; the parameter server is
the real ``ShardState`` (its consistency, rules and backup workers). Only time is
simulated: steps, transfers and applies take what the ``Costs`` say, and the order of
events, so the staleness each gradient meets, follows from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from ..config.modes import ModeSpec
from ..core.tasks import Task
from ..errors import ConfigError, WorkerError
from ..run.recorder import Outcome, RunResult
from ..run.rundir import CONFIG, RunDir, _write_json
from ..wire.layout import Layout
from .engine import (BALANCED, Engine, RunSettings, VirtualRecorder, VirtualSetup, check_spec,
                     local_steps)
from .local import AloneEngine, BalancedDDPEngine, DDPEngine
from .ps import PSEngine


def _engine_of(spec: ModeSpec) -> type:
    if spec.command == "ddp" and spec.flags == BALANCED:
        return BalancedDDPEngine
    return {"single": AloneEngine, "hogwild": AloneEngine, "ddp": DDPEngine,
            "ps-server": PSEngine}[spec.command]


def _record(task: Task, spec: ModeSpec, setup: VirtualSetup) -> dict:
    costs = setup.costs
    return {"task": task.name, "mode_name": spec.name, "clock": "virtual",
            "workers": setup.workers, "seed": setup.seed, "lr": setup.lr or task.lr,
            "batch_size": setup.batch_size or task.batch_size, "epochs": setup.epochs,
            "eval_every": setup.eval_every, "max_seconds": setup.max_seconds,
            "target": setup.target, "stop_at_target": setup.stop_at_target,
            "consistency": spec.consistency, "backup_workers": spec.backup_workers,
            "optimizer": spec.optimizer, "local_steps": local_steps(spec),
            "leave": [list(x) for x in setup.leave], "join": [list(x) for x in setup.join],
            "costs": {**dataclasses.asdict(costs), "gradient_bytes": costs.gradient_bytes}}


def simulate_run(task: Task, spec: ModeSpec, setup: VirtualSetup, out: Optional[str] = None,
                 progress: str = "auto", argv: Optional[list] = None) -> RunResult:
    """Run ``spec`` on the virtual clock into a run directory (``out``, or runs/<time>-<mode>)
    written as real runs write theirs, with ``t`` in virtual seconds and clock "virtual"."""
    with one_thread():
        return finish(prepare(task, spec, setup, out, progress, argv))


@contextlib.contextmanager
def one_thread():
    """Torch on one thread while simulating: the same seed gives the same sums, bit for bit,
    and a small model's steps run faster than on two (experiments/README.md, "Worker
    threads")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prepare(task: Task, spec: ModeSpec, setup: VirtualSetup, out: Optional[str] = None,
            progress: str = "auto", argv: Optional[list] = None) -> Engine:
    """The engine of one run, its run directory written and its first events not yet set."""
    check_spec(spec, setup)
    for _, rank in setup.leave:
        if not 0 <= rank < setup.workers:
            raise ConfigError(f"--leave names rank {rank}; ranks are 0..{setup.workers - 1}")
    if spec.command == "single":  # one process, however many workers the others have
        setup = dataclasses.replace(setup, workers=1)
    mode = "ps" if spec.command == "ps-server" else spec.command
    model = task.build_model(0)
    layout = Layout.of(model)
    flat, grads = torch.zeros(layout.total), torch.zeros(layout.total)
    layout.bind(model, flat, grads)  # copies the initial parameters in
    run = RunDir.create(out, mode)
    settings = RunSettings(mode, setup.target, setup.max_seconds, setup.eval_every, progress,
                         _record(task, spec, setup))
    world = setup.workers + len(setup.join)
    total = len(task.train) // world * world * setup.epochs if setup.epochs < 10 ** 5 else None
    rec = VirtualRecorder(settings, task, model, run, total_samples=total, argv=argv)
    _write_json(run.path / CONFIG, {**run.read_config(), "clock": "virtual"})
    return _engine_of(spec)(task, spec, setup, rec, model, layout, flat, grads)


def finish(engine: Engine, played: bool = False,
           error: Optional[WorkerError] = None) -> RunResult:
    """Play the run to its end (unless ``played``: a race did, and ``error`` is what
    failed it there) and write its summary; a failure is raised once it is written."""
    outcome = Outcome(stopped_by="epochs")
    if error is not None:
        engine.end()
        outcome.failed(error)
    else:
        with outcome.watch():
            outcome.stopped_by = engine.end() if played else engine.run()
    rec = engine.rec
    return rec.conclude(engine.samples, engine.epoch(), outcome,
                        rate=engine.samples / max(rec.now, 1e-12), clock="virtual",
                        workers=len(engine.workers), bytes=engine.bytes,
                        # a mode that dispatches on demand gives its own coverage
                        **{"coverage": engine.coverage(), **engine.summary()})
