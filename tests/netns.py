"""Several "hosts" on one machine, for multi-host tests.

Each host is a Linux network namespace with one interface, ``eth0``, that has the
address ``{subnet}.{i+1}/24``.  The hosts are joined by veth pairs to a bridge that
lives in a namespace of its own (the "switch"), so nothing here ever touches the
interfaces, addresses or routes of the root namespace, and two ``Hosts`` (even in
parallel test runs, even with the same subnet) cannot see each other.

    from netns import Hosts, can_make_namespaces

    ok, why = can_make_namespaces()          # (False, reason) when not root, no `ip`, ...
    with Hosts(["a", "b", "c"]) as hosts:
        hosts.address("a")                   # '10.213.7.1'
        server = hosts.popen("a", [sys.executable, "-c", "..."], stdout=subprocess.PIPE)
        hosts.run("b", ["ip", "-o", "addr"], capture_output=True, text=True)

Needs ``ip`` from iproute2 and the right to create network namespaces (root, or
CAP_SYS_ADMIN + CAP_NET_ADMIN).  Everything created is removed on ``__exit__`` (also
after a setup that failed half-way), at interpreter exit for contexts that were never
exited, and namespaces left behind by test processes that died are swept the next time
a ``Hosts`` is entered.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from typing import Dict, List, Optional, Sequence, Tuple

PREFIX = "asgdt"                       # every namespace created here is named PREFIX-<pid>-...
IP_TIMEOUT = 20.0                      # seconds for each `ip` command
RUN_TIMEOUT = 60.0                     # default timeout of Hosts.run
_BRIDGE = "br0"                        # names inside our own namespaces cannot collide
_seq = itertools.count()
_lock = threading.Lock()
_live: "set[Hosts]" = set()            # entered and not yet cleaned up (for atexit)
_probe_result: Optional[Tuple[bool, str]] = None


def ip_binary() -> Optional[str]:
    """Path of `ip` (also looked for in the sbin folders, which a user's PATH may lack)."""
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip")
         if os.access(p, os.X_OK)), None)


def _ip(*args: str, timeout: float = IP_TIMEOUT) -> str:
    """Run ``ip ARGS``; return stdout, raise RuntimeError with the command and stderr on failure."""
    exe = ip_binary()
    if exe is None:
        raise RuntimeError("`ip` (iproute2) is not installed")
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


