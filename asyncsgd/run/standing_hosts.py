"""``asyncsgd hosts up|down|list``: shaped hosts that stay up, for runs started by hand.

They are ``run.hosts.Hosts`` with ``standing=True``: named ``asgd-<name>``, never swept,
removed only by ``down``. One set stands at a time.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import List, Optional

from ..errors import ConfigError
from .hosts import SWITCH, Hosts
from .link import Link
from .namespaces import (PREFIX, STANDING, delete_namespace, ip, list_namespaces,
                         require_namespaces, tc)

SUBNET = "10.213.50"
PS_PORT, DDP_PORT = 5555, 29500


def standing() -> List[str]:
    """The namespaces ``up`` made and ``down`` has not removed."""
    return [ns for ns in list_namespaces() if STANDING.match(ns)]


def up(names: list, link_text: Optional[str], subnet: str = SUBNET) -> Hosts:
    """Make the hosts and leave them standing; ConfigError (one line) when they cannot be."""
    link = Link.parse(link_text)
    try:
        hosts = Hosts(names, subnet, link, standing=True)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    require_namespaces("asyncsgd hosts up", "" if link is None else "leave --link out",
                       shaped=link is not None)
    there = standing()
    if there:
        raise ConfigError(f"hosts stand already ({', '.join(there)}); take them down first "
                          "with 'asyncsgd hosts down'")
    try:
        hosts.create()
    except RuntimeError as exc:
        raise ConfigError(f"could not make the hosts: {' '.join(str(exc).split())}") from None
    return hosts


def down() -> List[str]:
    """Kill what runs in the standing hosts and delete them; the names deleted."""
    require_namespaces("asyncsgd hosts down", shaped=False)
    names = standing()
    switch = f"{PREFIX}-{SWITCH}"
    names.sort(key=lambda ns: (ns == switch, ns))  # hosts first, the switch last
    errors = [e for e in map(delete_namespace, names) if e]
    if errors:
        raise ConfigError("could not delete: " + "; ".join(" ".join(e.split()) for e in errors))
    return names


def listing() -> List[str]:
    """One line per standing host: its name, namespace, address and link."""
    lines = []
    for ns in standing():
        if ns == f"{PREFIX}-{SWITCH}":
            continue
        try:
            addrs = json.loads(ip("-n", ns, "-j", "-4", "addr", "show", "dev", "eth0") or "[]")
            addr = next((a["local"] for i in addrs for a in i.get("addr_info", [])), "?")
            qdiscs = json.loads(tc("-n", ns, "-j", "qdisc", "show", "dev", "eth0") or "[]")
            tbf = next((q for q in qdiscs if q.get("kind") == "tbf"), None)
            rate = f"{tbf['options']['rate'] * 8 / 1e6:g} Mbit/s (tbf)" if tbf else "unshaped"
        except (RuntimeError, ValueError, KeyError) as exc:
            addr, rate = "?", f"unreadable: {' '.join(str(exc).split())}"
        lines.append((addr, f"{ns[len(PREFIX) + 1:]:12s} {addr:15s} {rate:22s} "
                            f"ip netns exec {ns} ..."))
    return [line for _, line in sorted(lines, key=lambda x: [int(o) if o.isdigit() else -1
                                                              for o in x[0].split(".")])]


def guide(hosts: Hosts) -> List[str]:
    """What ``asyncsgd hosts up`` prints: each host, then commands that use them."""
    link = f"a link of {hosts.link.describe()}" if hosts.link else "an unshaped link"
    lines = [f"{len(hosts.names)} host(s) up, each with {link} to one switch:"]
    for n in hosts.names:
        lines.append(f"  {n:12s} {hosts.address(n):15s} ip netns exec {hosts.namespace(n)} "
                     "COMMAND")
    if len(hosts.names) > 1:
        first, rest = hosts.names[0], hosts.names[1:]
        bind = f"tcp://{hosts.address(first)}:{PS_PORT}"
        lines += ["", f"A parameter server on {first}, a worker on each other host (each "
                      "command in a terminal of its own):",
                  "  " + _in(hosts, first, [*_asyncsgd(), "ps-server", "--bind", bind,
                                            "--workers", len(rest)])]
        lines += ["  " + _in(hosts, n, [*_asyncsgd(), "worker", "--server", bind, "--rank", r,
                                        "--world", len(rest)]) for r, n in enumerate(rest)]
        lines += ["", "DDP, one rank per host (GLOO_SOCKET_IFNAME=eth0: else gloo binds "
                      "what the hostname resolves to, often 127.0.0.1):"]
        lines += ["  " + _in(hosts, n, [
            "env", f"RANK={r}", f"WORLD_SIZE={len(hosts.names)}",
            f"MASTER_ADDR={hosts.address(first)}", f"MASTER_PORT={DDP_PORT}",
            "GLOO_SOCKET_IFNAME=eth0", *_asyncsgd(), "ddp", "--backend", "gloo"])
            for r, n in enumerate(hosts.names)]
    lines += ["", "Take them down with: asyncsgd hosts down"]
    return lines


def _in(hosts: Hosts, name: str, argv: list) -> str:
    return " ".join(shlex.quote(str(a)) for a in ["ip", "netns", "exec",
                                                  hosts.namespace(name), *argv])


def _asyncsgd() -> list:
    """This installation's CLI by its full path: root's PATH may lack the virtualenv's."""
    script = Path(sys.executable).parent / "asyncsgd"
    return [str(script)] if script.exists() else [sys.executable, "-m", "asyncsgd"]
