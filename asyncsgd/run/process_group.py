"""Owned child processes: spawned (never forked from the threaded parent), watched, joined with
timeouts, never orphaned, each given its share of the cores (``threads_per_process``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import select
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for
from typing import Any, Callable, Optional, Sequence

import torch.multiprocessing as mp

from ..errors import WorkerError
from .child_reports import ChildReports, send_report, tail
from .fork_server import set_preload, stop_fork_server
from .lifetime import command_started_at, exit_now, pid_alive, start_command_clock

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_MAX_TRACEBACK = 16_000  # bytes: a pipe holds 64 KiB; the parent drains it as it polls


def signal_on_parent_death(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent process dies (Linux's
    ``PR_SET_PDEATHSIG``); False where the platform cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_parent(parent_pid: int) -> None:
    """End this process the moment the training parent ``parent_pid`` dies.

    Under spawn the kernel does it (``PR_SET_PDEATHSIG`` follows the direct
    parent). Under forkserver the direct parent is the fork server, which
    outlives the training parent while any worker lives, so a daemon thread
    also waits on a pidfd of the training parent and exits when it closes.
    """
    signal_on_parent_death(signal.SIGKILL)  # not Linux: the watcher below still works
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # already gone (or no pidfd): poll instead
        pidfd = None
        if not pid_alive(parent_pid):
            os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, pidfd), daemon=True,
                     name="asyncsgd-parent-watch").start()


def _watch_parent(parent_pid: int, pidfd: Optional[int]) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the parent has exited
    else:
        while pid_alive(parent_pid):
            time.sleep(0.5)
    os._exit(1)


@contextlib.contextmanager
def _sigint_blocked():
    """Children started inside have SIGINT blocked from their first instruction.

    A blocked signal stays blocked across fork and exec: a Ctrl-C while a
    spawned child still imports torch (seconds, on a loaded machine) stays
    pending and can't kill it with a traceback; ``_child_main`` ignores SIGINT
    and only then unblocks it, which discards what was pending. The parent
    blocks it in the starting thread only and gets it back when the block
    ends (another thread, torch's or zmq's, may take it at once): its Ctrl-C is
    never lost. (Ignoring SIGINT here instead lost a Ctrl-C that came while
    the children were started: ``hogwild --procs 8`` beside 6 busy processes,
    interrupted at 1 s, ran on to its last epoch.)
    """
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def available_cores() -> int:
    """CPU cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def idle_cores() -> int:
    """Cores not busy with other work now: the available cores less the 1-minute load
    average (rounded down), at least 1."""
    try:
        busy = int(os.getloadavg()[0])
    except OSError:  # no load average on this platform
        busy = 0
    return max(1, available_cores() - busy)


