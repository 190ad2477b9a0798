"""``compare --link RATE``: where each process of a run stands, and what crossed the links.

The ps-* modes run the server on host ``server`` and worker r on ``worker<r>``; ddp runs
rank r on ``rank<r>``, as torchrun would start it. Every host is a network namespace on
shaped links (``run.hosts``); single and hogwild are one host and run unshaped.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from ..errors import AsyncSGDError, ConfigError
from ..run.hosts import Hosts
from ..run.link import Link
from ..run.namespaces import require_namespaces

log = logging.getLogger(__name__)

SHAPED_COMMANDS = ("ps-server", "ddp")
SUBNET = "10.213.7"  # any: each run's hosts have a switch of their own


class HostsError(AsyncSGDError):
    """A run's hosts could not be made: that run fails, the comparison goes on."""


def check_link(text: Optional[str], ddp_backend: str) -> Optional[Link]:
    """The parsed --link, once it is known that its namespaces can be made (else one line)."""
    link = Link.parse(text)
    if link is None:
        return None
    if ddp_backend == "nccl":
        raise ConfigError("--link with --ddp-backend nccl: NCCL joins ranks of one machine "
                          "through shared memory or NVLink, around the link; use "
                          "--ddp-backend gloo or auto (which --link makes gloo)")
    require_namespaces("--link", "leave --link out")
    return link


def host_names(command: str, procs: int) -> list:
    if command == "ddp":
        return [f"rank{r}" for r in range(procs)]
    return ["server"] + [f"worker{r}" for r in range(procs)]


def rank_env(hosts: Hosts, rank: int, world: int, port: int) -> dict:
    """What torchrun would give rank ``rank``, and GLOO_SOCKET_IFNAME: without it gloo binds
    the address the hostname resolves to, 127.0.0.1 here ("vm" in /etc/hosts), in every
    namespace, and each rank dials its own loopback for the other: a 2-rank run hung with
    no step in 120 s. (LOCAL_*: the ranks do share this machine's cores.)"""
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world), MASTER_ADDR=hosts.address("rank0"),
                MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="eth0")


def placement(hosts: Hosts) -> dict:
    """host -> its namespace and address (results.json keeps it with the traffic)."""
    return {n: {"namespace": hosts.namespace(n), "address": hosts.address(n)}
            for n in hosts.names}


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def describe(link: Link, runs: dict) -> str:
    """The report's paragraph: how runs were placed, and the kernel's byte counts."""
    text = (f"Links: {link.describe()}. ps-* ran the server (its shards beside it) and "
            "each worker, ddp each rank, in a network namespace of its own, joined to one "
            "switch namespace by a veth pair shaped to that rate each way, so pushes, pulls "
            "and all-reduces cross limited links. single and hogwild run on one host: not "
            "shaped.")
    if runs:
        text += " Bytes the hosts sent over their links (kernel qdisc counters): " + "; ".join(
            (f"{label}: {_mb(sum(h['sent'] for h in hosts.values()))}"
             if all("sent" in h for h in hosts.values()) else f"{label}: counters unreadable")
            + (f", {sum(h.get('dropped', 0) for h in hosts.values())} frames dropped at full "
               "links" if any(h.get("dropped") for h in hosts.values()) else "")
            for label, hosts in runs.items()) + "."
    return text


def hosts_for(command: str, procs: int, link: Link) -> Hosts:
    """The entered hosts of one run; ``finish`` closes them."""
    hosts = Hosts(host_names(command, procs), SUBNET, link)
    try:
        return hosts.__enter__()
    except RuntimeError as exc:  # an `ip` or `tc` command failed; nothing is left behind
        raise HostsError(f"could not make its hosts: {' '.join(str(exc).split())}") from exc


def finish(hosts: Hosts) -> dict:
    """Read what crossed each host's link, then delete the hosts (and anything left in
    them): host -> namespace, address, bytes sent and received, frames dropped."""
    try:
        traffic = hosts.traffic()
    except (RuntimeError, ValueError) as exc:
        log.warning("could not read the links' counters: %s", exc)
        traffic = {}
    try:
        hosts.close()
    except RuntimeError as exc:
        log.warning("%s", exc)
    return {n: {**where, **traffic.get(n, {})} for n, where in placement(hosts).items()}
