"""Settings of the whole-job commands: ps-job (torchrun) and ray-job (Ray).

Each is its own settings first, then the server's and the worker's, each taken once;
what the launcher decides is left out.
"""

from __future__ import annotations

from typing import Optional

import click

from .knobs import knob, settings
from .ps import WORKERS, ServerConfig, WorkerConfig

# Left out: what the launcher decides (the worker's --server, --rank, --world; the server's
# --workers) and CURVE (the rendezvous store that carries the server's address is
# unauthenticated: run a job on a trusted network, or start ps-server and worker with CURVE
# keys yourself).
JobConfig = settings(
    "JobConfig", "ps-job", "Settings of ``asyncsgd ps-job``: a whole parameter-server job "
    "under torchrun: one server rank, the rest workers.",
    knob("servers", int, 1,
         "Ranks that serve: rank 0 runs the server (its front and its --shards shard "
         "processes); every other rank is a worker. Only 1: the shards of one server run on "
         "its host.", type=click.IntRange(1, 1)),
    knob("advertise", Optional[str], None,
         "Host or IP the workers reach the server at. By default the --bind host, or when "
         "that is all interfaces (0.0.0.0), the address of this host's interface that routes "
         "to the rendezvous host ($MASTER_ADDR).", metavar="HOST",
         show="the --bind host, or the interface towards $MASTER_ADDR", per_command={
             "ray-job": dict(help="Host or IP the workers reach the server at.",
                             show="127.0.0.1 when it listens on loopback, else the address "
                                  "Ray knows the driver's node by")}),
    ServerConfig, WorkerConfig,
    left_out=frozenset({"server", "rank", "world", "workers", "curve_secret",
                        "allowed_clients", "curve_server_key"}),
    module=__name__)

# Left out: torchrun's (--servers: one server actor; --local-workers: the driver counts the
# worker actors Ray placed on each node).
RayJobConfig = settings(
    "RayJobConfig", "ray-job", "Settings of ``asyncsgd ray-job`` (``asyncsgd.ray.run``): a "
    "whole parameter-server job on Ray: a server actor and worker actors.",
    WORKERS,
    knob("cpus_per_worker", float, 1.0,
         "CPUs Ray reserves for each worker actor (its num_cpus; may be a fraction). The "
         "server's actor reserves none: it is pinned to the driver's node, whose cores "
         "--threads shares between the shards and the workers placed there.",
         type=click.FloatRange(min=0)),
    knob("gpus_per_worker", float, 0.0,
         "GPUs Ray reserves for each worker actor (its num_gpus; may be a fraction). Needs "
         "--device cuda: Ray shows an actor only the GPUs it reserved.",
         type=click.FloatRange(min=0)),
    knob("max_restarts", int, 3,
         "Times Ray restarts each worker actor whose process dies (killed, out of memory, its "
         "node lost); the restarted worker rejoins the server as a new incarnation, and "
         "pushes still apply exactly once. A worker dead for good ends the job (the server "
         "saves its run: continue with --resume).", type=click.IntRange(min=0)),
    knob("address", Optional[str], None,
         "The Ray cluster to run on: HOST:PORT of its head, or 'auto' (the cluster 'ray "
         "start' began on this host). The driver (this command) must run on one of its "
         "nodes: the server's actor runs beside it and writes the run directory there.",
         metavar="HOST:PORT", show="$RAY_ADDRESS, else a Ray of its own on this host, "
         "stopped after the job"),
    knob("start_timeout", float, 120.0,
         "Seconds Ray may take to place and start the actors (it waits for free resources, "
         "an autoscaler for new nodes); then the job fails, naming what it asked for and what "
         "the cluster has.", type=click.FloatRange(min=1)),
    JobConfig,
    left_out=frozenset({"servers", "local_workers"}),
    module=__name__)
