"""``asyncsgd ps-job`` under torchrun: one command starts the server and every worker.

    torchrun --nnodes 1 --nproc-per-node 4 -m asyncsgd ps-job --task mnist1d-cnn

Rank 0 serves (``roles`` says why), every other rank works. torchrun's rendezvous store
carries the server's address and what a restart needs (``JobStore``); torchrun restarts the
whole job on a failure (``--max-restarts``), and the server resumes its run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Mapping, Optional, Union

from ..config import JobConfig
from ..errors import AsyncSGDError, ConfigError
from ..run.process_group import signal_on_parent_death
from ..run.recorder import RunResult
from ..run.rundir import RunDir
from ..wire.transport import parse_endpoint
from .roles import (advertised_host, check_world, job_bind, server_settings,
                    worker_settings)

log = logging.getLogger(__name__)

PROBE_SECONDS = 2.0  # a live server answers ps-stats in milliseconds, even under load
POLL_SECONDS = 0.2

_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """What torchrun tells this process (its environment)."""

    rank: int
    world: int
    master_addr: str
    master_port: int
    run_id: str
    restart_count: int
    local_world: int  # processes of the job on this node
    node: int  # this node's index in the job (GROUP_RANK): node 0 runs rank 0

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Launch":
        env = os.environ if env is None else env
        missing = [name for name in _NEEDED if not env.get(name)]
        if missing:
            raise ConfigError(
                f"ps-job runs under torchrun, which sets {', '.join(missing)}: start it as "
                "'torchrun --nproc-per-node 4 -m asyncsgd ps-job ...' (or use 'asyncsgd "
                "ps-server' and 'asyncsgd worker' by hand, or asyncsgd.ray for Ray)")
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "True") != "True":
            raise ConfigError("ps-job keeps the server's address in torchrun's rendezvous "
                              "store, which TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 turned off; "
                              "unset it")
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"],
                       int(env["MASTER_PORT"]), env.get("TORCHELASTIC_RUN_ID", "none"),
                       int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       int(env.get("LOCAL_WORLD_SIZE", "0")), int(env.get("GROUP_RANK", "0")))
        except ValueError as exc:
            raise ConfigError(f"torchrun's environment is not what ps-job expects: {exc}"
                              ) from None


class JobStore:
    """The job's keys in torchrun's rendezvous store: the server's address, its run
    directory and how often it started.

    The agent's TCPStore (at $MASTER_ADDR:$MASTER_PORT, under the job's run id), so no
    address is copied by hand. A server started again finds that it ran before and
    resumes its run directory; a worker reads an address only once the server behind it
    answers (after a restart the store may still hold the previous server's). Each worker
    leaves the shard versions it saw last, and its next incarnation reports them, so
    shards restored from a checkpoint count the acknowledged updates they lost."""

    def __init__(self, launch: Launch, timeout: float):
        import torch.distributed as dist
        try:
            self.store = dist.TCPStore(launch.master_addr, launch.master_port, is_master=False,
                                       timeout=timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as exc:
            raise AsyncSGDError(f"cannot reach torchrun's rendezvous store at "
                                f"{launch.master_addr}:{launch.master_port}: {exc}") from None
        self.prefix = f"asyncsgd/ps-job/{launch.run_id}/"

    def key(self, name: str) -> str:
        return self.prefix + name

    def server_started(self) -> int:
        """Count this start of the job's server; 1 on its first."""
        return int(self.store.add(self.key("server_starts"), 1))

    def publish(self, endpoint: str, run_dir: str) -> None:
        self.store.set(self.key("run_dir"), run_dir)
        self.store.set(self.key("front"), endpoint)

    def run_dir(self) -> Optional[str]:
        if not self.store.check([self.key("run_dir")]):
            return None
        return self.store.get(self.key("run_dir")).decode()

    def saw(self, rank: int, versions: list) -> None:
        """Worker ``rank`` ends having seen these shard versions (``seen`` hands them to
        its next incarnation)."""
        try:
            self.store.set(self.key(f"seen/{rank}"), json.dumps(versions))
        except Exception as exc:  # noqa: BLE001 - the store's agent may be gone already
            log.warning("could not record worker %d's shard versions: %s; a restarted "
                        "server cannot count updates its shards lost", rank, exc)

    def seen(self, rank: int) -> Optional[list]:
        """The shard versions worker ``rank``'s previous incarnation saw last, if any."""
        if not self.store.check([self.key(f"seen/{rank}")]):
            return None
        try:
            versions = json.loads(self.store.get(self.key(f"seen/{rank}")))
        except ValueError:
            versions = None
        if not (isinstance(versions, list) and all(type(v) is int and v >= 0
                                                   for v in versions)):
            log.warning("ignoring worker %d's recorded shard versions: not a list of versions",
                        rank)
            return None
        return versions

    def withdraw(self) -> None:
        """The server is gone: workers must not take its address (best effort: the store
        may have gone with its agent)."""
        try:
            self.store.delete_key(self.key("front"))
        except Exception as exc:  # noqa: BLE001 - any failure here is only a stale key
            log.debug("could not withdraw the server's address: %s", exc)

    def await_server(self, timeout: float, answers) -> str:
        """The address of a server that answers, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.store.check([self.key("front")]):
                address = self.store.get(self.key("front")).decode()
                if answers(address):
                    return address
                last = address
            time.sleep(POLL_SECONDS)
        seen = (f"the store holds {last}, which does not answer" if last
                else "it never published its address")
        raise AsyncSGDError(f"no server within {timeout:.0f} s (--server-timeout): {seen}; "
                            "see rank 0's output")

    def close(self) -> None:
        del self.store


def run(job: JobConfig, env: Optional[Mapping[str, str]] = None,
        argv: Optional[list] = None) -> Union[RunResult, "WorkerResult"]:  # noqa: F821
    """This process's part of the job: the server's run (rank 0) or a worker's result."""
    launch = Launch.from_env(env)
    workers = check_world(job, launch.world)
    # torchrun's workers run in sessions of their own: an agent killed outright (SIGKILL,
    # OOM) would leave them running. Its death stops this process as its SIGTERM does.
    parent = os.getppid()
    signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        raise AsyncSGDError("torchrun's agent exited while this process started")
    store = JobStore(launch, job.server_timeout)
    try:
        if launch.rank < job.servers:
            return _serve(job, launch, store, workers, argv)
        return _work(job, launch, store, workers)
    finally:
        store.close()


def _serve(job: JobConfig, launch: Launch, store: JobStore, workers: int,
           argv: Optional[list]) -> RunResult:
    from ..servers.server import serve
    starts = store.server_started()
    resume = job.resume
    if starts > 1:
        resume = _previous_run(store, starts)
    job = dataclasses.replace(job, bind=job_bind(job.bind, launch.local_world, launch.world))
    cfg = server_settings(job, workers, resume=resume)
    bind_host, _ = parse_endpoint(cfg.bind, "--bind")
    host = job.advertise or advertised_host(bind_host, launch.master_addr)
    log.info("ps-job: rank %d serves %d worker(s)%s", launch.rank, workers,
             f", resuming {resume} (start {starts})" if starts > 1 else "")

    def publish(endpoint: str, run_dir: str) -> None:
        _, bound = parse_endpoint(endpoint, "--bind")
        store.publish(f"tcp://{host}:{bound}", run_dir)
        log.info("ps-job: workers reach the server at tcp://%s:%d", host, bound)

    try:
        return serve(cfg, argv=argv, on_listening=publish)
    finally:
        store.withdraw()


def _previous_run(store: JobStore, starts: int) -> Optional[str]:
    """The run directory of the server's previous start, to resume; None when it saved
    nothing to resume from (it died before it served: the server and its shards save a
    checkpoint as they start serving)."""
    run_dir = store.run_dir()
    if run_dir and RunDir(run_dir).checkpoint.is_file():
        return run_dir
    if run_dir and Path(run_dir).exists():  # kept, beside the new run in its place
        aside = Path(f"{run_dir}.no-checkpoint-{starts - 1}")
        Path(run_dir).rename(aside)
        run_dir = str(aside)
    log.warning("ps-job: the server started %d time(s) before but left no checkpoint%s; "
                "starting a new run", starts - 1, f" (its directory: {run_dir})" if run_dir
                else "")
    return None


def _work(job: JobConfig, launch: Launch, store: JobStore, workers: int):
    from ..wire.security import ClientKeys
    from ..wire.stats import fetch_stats
    from ..workers.worker import run_worker

    def answers(address: str) -> bool:
        try:
            fetch_stats(address, PROBE_SECONDS, ClientKeys.load(None, None))
            return True
        except AsyncSGDError:
            return False

    server = store.await_server(job.server_timeout, answers)
    rank = launch.rank - job.servers
    log.info("ps-job: rank %d is worker %d of %d, server %s", launch.rank, rank, workers, server)
    cfg = worker_settings(job, server, rank, workers)
    if not cfg.local_workers and launch.local_world:  # the server's rank is no worker
        local = launch.local_world - (job.servers if launch.node == 0 else 0)
        cfg = dataclasses.replace(cfg, local_workers=max(1, local))
    return run_worker(cfg, seen=store.seen(rank), on_exit=lambda v: store.saw(rank, v))
