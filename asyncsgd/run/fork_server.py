"""The fork server's preload, starting it early (before this process imports torch), and
stopping it. Without torch, so that a command can start the server first thing and both
processes import torch at once, on two cores, instead of one after the other.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from multiprocessing import forkserver
from typing import Sequence


# Imported first: pauses the garbage collector for the imports after it (as
# run.lifetime.import_torch does in a command).
PAUSED = "asyncsgd.run.gc_paused"
# Imported last: freezes what the others made, and resumes the collector. 8 Hogwild workers
# forked from an unfrozen server each spent 0.55-0.65 s between their fork and their target
# (collections walking, and copying, the server's pages), 20-30 ms from a frozen one.
FROZEN = "asyncsgd.run.frozen"


def preload(modules: Sequence[str] = ()) -> list:
    """What the fork server imports before it forks any child: torch, then ``modules`` (the
    children's target's module, which imports what they unpickle), between ``PAUSED`` and
    ``FROZEN``."""
    return [PAUSED, "torch", *modules, FROZEN]


def set_preload(modules: Sequence[str] = ()) -> None:
    """Have the next fork server this process starts import ``preload(modules)``."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload(modules))


def start_early(modules: Sequence[str] = ()) -> None:
    """Start this process's fork server now, importing ``preload(modules)``, while this
    process goes on (importing torch itself, loading its task): the first child is forked
    once both are done, not after one and then the other (experiments/README.md,
    "Start-up and exit"). A server already running is kept; ``stop_fork_server`` ends one
    left unused."""
    set_preload(modules)
    forkserver.ensure_running()


def stop_fork_server() -> None:
    """End and reap this process's fork server. Stopped during start-up it may still be
    importing torch, for seconds, and would outlive the command that started it."""
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()  # closes its socket and waits for the pid: a new one starts if needed
