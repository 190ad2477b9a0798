"""A command's lifetime: when it started, so that ``--max-seconds`` and the run's clock hold the
start-up a user waits through, and how it ends once its work is saved.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import Optional

_command_started: Optional[float] = None


def process_started_at() -> float:
    """The ``time.monotonic()`` at which this process started (Linux; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, in clock ticks after boot (proc(5))
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


def start_command_clock(at: Optional[float] = None) -> None:
    """Budgets in this process count from ``at`` (``time.monotonic()``; default: the
    process's start, as the kernel recorded it).

    Called first thing by the CLI, so ``--max-seconds`` holds the start-up a user waits
    through (importing torch, loading the task); ``WorkerGroup`` hands the clock to its
    children. A run started from Python counts from its Recorder instead."""
    global _command_started
    _command_started = process_started_at() if at is None else at


def command_started_at() -> Optional[float]:
    """When this process's command started, or None where no command set the clock."""
    return _command_started


def import_torch() -> None:
    """Import torch for a command (the process of one command, which ends with it): with
    the cyclic garbage collector paused meanwhile, then with what is alive frozen
    (``gc.freeze``). The modules torch made live as long as the process; walked by every
    full collection, they cost the imports after torch's, a PS worker's, 160 ms of CPU
    against 72 ms frozen (medians of 5, experiments/README.md, "Start-up and exit")."""
    import gc
    was = gc.isenabled()
    gc.disable()
    try:
        import torch  # noqa: F401
    finally:
        if was:
            gc.enable()
    gc.freeze()


def exit_now(code: int) -> None:
    """End this process with ``code`` after the exit handlers (multiprocessing's
    finalizers, logging's flush) but without tearing down every module: torch's teardown
    costs seconds of CPU on a loaded machine, paid by every Hogwild worker and rank before
    the parent could report (experiments/README.md, "Start-up and exit")."""
    try:
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or gone (a closed pipe): nothing to save
                pass
        os._exit(code)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (someone else's counts); a zombie its parent has not
    reaped yet does not, nor one that ends while this looks."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return not os.path.isdir("/proc")  # no /proc (not Linux): kill's answer stands
