"""The fast tier: ``make check`` runs every test that starts no process and opens no socket.

A test leaves the fast tier (it is marked ``processes``) when it uses a fixture below, or its
module or itself carries the mark. Every other test runs under a guard: starting a process or
opening a socket fails it, so a test cannot sit in the fast tier by mistake.
"""

import contextlib
import functools
import multiprocessing.process
import multiprocessing.util
import platform
import sys
import threading

import pytest
import zmq

# fixtures that start processes or open sockets (the fixtures built on them, too)
PROCESS_FIXTURES = frozenset({
    "cli_env",  # every CLI subprocess: run_cli, server, keys, slow_env...
    "compared", "runs", "busy_machine", "local_ray", "local_slurm", "hang_up_server",
})

# the audit events of a process start or an OS socket; the last four are raised below
WATCHED = frozenset({
    "subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
    "os.system", "socket.bind", "socket.connect", "multiprocessing.Process.start",
    "multiprocessing.util.spawnv_passfds", "zmq.Socket.bind", "zmq.Socket.connect",
})


class UnmarkedProcessOrSocket(AssertionError):
    pass


_guarded = None  # the node id of the unmarked test in its setup, call or teardown now
_earlier_threads = frozenset()  # threads left by earlier tests: not this test's doing
_seen: list = []


def _audit(event, args):
    if _guarded is None or event not in WATCHED:
        return
    if threading.get_ident() in _earlier_threads:
        return
    if event.startswith("zmq.") and str(args[0]).startswith("inproc://"):
        return  # in-process messaging: no OS socket
    _seen.append(f"{event}{args!r}"[:300])
    raise UnmarkedProcessOrSocket(_message(_guarded))


def _message(nodeid):
    return (f"{nodeid} started a process or opened a socket ({'; '.join(_seen)}) but is in "
            "the fast tier: mark it @pytest.mark.processes (its module: pytestmark), or use "
            "a fixture listed in tests/tiers.py PROCESS_FIXTURES")


def _audited(event, original):
    """``original``, raising the audit ``event`` first: multiprocessing's spawn and
    forkserver starts and libzmq's sockets raise none of their own."""
    @functools.wraps(original)
    def call(*args, **kwargs):
        sys.audit(event, *args[1:2] if event.startswith("zmq.") else args[:1])
        return original(*args, **kwargs)
    return call


multiprocessing.process.BaseProcess.start = _audited(
    "multiprocessing.Process.start", multiprocessing.process.BaseProcess.start)
multiprocessing.util.spawnv_passfds = _audited(
    "multiprocessing.util.spawnv_passfds", multiprocessing.util.spawnv_passfds)
zmq.Socket.bind = _audited("zmq.Socket.bind", zmq.Socket.bind)
zmq.Socket.connect = _audited("zmq.Socket.connect", zmq.Socket.connect)
sys.addaudithook(_audit)
# once-per-process probes, done here rather than in whichever test comes first:
platform.platform()  # runs `uname -p` (then cached); every run directory records it
with contextlib.suppress(ImportError):
    import urllib3  # noqa: F401  (its import binds ::1 to learn whether IPv6 works)
with contextlib.suppress(ImportError):
    # its first import on a machine runs `fc-list` to build the font cache (~/.cache/
    # matplotlib), and mnist1d imports it: without this a fresh machine's first fast test
    # that builds an mnist1d task fails the guard, and leaves the cache unbuilt for the next
    import matplotlib.font_manager  # noqa: F401


def classify(items):
    for item in items:
        if PROCESS_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.processes)


def guard(item):
    """A hook wrapper's body: run one phase of ``item`` under the guard unless it is
    marked ``processes``."""
    global _guarded, _earlier_threads
    if item.get_closest_marker("processes"):
        return (yield)
    _seen.clear()
    _earlier_threads = frozenset(t.ident for t in threading.enumerate()
                                 if t is not threading.main_thread())
    _guarded = item.nodeid
    try:
        result = yield
    except BaseException as exc:
        if _seen:
            raise UnmarkedProcessOrSocket(_message(item.nodeid)) from exc
        raise
    finally:
        _guarded = None
    if _seen:  # something caught what the hook raised
        raise UnmarkedProcessOrSocket(_message(item.nodeid))
    return result
