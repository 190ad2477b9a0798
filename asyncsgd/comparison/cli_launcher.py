"""Owned ``asyncsgd`` CLI subprocesses: what ``compare`` runs every mode with.

A child is the installed CLI run as a user would start it, logging to files (never a
pipe nobody reads), in a process group of its own (Ctrl-C reaches only the caller) but
not a session of its own: Linux schedules a session as one group (autogroup), which
slows a parameter server split across sessions (experiments/README.md, "Sessions and
autogroup"). It gets SIGTERM when the caller dies, even by SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ..run.process_group import describe_exit

log = logging.getLogger(__name__)

TAIL_BYTES = 8192


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the caller retries if it is taken meanwhile)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Started as `python -c _TRAMPOLINE PARENT_PID ARGV...`: asks the kernel for SIGTERM when the
# parent dies (the setting survives exec), then becomes the command. Doing this in a
# preexec_fn instead would run Python between fork and exec, unsafe in a threaded parent.
_TRAMPOLINE = """
import ctypes, os, signal, sys
if os.getpgrp() != os.getpid():  # Python < 3.11 has no Popen(process_group=)
    os.setpgid(0, 0)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""

# A process group of its own from the fork on (Python 3.11+); older ones join it in the
# trampoline, a few ms later.
OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {}


def cli_command(command: str, args: list) -> list:
    """The installed CLI, run by this interpreter, exactly as a user would start it."""
    return [sys.executable, "-m", "asyncsgd", command, *[str(a) for a in args]]


class Child:
    """One running ``asyncsgd`` command and its log files."""

    def __init__(self, name: str, argv: list, proc: subprocess.Popen, out: Path, err: Path):
        self.name, self.argv, self.proc = name, argv, proc
        self.out_path, self.err_path = out, err
        self.started = time.monotonic()

    @classmethod
    def start(cls, command: str, args: list, logs: Path, name: Optional[str] = None,
              env: Optional[dict] = None, where: Sequence[str] = ()) -> "Child":
        """``where``: a prefix that runs the rest elsewhere and execs it, keeping the pid
        (``Hosts.command(host)``: ``ip netns exec NS``)."""
        name = name or command
        logs.mkdir(parents=True, exist_ok=True)
        argv = cli_command(command, args)
        out, err = logs / f"{name}.out", logs / f"{name}.err"
        with open(out, "wb") as out_fh, open(err, "wb") as err_fh:
            proc = subprocess.Popen(
                [*where, sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *argv],
                stdin=subprocess.DEVNULL, stdout=out_fh, stderr=err_fh, env=env,
                **OWN_GROUP)
        log.info("started %s (pid %d): %s", name, proc.pid, " ".join([*where, *argv]))
        return cls(name, argv, proc, out, err)

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.poll()

    def failed(self) -> bool:
        code = self.returncode
        return code is not None and code != 0

    def stop(self, grace: float = 15.0) -> None:
        stop_all([self], grace)

    def stderr_tail(self, limit: int = TAIL_BYTES) -> str:
        try:
            with open(self.err_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - limit))
                return fh.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def last_line(self) -> str:
        """Its ``error:`` line, else the last line of its stderr ('' when silent)."""
        lines = [line.strip() for line in self.stderr_tail().splitlines() if line.strip()]
        chosen = next((line for line in reversed(lines) if line.startswith("error:")), None)
        return chosen or (lines[-1] if lines else "")

    def error(self) -> str:
        """Why it failed, in one line: how it exited and its last words."""
        last = self.last_line()
        return f"{self.name} {describe_exit(self.returncode)}" + (f": {last}" if last else "")


def stop_all(children: list, grace: float = 15.0) -> None:
    """Stop every child together, bounded: SIGINT (each saves its run) and up to ``grace`` s
    to exit, then SIGTERM and 5 s, then SIGKILL."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        running = [c for c in children if c.proc.poll() is None]
        if not running:
            return
        for c in running:
            log.info("sending %s to %s (pid %d)", sig.name, c.name, c.proc.pid)
            try:
                c.proc.send_signal(sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        for c in running:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for c in children:
        if c.proc.poll() is None:
            log.warning("%s (pid %d) survived SIGKILL", c.name, c.proc.pid)
