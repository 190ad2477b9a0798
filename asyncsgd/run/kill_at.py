"""Faults at chosen phases, for tests only: ``ASYNCSGD_TESTING_ONLY_KILL_AT=<phase>:<n>[:<file>]``
SIGKILLs a process the n-th time it reaches <phase> (tests/test_phase_faults.py).

The variable is read once, at import; unset, a phase costs a dict lookup. With <file>, only
the process that creates it (it holds that process's pid) is killed: children that inherit
the variable, such as a shard restarted after the kill, are killed no more.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

VARIABLE = "ASYNCSGD_TESTING_ONLY_KILL_AT"
# worker: a gradient computed, nothing sent; after part 0 of a push in parts; the push's
# acknowledgement waits unread in the socket; the acknowledgement was handled
BEFORE_PUSH, BETWEEN_PARTS = "before-push", "between-parts"
AFTER_APPLY_BEFORE_ACK, AFTER_ACK = "after-apply-before-ack", "after-ack"
# shard: around the write of a periodic checkpoint that holds updates (version > 0); a
# push applied (the version moved), its acknowledgement not yet sent;
# front: a session token made, the welcome that holds it not yet sent
BEFORE_CHECKPOINT, AFTER_CHECKPOINT = "before-checkpoint", "after-checkpoint"
APPLIED_UNACKED = "applied-unacked"
WHILE_WELCOMING = "while-welcoming"
PHASES = (BEFORE_PUSH, BETWEEN_PARTS, AFTER_APPLY_BEFORE_ACK, AFTER_ACK, BEFORE_CHECKPOINT,
          AFTER_CHECKPOINT, APPLIED_UNACKED, WHILE_WELCOMING)


def parse(text: str) -> dict:
    """{phase: [n, file or ""]} of the variable's value; {} when empty. A ValueError
    names what is wrong."""
    if not text:
        return {}
    phase, _, rest = text.partition(":")
    count, _, marker = rest.partition(":")
    if phase not in PHASES or not count.isdigit() or int(count) < 1:
        raise ValueError(f"${VARIABLE}={text!r}: expected <phase>:<n>[:<file>], a phase of "
                         f"{', '.join(PHASES)} and n >= 1")
    return {phase: [int(count), marker]}


_PLAN = parse(os.environ.get(VARIABLE, ""))


def planned() -> bool:
    """Whether any kill is planned in this process: a hot path asks once, not per phase."""
    return bool(_PLAN)


def reached(phase: str, prepare: Optional[Callable] = None, *args) -> None:
    """This process reached ``phase``: SIGKILL it when that is planned for this time,
    after ``prepare(*args)`` (what must have happened before the kill, e.g. a reply
    arriving)."""
    if phase not in _PLAN:
        return
    plan = _PLAN[phase]
    plan[0] -= 1
    if plan[0] != 0:
        return
    if plan[1]:
        try:
            fd = os.open(plan[1], os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return  # another process took this kill
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    if prepare is not None:
        prepare(*args)
    os.kill(os.getpid(), signal.SIGKILL)
