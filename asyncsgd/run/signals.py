"""How a run turns Ctrl-C and SIGTERM into a stop: a training parent raises KeyboardInterrupt on
both (``sigterm_as_interrupt``); a DDP rank only sets a flag (``signals_as_flag``) that the
ranks agree on, so no collective is left half done.
"""

from __future__ import annotations

import contextlib
import signal

_stopped_by: list = []  # the signals that asked this process to stop, first first


def interrupted_exit_code() -> int:
    """The exit status of a run stopped by a signal, as a shell reports one killed by it:
    128 + the first signal that came (Ctrl-C 130, SIGTERM 143); 130 for a Ctrl-C that
    Python's own handler turned into KeyboardInterrupt."""
    return 128 + (_stopped_by[0] if _stopped_by else signal.SIGINT)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within this block SIGTERM raises KeyboardInterrupt, so Ctrl-C and SIGTERM stop alike."""

    def handler(signum, frame):
        _stopped_by.append(signum)
        raise KeyboardInterrupt(f"received {signal.Signals(signum).name}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_as_flag(flag: list, second_raises: bool = False):
    """SIGINT and SIGTERM set ``flag[0]`` instead of raising: a DDP rank must not leave a
    collective half done; it stops at the next check, with every other rank.
    ``second_raises``: a second signal raises KeyboardInterrupt at once (``single``: a
    step or an evaluation that takes long, or hangs, can still be stopped; the run then
    saves where it is, which may be inside a step)."""

    def handler(signum, frame):
        _stopped_by.append(signum)
        if flag[0] and second_raises:
            raise KeyboardInterrupt(f"a second {signal.Signals(signum).name}: stopping now")
        flag[0] = True

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


_noted: list = []  # a Ctrl-C that came while a command imported its modules


def _note(signum, frame) -> None:
    _noted.append(signum)


def defer_sigint() -> None:
    """Until ``sigint_now``, a Ctrl-C is only noted. A command imports torch first (seconds
    on a loaded machine), and a KeyboardInterrupt raised inside that import is swallowed
    or turned into an ImportError (measured: Ctrl-C 0.3 s after ``asyncsgd worker``
    started was lost, and the worker ran on). A SIGINT the caller ignores stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _note)


def restore_sigint() -> None:
    """Ctrl-C raises KeyboardInterrupt again; one noted and not raised is dropped."""
    if signal.getsignal(signal.SIGINT) is _note:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _noted.clear()


def sigint_now() -> None:
    """The imports are done: Ctrl-C raises KeyboardInterrupt again, at once if one came."""
    if signal.getsignal(signal.SIGINT) is _note:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    came = bool(_noted)  # read after the handler is back: one noted in between still counts
    _noted.clear()
    if came:
        raise KeyboardInterrupt("Ctrl-C while starting")