def list_namespaces() -> List[str]:
    """Names from ``ip netns list`` (which prints e.g. ``name (id: 3)``)."""
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_namespace_pids(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns``; otherwise `ip netns del` only drops the
    name and the namespace (with its veth and addresses) lives on with those processes."""
    try:
        pids = [int(p) for p in _ip("netns", "pids", ns).split()]
    except (RuntimeError, ValueError):
        return
    for pid in pids:
        if pid != os.getpid():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _delete_namespace(ns: str) -> Optional[str]:
    """Kill what runs in ``ns`` and delete it; return an error message or None."""
    _kill_namespace_pids(ns)
    try:
        _ip("netns", "del", ns)
    except RuntimeError as exc:
        try:
            if ns not in list_namespaces():
                return None                   # already gone
        except RuntimeError:
            pass
        return str(exc)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> List[str]:
    """Delete namespaces named ``PREFIX-<pid>-...`` whose process no longer exists
    (left behind by a test run that was SIGKILLed).  Returns the names deleted."""
    gone = []
    try:
        names = list_namespaces()
    except RuntimeError:
        return gone
    for ns in names:
        m = re.match(rf"{PREFIX}-(\d+)-", ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            if _delete_namespace(ns) is None:
                gone.append(ns)
    return gone


def can_make_namespaces() -> Tuple[bool, str]:
    """(True, "") if this process can create namespaces with a bridge and a veth pair
    inside, else (False, reason).  Really tries (once; the result is cached)."""
    global _probe_result
    with _lock:
        if _probe_result is None:
            _probe_result = _probe()
        return _probe_result


def _probe() -> Tuple[bool, str]:
    if not os.path.exists("/proc/self/ns/net"):
        return False, "network namespaces need Linux (/proc/self/ns/net is missing)"
    if ip_binary() is None:
        return False, "`ip` from iproute2 is not installed (e.g. `apt-get install iproute2`)"
    ns = f"{PREFIX}-{os.getpid()}-probe"
    failure = ""
    created = False
    try:
        _ip("netns", "add", ns)
        created = True
        _ip("-n", ns, "link", "add", _BRIDGE, "type", "bridge")
        _ip("-n", ns, "link", "add", "h0", "type", "veth", "peer", "name", "p0")
        _ip("-n", ns, "link", "set", "p0", "master", _BRIDGE)
    except RuntimeError as exc:
        euid = os.geteuid() if hasattr(os, "geteuid") else -1
        hint = "" if euid == 0 else f" (running as uid {euid}, not root)"
        failure = f"cannot create a network namespace with a bridge and a veth pair{hint}: {exc}"
    if created:
        err = _delete_namespace(ns)
        if err and not failure:
            failure = f"created a throwaway namespace but could not delete it: {err}"
    if failure:
        return False, failure
    return True, ""


class Hosts:
    """Context manager: one network namespace per name, all on one bridge."""

    def __init__(self, names: Sequence[str], subnet: str = "10.213.7"):
        names = list(names)
        if not names:
            raise ValueError("Hosts needs at least one host name")
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        if len(names) > 254:
            raise ValueError("at most 254 hosts fit in a /24")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", subnet) or \
                any(int(o) > 255 for o in subnet.split(".")):
            raise ValueError("subnet must be the first three octets, like '10.213.7', "
                             f"not {subnet!r}")
        self.names = names
        self.subnet = subnet
        tag = f"{PREFIX}-{os.getpid()}-{next(_seq)}"
        self.switch_ns = f"{tag}-sw"
        self._ns: Dict[str, str] = {
            n: f"{tag}-h{i}-{re.sub(r'[^A-Za-z0-9_.-]', '', str(n))[:20]}".rstrip("-")
            for i, n in enumerate(names)}
        self._addr: Dict[str, str] = {n: f"{subnet}.{i + 1}" for i, n in enumerate(names)}
        self._created: List[str] = []          # namespaces that exist, in creation order
        self._procs: List[subprocess.Popen] = []
        self._entered = False

    # ----------------------------------------------------------------- setup
    def __enter__(self) -> "Hosts":
        if self._entered:
            raise RuntimeError("a Hosts context can only be entered once")
        self._entered = True
        with _lock:
            _live.add(self)
        try:
            sweep_stale()
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)

    def _setup(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _ip("-n", sw, "link", "add", _BRIDGE, "type", "bridge")   # STP off: ports forward at once
        _ip("-n", sw, "link", "set", _BRIDGE, "up")
        for i, name in enumerate(self.names):
            ns, inside, port = self._ns[name], f"h{i}", f"p{i}"
            self._add_ns(ns)
            # both ends are made in the switch namespace (names only need to be unique
            # there), then one end moves to the host and is renamed eth0
            _ip("-n", sw, "link", "add", inside, "type", "veth", "peer", "name", port)
            _ip("-n", sw, "link", "set", port, "master", _BRIDGE)
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", sw, "link", "set", inside, "netns", ns)
            _ip("-n", ns, "link", "set", inside, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self._addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", "eth0", "up")

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
        errors = []
        for ns in reversed(self._created):
            err = _delete_namespace(ns)
            if err:
                errors.append(err)
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

    def command(self, name: str, argv: Sequence[str]) -> List[str]:
        """The argv that runs ``argv`` inside host ``name``."""
        exe = ip_binary() or "ip"
        return [exe, "netns", "exec", self.namespace(name), *[str(a) for a in argv]]

    def popen(self, name: str, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``argv`` inside host ``name``.  ``ip netns exec`` execs the command, so
        the Popen's pid is the command itself.  Still-running ones are killed on exit."""
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


@atexit.register
def _cleanup_at_exit() -> None:
    with _lock:
        live = list(_live)
    for hosts in live:
        try:
            hosts.close()
        except Exception:
            pass
