"""Settings of ``asyncsgd ray-job``: Ray's own (worker actors, their resources and restarts, the
cluster), then ``JobConfig``'s but the torchrun-only ones.
"""

from __future__ import annotations

import click

from ..config import JobConfig, derived_config, knob

_RAY_OWN = {
    "workers": (int, knob(
        2, "Worker actors. The server runs in an actor of its own, with its --shards shard "
        "processes as its children.", type=click.IntRange(min=1))),
    "cpus_per_worker": (float, knob(
        1.0, "CPUs Ray reserves for each worker actor (its num_cpus; may be a fraction). "
        "The server's actor reserves none: it is pinned to the driver's node, whose cores "
        "--threads shares between the shards and the workers placed there.",
        type=click.FloatRange(min=0))),
    "gpus_per_worker": (float, knob(
        0.0, "GPUs Ray reserves for each worker actor (its num_gpus; may be a fraction). "
        "Needs --device cuda: Ray shows an actor only the GPUs it reserved.",
        type=click.FloatRange(min=0))),
    "max_restarts": (int, knob(
        3, "Times Ray restarts each worker actor whose process dies (killed, out of memory, "
        "its node lost); the restarted worker rejoins the server as a new incarnation, and "
        "pushes still apply exactly once. A worker dead for good ends the job (the server "
        "saves its run: continue with --resume).", type=click.IntRange(min=0))),
    "address": ("Optional[str]", knob(
        None, "The Ray cluster to run on: HOST:PORT of its head, or 'auto' (the cluster "
        "'ray start' began on this host). The driver (this command) must run on one of its "
        "nodes: the server's actor runs beside it and writes the run directory there.",
        metavar="HOST:PORT", show="$RAY_ADDRESS, else a Ray of its own on this host, "
        "stopped after the job")),
    "start_timeout": (float, knob(
        120.0, "Seconds Ray may take to place and start the actors (it waits for free "
        "resources, an autoscaler for new nodes); then the job fails, naming what it asked "
        "for and what the cluster has.", type=click.FloatRange(min=1))),
}
# Left out: torchrun's (--servers: one server actor; --local-workers: the driver counts the
# worker actors Ray placed on each node).
_RAY_LEFT_OUT = {"servers", "local_workers"}
_RAY_HELP = {  # where ps-job's help would mislead
    "advertise": dict(type="Optional[str]", default=None, help="Host or IP the workers "
                      "reach the server at.", show="127.0.0.1 when it listens on loopback, "
                      "else the address Ray knows the driver's node by"),
    "bind": dict(type="Optional[str]", default=None, help="Where the server listens; port 0 "
                 "takes a free port, which the driver hands to the workers.",
                 show="tcp://127.0.0.1:0 on a one-node cluster (no peer elsewhere can reach "
                 "it), else tcp://0.0.0.0:0"),
    "device": dict(help="Where the workers compute gradients: cpu, or cuda (with "
                   "--gpus-per-worker). The server keeps the parameters in CPU memory."),
    "threads": dict(help="Torch threads of each shard and of each worker; 0 means the CPU "
                    "cores of each node shared among the job's processes there (its worker "
                    "actors, and the shards on the driver's node), at least 1."),
    "max_seconds": dict(help="Stop this many seconds after the command started (Ray's "
                        "start-up counts), server and workers alike; from Python, after "
                        "asyncsgd.ray.run was called.", show="no limit"),
}

RayJobConfig = derived_config(
    "RayJobConfig", "ray-job", "Settings of ``asyncsgd ray-job`` (``asyncsgd.ray.run``): a "
    "whole parameter-server job on Ray: a server actor and worker actors.", _RAY_OWN,
    (JobConfig,), _RAY_LEFT_OUT, _RAY_HELP, module=__name__)
