"""The two roles of a parameter-server job and each one's settings, from one ``JobConfig``.

Rank 0 serves and every other rank works: a server's shards are its child processes on its
host, so a second serving node would have nothing to serve.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Optional

from ..config import JobConfig, ServerConfig, WorkerConfig, make_config
from ..errors import ConfigError
from ..run.settings import configure


def server_settings(job: JobConfig, workers: int, resume: Optional[str] = None) -> ServerConfig:
    """The server's settings: the job's server settings, expecting ``workers`` workers;
    with ``resume``, continuing that run directory (as ``ps-server --resume`` does)."""
    values = _shared(job, ServerConfig)
    values.update(workers=workers, device="cpu")  # the job's --device is the workers'
    if not resume:
        return make_config(ServerConfig, None, values)
    # as 'ps-server --resume': the saved settings, under those the job was given
    given = {name: value for name, value in values.items()
             if name in ("workers", "device") or value != _default(name)}
    given.update(resume=resume)
    given.pop("out", None)
    return configure(ServerConfig, None, given)


def worker_settings(job: JobConfig, server: str, rank: int, world: int) -> WorkerConfig:
    """Worker ``rank`` of ``world``'s settings: the job's worker settings and its server."""
    if not 0 <= rank < world:
        raise ConfigError(f"worker rank {rank} is outside 0..{world - 1}")
    values = _shared(job, WorkerConfig)
    values.update(server=server, rank=rank, world=world)
    return make_config(WorkerConfig, None, values)


def check_world(job: JobConfig, world: int) -> int:
    """The number of workers of a job of ``world`` processes; a ConfigError if none."""
    workers = world - job.servers
    if workers < 1:
        raise ConfigError(f"a job of {world} process(es) with --servers {job.servers} has no "
                          "worker; start more processes (torchrun --nproc-per-node, "
                          "--nnodes)")
    return workers


ALL_INTERFACES = ("0.0.0.0", "::", "*")


def job_bind(bind: Optional[str], local_world: int, world: int) -> str:
    """The server's --bind: as given, else loopback when all ``world`` processes of the job
    run on this host (torchrun's $LOCAL_WORLD_SIZE, ``local_world``, is its $WORLD_SIZE:
    --standalone, or one node), else all interfaces, which workers elsewhere must reach
    (``local_world`` 0: torchrun did not say)."""
    if bind:
        return bind
    return "tcp://127.0.0.1:0" if local_world == world else "tcp://0.0.0.0:0"


def advertised_host(bind_host: str, towards: str) -> str:
    """The host the workers reach a server bound to ``bind_host`` at: that host, unless it
    is all interfaces; then this host's address towards the rendezvous host ``towards``."""
    return reachable_host(towards) if bind_host in ALL_INTERFACES else bind_host


def reachable_host(towards: str) -> str:
    """The address of this host's interface that routes to ``towards``: the one peers that
    reach ``towards`` can reach this host at. No packet is sent (a UDP connect only picks
    the route). A loopback ``towards`` gives 127.0.0.1."""
    try:
        family, _, _, _, address = socket.getaddrinfo(towards, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as exc:
        raise ConfigError(f"cannot find this host's address towards {towards!r}: {exc}; "
                          "give --advertise HOST") from None


def _default(name: str):
    return next(f.default for f in dataclasses.fields(JobConfig) if f.name == name)


def _shared(job: JobConfig, cls) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {f.name: getattr(job, f.name) for f in dataclasses.fields(job) if f.name in names}