def threads_per_process(procs: int, override: int = 0) -> int:
    """Torch threads for each of ``procs`` processes: cores // procs, at least 1.

    Without this every process starts one thread per core and N processes on
    C cores run N*C threads: Hogwild then collapses from oversubscription.
    """
    if override > 0:
        return override
    return max(1, available_cores() // max(1, procs))


def log_settings() -> Optional[tuple]:
    """(level, format, date format) of this process's logging, or None where nothing
    configured it (a library caller's choice, which children keep too)."""
    root = logging.getLogger()
    for handler in root.handlers:
        if handler.formatter is not None:
            return root.level, handler.formatter._fmt, handler.formatter.datefmt
    return None


def configure_logging(settings: Optional[tuple]) -> None:
    """Log as the parent does (``log_settings`` there), to this process's stderr."""
    if settings is not None:
        level, fmt, datefmt = settings
        logging.basicConfig(level=level, format=fmt, datefmt=datefmt, stream=sys.stderr,
                            force=True)


def _child_main(target: Callable, rank: int, report: Any, parent_pid: int,
                logging_of_parent: Optional[tuple], command_started: Optional[float],
                args: tuple, ignore_sigterm: bool = False) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops its children itself
    gc.enable()  # on even if a fork server's preload could not turn it back on (fork_server)
    if ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # (_sigint_blocked)
    _die_with_parent(parent_pid)
    configure_logging(logging_of_parent)
    if command_started is not None:
        start_command_clock(command_started)  # the parent's budget is this child's too
    try:
        target(rank, *args)
    except BaseException:
        text = tail(traceback.format_exc(), _MAX_TRACEBACK)
        if not send_report(report, text):  # the parent stopped reading: keep it on stderr
            sys.stderr.write(text)
        exit_now(1)
    exit_now(0)  # its work is saved; the parent waits for this exit (run.lifetime)


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


START_METHODS = ("spawn", "forkserver")
_LOST = 255  # multiprocessing's exit code for a forkserver child whose status died with it


def _fork_server_alive(wait: float = 1.0) -> bool:
    """Whether this process's fork server still runs (True when it cannot tell). Its
    children learn of its death while it is still exiting: wait up to ``wait`` s for it
    to be gone or a zombie (multiprocessing reaps it only at exit)."""
    from multiprocessing import forkserver
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is None:
        return True
    deadline = time.monotonic() + wait
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return True
        time.sleep(0.02)
    return False


def context(start_method: str, preload: Sequence[str] = ()):
    """A multiprocessing context that never forks the (threaded) training parent.

    ``spawn`` starts each child as a fresh interpreter: each imports torch.
    ``forkserver`` starts one fresh server that imports torch (and the modules in
    ``preload``, e.g. the one holding the children's target) once and forks every
    child from it, several times sooner (experiments/README.md, "Start-up and exit").
    """
    if start_method not in START_METHODS:
        raise ValueError(f"start method {start_method!r} not in {START_METHODS}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        set_preload(preload)
    return ctx


class WorkerGroup:
    """N spawned processes running ``target(rank, *args)``.

    Each child ignores SIGINT (on Ctrl-C the parent decides how to stop), ends itself
    when the parent dies (``PR_SET_PDEATHSIG`` and a pidfd watcher), logs at the parent's
    level and format, and sends its traceback through a pipe of its own
    (``child_reports``) before exiting non-zero. The parent polls the group: the first
    failure becomes a ``WorkerError`` naming the worker; ``stop`` ends every child in
    bounded time (a grace period, then SIGTERM, then SIGKILL).
    """

    _forking: set = set()  # groups of this process whose children the fork server forked

    def __init__(self, target: Callable, procs: int, args: Sequence[tuple], name: str = "worker",
                 start_method: str = "spawn", ignore_sigterm: bool = False):
        """``ignore_sigterm``: the children ignore SIGTERM as they ignore SIGINT, for children
        that must finish their stop (save their state) when a launcher signals the whole
        process group (torchrun's restart, Slurm's scancel): the parent gets the signal too
        and stops them itself; ``stop`` ends a child that does not stop with SIGKILL."""
        self.ctx = context(start_method, preload=[target.__module__])
        self.start_method = start_method
        self.target, self.parent_pid = target, os.getpid()
        self.name = name
        self._reports = ChildReports(procs)  # each child's traceback, should it raise
        self._stopped = False
        self._signalled: set = set()  # pids this group's stop() signalled: not failures
        self._logging = log_settings()
        self.ignore_sigterm = ignore_sigterm
        self.processes = [self._process(rank, args[rank]) for rank in range(procs)]

    def _process(self, rank: int, args: tuple):
        return self.ctx.Process(target=_child_main, name=f"asyncsgd-{self.name}-{rank}",
                                daemon=True,
                                args=(self.target, rank, self._reports.writer(rank),
                                      self.parent_pid,
                                      self._logging, command_started_at(), args,
                                      self.ignore_sigterm))

    def start(self) -> None:
        if self.start_method == "forkserver":
            WorkerGroup._forking.add(id(self))
        with _sigint_blocked():
            for rank, p in enumerate(self.processes):
                p.start()
                self._reports.handed_over(rank)

    def _drain_errors(self) -> None:
        """Read the tracebacks sent so far (a poll per child): also while none failed, so
        no child blocks on a report larger than its pipe holds."""
        if not self._stopped:  # stop() drained the pipes one last time and closed them
            self._reports.drain()

    def check(self) -> None:
        """Raise ``WorkerError`` for the first worker that failed.

        First in time, not lowest rank: each traceback says when it was sent, so when
        one failure causes others (a DDP rank whose peer died), the
        cause is reported, not its consequences.
        """
        self._drain_errors()
        failed = {r: p for r, p in enumerate(self.processes) if self._failed(p)}
        if not failed:
            return
        self._drain_errors()  # what those that exited sent before they did
        first = self._reports.first(failed)
        rank = min(failed) if first is None else first
        proc = failed[rank]
        text = self._reports.get(rank)
        if text:
            raise WorkerError(rank, f"{self.name} {rank} raised an exception; its traceback:\n"
                                    f"{text.rstrip()}")
        how = describe_exit(proc.exitcode)
        if (self.start_method == "forkserver" and proc.exitcode == _LOST
                and not _fork_server_alive()):
            how = ("was lost with the fork server that started it, which died (was it killed?); "
                   "--start-method spawn starts workers without one")
        raise WorkerError(rank, f"{self.name} {rank} {how}")

    def failed(self) -> list:
        """Ranks whose process exited with an error or was killed (not by our own stop)."""
        self._drain_errors()
        return [r for r, p in enumerate(self.processes) if self._failed(p)]

    def _failed(self, p) -> bool:
        if p.exitcode in (None, 0):
            return False
        # Our own stop's SIGTERM/SIGKILL ended it: the parent's doing, not the child's failure.
        return not (p.pid in self._signalled and -p.exitcode in (signal.SIGTERM, signal.SIGKILL))

    def restart(self, rank: int, args: tuple) -> str:
        """Start ``rank`` afresh with ``args`` after it failed; returns how it had ended."""
        old = self.processes[rank]
        self._drain_errors()
        text = self._reports.pop(rank)
        how = describe_exit(old.exitcode) + (f"; its traceback:\n{text.rstrip()}" if text else "")
        old.join(0)
        self.processes[rank] = self._process(rank, args)
        with _sigint_blocked():
            self.processes[rank].start()
        self._reports.handed_over(rank)
        return how

    def alive(self) -> int:
        return sum(p.is_alive() for p in self.processes)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for any child to exit; True when all have exited."""
        running = [p.sentinel for p in self._started() if p.exitcode is None]
        if running:
            wait_for(running, timeout)
        return all(p.exitcode is not None for p in self._started())

    def _started(self) -> list:
        return [p for p in self.processes if p.pid is not None]

    def stop(self, grace: float = 5.0, starting: Callable[[int], bool] = lambda rank: False
             ) -> None:
        """End every child once told to stop (the caller's flag): wait ``grace`` s, then
        SIGTERM, then SIGKILL. Always bounded, and never reported as the children's failure.

        ``starting(rank)``: the child is still starting (importing torch: seconds on a
        loaded machine) and holds nothing yet; it gets SIGTERM at once, without a warning,
        instead of delaying the stop by ``grace``."""
        early = [p for r, p in enumerate(self.processes)
                 if p.pid is not None and p.exitcode is None and starting(r)]
        for p in early:
            self._signalled.add(p.pid)
            p.terminate()
        self.wait_all(grace)
        for sig_step in ("terminate", "kill"):
            stragglers = [p for p in self._started() if p.exitcode is None]
            if not stragglers:
                break
            log.warning("%d %s process(es) still running %.0f s after the stop; sending %s",
                        len(stragglers), self.name, grace,
                        "SIGTERM" if sig_step == "terminate" else "SIGKILL")
            for p in stragglers:
                self._signalled.add(p.pid)
                getattr(p, sig_step)()
            self.wait_all(2.0)
        self._drain_errors()
        for p in self._started():
            if p.exitcode is not None:
                p.join(0)
        self._reports.close()
        self._stopped = True
        WorkerGroup._forking.discard(id(self))
        if (self.start_method == "forkserver" and not WorkerGroup._forking
                and all(p.exitcode is not None for p in self._started())):
            stop_fork_server()

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if self.wait(max(0.0, remaining)) or remaining <= 0:
                return all(p.exitcode is not None for p in self._started())
