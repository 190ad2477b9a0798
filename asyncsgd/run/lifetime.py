"""A command's lifetime: when it started, and how it ends once its work is saved.

``--max-seconds`` is the time a user waits for the command, start-up included:
``asyncsgd hogwild --procs 8 --max-seconds 15`` beside 6 busy processes on two
cores spent 5.3 s importing torch and loading its task before its Recorder
existed, and ended 25 s after it was started. ``start_command_clock`` (called
first thing by the CLI) takes the process's start from the kernel, so the
budget holds that start-up; ``WorkerGroup`` hands the clock to its children,
so a DDP rank measures the same budget as its parent. A run started from
Python (``hogwild.train(cfg)``) counts its budget from its Recorder. The run's
clock, metrics.jsonl's ``t``, starts at the same moment
(``recorder.clock_origin``), so its start-up and times to a target hold what
the budget holds.

``exit_now`` ends a process whose work is saved without the interpreter's
teardown of torch's modules: 1.3-2.4 s of CPU on the same loaded machine
(``python -c "import torch"`` took 6.4 s to exit, 4.2 s with ``exit_now``),
paid by every Hogwild worker and rank before the parent could report.

``pid_alive`` says whether a process still runs (a zombie does not), for those that
wait on processes they did not start.
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
    process's start)."""
    global _command_started
    _command_started = process_started_at() if at is None else at


def command_started_at() -> Optional[float]:
    """When this process's command started, or None where no command set the clock."""
    return _command_started


def exit_now(code: int) -> None:
    """End this process with ``code`` after the exit handlers (multiprocessing's
    finalizers, logging's flush) but without tearing down every module."""
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
