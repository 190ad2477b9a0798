"""How a run turns Ctrl-C and SIGTERM into a stop.

A training parent stops alike on both: ``sigterm_as_interrupt`` makes SIGTERM
raise KeyboardInterrupt, which every mode's ``Outcome.watch`` records as an
interrupted run before it saves. A DDP rank must not leave a collective half
done, so ``signals_as_flag`` only sets a flag that the ranks agree on at their
next check.
"""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Within this block SIGTERM raises KeyboardInterrupt, so Ctrl-C and SIGTERM stop alike."""

    def handler(signum, frame):
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
def signals_as_flag(flag: list):
    """SIGINT and SIGTERM set ``flag[0]`` instead of raising: a DDP rank must not leave a
    collective half done; it stops at the next check, with every other rank."""

    def handler(signum, frame):
        flag[0] = True

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
