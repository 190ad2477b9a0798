"""Several "hosts" on one machine: network namespaces on a switch, links optionally shaped, so
distributed runs and narrow links can be staged without a cluster.

Needs iproute2's ``ip`` and ``tc`` and root (or CAP_SYS_ADMIN + CAP_NET_ADMIN);
``run.namespaces.require_namespaces`` says so in one line.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import re
import subprocess
import threading
from typing import Dict, List, Optional, Sequence

from .link import Link
from .namespaces import PREFIX, delete_namespace, ip, ip_binary, sweep_stale, tc

RUN_TIMEOUT = 60.0  # default timeout of Hosts.run
BRIDGE = "br0"  # names inside our own namespaces cannot collide
SWITCH = "switch"  # the standing switch namespace: asgd-switch (no host may be named so)
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}")  # a standing host's name
_seq = itertools.count()
_lock = threading.Lock()
_live: "set[Hosts]" = set()  # entered and not yet cleaned up (for atexit)


def _check_names(names: list, subnet: str, standing: bool) -> None:
    if not names:
        raise ValueError("Hosts needs at least one host name")
    if len(set(names)) != len(names):
        raise ValueError(f"host names must be unique: {names}")
    if len(names) > 254:
        raise ValueError("at most 254 hosts fit in a /24")
    if standing:
        bad = [n for n in names if not NAME.fullmatch(str(n)) or n == SWITCH]
        if bad:
            raise ValueError(f"host name(s) {', '.join(map(repr, bad))}: use a letter, then "
                             f"letters, digits or _ (32 at most), and not {SWITCH!r}")
    if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet) or \
            any(int(o) > 255 for o in subnet.split(".")):
        raise ValueError(f"subnet must be the first three octets, like '10.213.7', not {subnet!r}")


class Hosts:
    """Context manager: one network namespace per name, all on one switch.

        with Hosts(["a", "b"], link=Link.parse("100mbit")) as hosts:
            server = hosts.popen("a", [sys.executable, "-c", "..."])
            hosts.command("b", ["asyncsgd", "worker"])   # ['/usr/sbin/ip', 'netns', ...]
            hosts.traffic()                  # {'a': {'sent': bytes, 'received': bytes, ...}}

    Host ``i`` has ``eth0`` at ``{subnet}.{i+1}/24``, joined by a veth pair to a bridge
    in a namespace of its own, so the root namespace is never touched and two ``Hosts``
    cannot see each other. With a ``link``, a tbf qdisc on eth0 limits what a host
    sends and one on the switch's end what it receives; loopback is not shaped.
    Everything is removed on ``__exit__`` (also after a failed setup), at interpreter
    exit, or by the next ``Hosts`` for namespaces of dead processes; ``standing=True``
    hosts (``asyncsgd hosts up``) are named ``asgd-<name>`` and outlive their maker.
    """

    def __init__(self, names: Sequence[str], subnet: str = "10.213.7",
                 link: Optional[Link] = None, standing: bool = False):
        names = list(names)
        _check_names(names, subnet, standing)
        self.names, self.subnet, self.link, self.standing = names, subnet, link, standing
        if standing:
            self.switch_ns = f"{PREFIX}-{SWITCH}"
            self._ns = {n: f"{PREFIX}-{n}" for n in names}
        else:
            tag = f"{PREFIX}-{os.getpid()}-{next(_seq)}"
            self.switch_ns = f"{tag}-sw"
            self._ns = {n: f"{tag}-h{i}-{re.sub(r'[^A-Za-z0-9_.-]', '', str(n))[:20]}".rstrip("-")
                        for i, n in enumerate(names)}
        self._addr: Dict[str, str] = {n: f"{subnet}.{i + 1}" for i, n in enumerate(names)}
        self._created: List[str] = []  # namespaces that exist, in creation order
        self._procs: List[subprocess.Popen] = []
        self._entered = False

    # ----------------------------------------------------------------- setup
    def __enter__(self) -> "Hosts":
        if self._entered:
            raise RuntimeError("a Hosts context can only be entered once")
        self._entered = True
        with _lock:
            _live.add(self)
        self.create()
        return self

    def create(self) -> None:
        """Make the namespaces, links and qdiscs; on any failure remove what was made."""
        try:
            sweep_stale()
            self._setup()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._created.append(ns)

    def _setup(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")  # STP off: ports forward at once
        ip("-n", sw, "link", "set", BRIDGE, "up")
        for i, name in enumerate(self.names):
            ns, inside, port = self._ns[name], f"h{i}", f"p{i}"
            self._add_ns(ns)
            # both ends are made in the switch namespace (names only need to be unique
            # there), then one end moves to the host and is renamed eth0
            ip("-n", sw, "link", "add", inside, "type", "veth", "peer", "name", port)
            ip("-n", sw, "link", "set", port, "master", BRIDGE)
            ip("-n", sw, "link", "set", port, "up")
            ip("-n", sw, "link", "set", inside, "netns", ns)
            ip("-n", ns, "link", "set", inside, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self._addr[name]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", "eth0", "up")
            if self.link is not None:
                tc("-n", ns, "qdisc", "replace", "dev", "eth0", "root", *self.link.tbf())
                tc("-n", sw, "qdisc", "replace", "dev", port, "root", *self.link.tbf())

    # --------------------------------------------------------------- cleanup
    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill processes started here and delete every namespace created (idempotent).
        Raises RuntimeError listing what could not be deleted, after trying everything."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    proc.kill()
                except OSError:
                    pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        errors = [err for err in map(delete_namespace, reversed(self._created)) if err]
        self._created.clear()
        with _lock:
            _live.discard(self)
        if errors:
            raise RuntimeError("could not delete network namespaces:\n" + "\n".join(errors))

    # ------------------------------------------------------------------- use
    @property
    def namespaces(self) -> Dict[str, str]:
        """host name -> namespace name (the switch is in ``switch_ns``)."""
        return dict(self._ns)

    def namespace(self, name: str) -> str:
        try:
            return self._ns[name]
        except KeyError:
            raise KeyError(f"no host {name!r}; hosts are {self.names}") from None

    def address(self, name: str) -> str:
        self.namespace(name)
        return self._addr[name]

    def command(self, name: str, argv: Sequence[str] = ()) -> List[str]:
        """The argv that runs ``argv`` inside host ``name`` (``ip netns exec`` execs it, so
        a process started so has the command's own pid)."""
        return [ip_binary() or "ip", "netns", "exec", self.namespace(name), *map(str, argv)]

    def popen(self, name: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``name``; still running ones are killed on exit."""
        if not self._created:
            raise RuntimeError("Hosts is not set up (use it as a context manager)")
        kw.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(self.command(name, argv), **kw)
        self._procs.append(proc)
        return proc

    def run(self, name: str, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """``subprocess.run`` inside host ``name`` (default timeout RUN_TIMEOUT seconds)."""
        if not self._created:
            raise RuntimeError("Hosts is not set up (use it as a context manager)")
        kw.setdefault("timeout", RUN_TIMEOUT)
        if "input" not in kw:
            kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.command(name, argv), **kw)

    def traffic(self) -> Dict[str, dict]:
        """Per host, from the kernel's counters of its link: bytes (and frames) it
        ``sent`` (its eth0) and ``received`` (the switch's end), and frames the switch
        ``dropped`` on the way to it (its link was full)."""
        out = {}
        for i, name in enumerate(self.names):
            sent = _qdisc_stats(self._ns[name], "eth0")
            got = _qdisc_stats(self.switch_ns, f"p{i}")
            out[name] = {"sent": sent["bytes"], "received": got["bytes"],
                         "dropped": got["drops"]}
        return out


def _qdisc_stats(ns: str, dev: str) -> dict:
    """The root qdisc's counters (bytes, packets, drops) of ``dev`` in ``ns``."""
    found = json.loads(tc("-n", ns, "-s", "-j", "qdisc", "show", "dev", dev) or "[]")
    root = next((q for q in found if q.get("root")), found[0] if found else {})
    return {"bytes": int(root.get("bytes", 0)), "packets": int(root.get("packets", 0)),
            "drops": int(root.get("drops", 0))}


@atexit.register
def _cleanup_at_exit() -> None:
    with _lock:
        live = list(_live)
    for hosts in live:
        try:
            hosts.close()
        except Exception:
            pass
