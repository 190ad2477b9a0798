"""The parameter server from Python: ``serve`` is ``asyncsgd ps-server``, ``work`` is
``asyncsgd worker``; settings as ``asyncsgd.api`` takes them.

    result = asyncsgd.ps.serve(bind="tcp://127.0.0.1:5555", workers=2)  # until both are done

``serve`` blocks until a stop condition (by default every worker that joined has left) and
may run in a thread; a worker retries until its server answers, so either may start first.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

from .config import JobConfig, ServerConfig, WorkerConfig, make_config
from .errors import ConfigError
from .run.recorder import RunResult
from .run.given_task import task_named
from .run.settings import configure
from .run.sinks import attached
from .run.sinks import callbacks as as_sinks
from .wire.security import ClientKeys
from .wire.stats import fetch_stats
from asyncsgd.workers.worker import WorkerResult, run_worker

__all__ = ["serve", "work", "job", "stats", "WorkerResult"]


def serve(config: Optional[ServerConfig] = None, /, *, on_eval: Optional[Callable] = None,
          callbacks: Iterable = (), **settings: Any) -> RunResult:
    """``asyncsgd ps-server``: serve the parameters to workers until a stop condition.
    Returns the run's directory and its summary.json (updates, staleness, lost updates).
    ``on_eval`` (and each of ``callbacks``) is called in this thread with each evaluation's
    record, as metrics.jsonl holds it; one that raises stops the run (saved)."""
    config, settings = task_named(config, settings, "the parameter server's processes")
    cfg = configure(ServerConfig, config, settings)
    if cfg.device != "cpu":
        raise ConfigError(f"device {cfg.device} (--device): the parameter server keeps the "
                          "parameters in CPU memory and evaluates there; leave it at cpu and "
                          "compute gradients on GPUs with 'asyncsgd worker --device cuda'")
    with attached(as_sinks(on_eval, callbacks)):
        # here, not at the top: a worker never serves (17-24 ms of its start-up's imports)
        from asyncsgd.servers.server import serve as run_server
        return run_server(cfg)


def work(config: Optional[WorkerConfig] = None, /, **settings: Any) -> WorkerResult:
    """``asyncsgd worker``: pull, compute gradients on this worker's partition, push, until
    its epochs end, ``max_seconds`` pass or the server ends training. Returns its counts
    (steps, pushes, samples, seconds) and its client's statistics."""
    config, settings = task_named(config, settings, "the parameter server's processes")
    return run_worker(configure(WorkerConfig, config, settings))


def job(config: Optional[JobConfig] = None, /, **settings: Any) -> Union[RunResult,
                                                                      WorkerResult]:
    """``asyncsgd ps-job``: this process's part of a whole job under torchrun (its
    RANK, WORLD_SIZE and rendezvous store): rank 0 serves and returns the server's run,
    every other rank works and returns its ``WorkerResult``. ``asyncsgd.jobs.torchrun``
    says how the address and restarts ride on torchrun."""
    from .jobs import torchrun
    # a job's resume is its server's: the run directory is a ps run, checked as one there
    config, settings = task_named(config, settings, "the parameter server's processes")
    return torchrun.run(make_config(JobConfig, config, settings))


def stats(server: str = "tcp://127.0.0.1:5555", timeout: float = 5.0,
          curve_server_key: Optional[str] = None, curve_secret: Optional[str] = None) -> dict:
    """``asyncsgd ps-stats --json``: a running server's counters (updates, workers,
    staleness histogram, refusals). ``SecurityError`` names a CURVE key problem,
    ``AsyncSGDError`` a server that does not answer within ``timeout`` seconds."""
    return fetch_stats(server, timeout, ClientKeys.load(curve_server_key, curve_secret))
