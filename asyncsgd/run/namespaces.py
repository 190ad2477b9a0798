"""Network namespaces through iproute2: create, list, empty, delete, and whether we may at all.

Every namespace made here is named ``asgd-...``: ``asgd-<pid>-<n>-...`` for those a process
owns (a SIGKILLed owner's are swept by the next: ``sweep_stale``), ``asgd-<name>`` for the
ones ``asyncsgd hosts up`` leaves standing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from typing import List, Optional, Tuple

from ..errors import ConfigError
from .lifetime import pid_alive

PREFIX = "asgd"
OWNED = re.compile(rf"{PREFIX}t?-(\d+)-")  # asgd-<pid>-...: a process owns it (asgdt-: old tests)
STANDING = re.compile(rf"{PREFIX}-[A-Za-z]")  # asgd-<name>: made by `asyncsgd hosts up`
NAMED = "/run/netns"  # where `ip netns add` mounts the namespaces it names
IP_TIMEOUT = 20.0  # seconds for each `ip` or `tc` command
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_lock = threading.Lock()
_probed: Optional[Tuple[str, str]] = None  # (why not namespaces, why not shaping); "" = can


def in_staged_host(named: str = NAMED) -> bool:
    """Whether this process runs in a named network namespace (one of ``named``, as
    ``ip netns add`` makes them, and ``asyncsgd hosts up``): a host staged on this machine,
    whose cores the other staged hosts share. ``ip netns identify`` compares so too."""
    try:
        own = os.stat("/proc/self/ns/net")
        entries = list(os.scandir(named))
    except OSError:
        return False
    for entry in entries:
        try:
            found = os.stat(entry.path)
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (own.st_dev, own.st_ino):
            return True
    return False


def binary(name: str) -> Optional[str]:
    """Path of ``ip`` or ``tc`` (also looked for in the sbin folders a user's PATH may lack)."""
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}", f"/usr/bin/{name}", f"/bin/{name}")
         if os.access(p, os.X_OK)), None)


def ip_binary() -> Optional[str]:
    return binary("ip")


def run_tool(tool: str, *args: str, timeout: float = IP_TIMEOUT) -> str:
    """Run ``ip ARGS`` or ``tc ARGS``; stdout, or RuntimeError with the command and stderr."""
    exe = binary(tool)
    if exe is None:
        raise RuntimeError(f"`{tool}` (iproute2) is not installed")
    cmd = [exe, *args]
    try:
        res = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"command timed out after {timeout}s: {' '.join(cmd)}") from exc
    except OSError as exc:
        raise RuntimeError(f"cannot run {' '.join(cmd)}: {exc}") from exc
    if res.returncode != 0:
        raise RuntimeError(f"command failed (exit {res.returncode}): {' '.join(cmd)}\n"
                           f"stderr: {res.stderr.strip() or '(empty)'}")
    return res.stdout


def ip(*args: str) -> str:
    return run_tool("ip", *args)


def tc(*args: str) -> str:
    return run_tool("tc", *args)


def list_namespaces() -> List[str]:
    """Names from ``ip netns list`` (which prints e.g. ``name (id: 3)``)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def kill_namespace_pids(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns``; otherwise `ip netns del` only drops the
    name and the namespace (with its veth and addresses) lives on with those processes."""
    try:
        pids = [int(p) for p in ip("netns", "pids", ns).split()]
    except (RuntimeError, ValueError):
        return
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def delete_namespace(ns: str) -> Optional[str]:
    """Kill what runs in ``ns`` and delete it; return an error message or None."""
    kill_namespace_pids(ns)
    try:
        ip("netns", "del", ns)
    except RuntimeError as exc:
        try:
            if ns not in list_namespaces():
                return None  # already gone
        except RuntimeError:
            pass
        return str(exc)
    return None


def sweep_stale() -> List[str]:
    """Delete owned namespaces (``asgd-<pid>-...``) whose process no longer exists (it was
    SIGKILLed before it could clean up). Returns the names deleted."""
    gone: List[str] = []
    try:
        names = list_namespaces()
    except RuntimeError:
        return gone
    for ns in names:
        m = OWNED.match(ns)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            if delete_namespace(ns) is None:
                gone.append(ns)
    return gone


# -- may we? ---------------------------------------------------------------------------------

def _missing_capabilities() -> Optional[str]:
    """'running as uid N' when this process lacks CAP_NET_ADMIN or CAP_SYS_ADMIN, else None."""
    if os.geteuid() == 0:
        return None
    try:
        with open("/proc/self/status") as fh:
            caps = next(int(line.split()[1], 16) for line in fh if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError):
        caps = 0
    if caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1:
        return None
    return f"running as uid {os.geteuid()}"


def _first_line(exc: Exception) -> str:
    """The stderr of a failed command, else its message, as one line."""
    text = str(exc)
    stderr = text.split("stderr:", 1)[1] if "stderr:" in text else text
    return " ".join(stderr.split())


def _probe() -> Tuple[str, str]:
    """Really make a throwaway namespace with a bridge, a veth pair and a tbf qdisc. Returns
    (why not namespaces, why not shaping), each 'needs WHAT; FIX' or '' when it can."""
    if not os.path.exists("/proc/self/ns/net"):
        why = "needs Linux network namespaces (/proc/self/ns/net is missing); run on Linux"
        return why, why
    who = _missing_capabilities()
    if who is not None:
        why = f"needs root to create network namespaces ({who}); run as root"
        return why, why
    missing = [t for t in ("ip", "tc") if binary(t) is None]
    if missing:
        why = (f"needs {' and '.join(f'`{t}`' for t in missing)} from iproute2, not found; "
               "install iproute2 (apt-get install iproute2)")
        return why, why
    ns = f"{PREFIX}-{os.getpid()}-probe"
    no_ns = no_shaping = ""
    try:
        ip("netns", "add", ns)
    except RuntimeError as exc:
        why = f"needs network namespaces, which `ip netns add` could not make: {_first_line(exc)}"
        return why, why
    try:
        ip("-n", ns, "link", "add", "br0", "type", "bridge")
        ip("-n", ns, "link", "add", "h0", "type", "veth", "peer", "name", "p0")
        ip("-n", ns, "link", "set", "p0", "master", "br0")
    except RuntimeError as exc:
        no_ns = f"needs bridges and veth pairs, which `ip` could not make: {_first_line(exc)}"
    if not no_ns:
        try:
            tc("-n", ns, "qdisc", "add", "dev", "h0", "root", "tbf", "rate", "1mbit",
               "burst", "16384", "latency", "10ms")
        except RuntimeError as exc:
            no_shaping = (f"needs the kernel's tbf qdisc, which tc could not add "
                          f"({_first_line(exc)}); load it with `modprobe sch_tbf`")
    err = delete_namespace(ns)
    if err and not no_ns:
        no_ns = ("needs to delete the namespaces it makes, and a throwaway one stayed: "
                 + _first_line(RuntimeError(err)))
    return no_ns, no_ns or no_shaping


def _probe_once() -> Tuple[str, str]:
    global _probed
    with _lock:
        if _probed is None:
            _probed = _probe()
        return _probed


def can_make_namespaces() -> Tuple[bool, str]:
    """(True, "") if this process can create namespaces with a bridge and a veth pair
    inside, else (False, 'needs WHAT; FIX'). Really tries (once; the result is cached)."""
    why = _probe_once()[0]
    return not why, why


def can_shape_links() -> Tuple[bool, str]:
    """As ``can_make_namespaces``, and a tbf qdisc can shape a veth too."""
    why = _probe_once()[1]
    return not why, why


def require_namespaces(who: str, instead: str = "", shaped: bool = True) -> None:
    """ConfigError, one line, unless namespaces (and, if ``shaped``, tbf) can be made:
    e.g. '--link needs root to create network namespaces (running as uid 1000); run as
    root, or leave --link out'."""
    ok, why = can_shape_links() if shaped else can_make_namespaces()
    if not ok:
        raise ConfigError(f"{who} {why}" + (f", or {instead}" if instead else ""))
