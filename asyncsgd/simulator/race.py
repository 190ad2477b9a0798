"""Candidates racing on the virtual clock: several runs advance together, and the first to
reach its target stops the rest there (``simulate --tune lr``)."""

from __future__ import annotations

import time

from ..errors import WorkerError


RACE_NOTE_SECONDS = 10.0  # how often a race says where it stands, in real seconds


def race(racers: dict, step: float, say=None) -> dict:
    """Advance every engine of ``racers`` (lr -> engine) ``step`` virtual seconds at a
    time until each has stopped; the first to reach the target stops the rest at that
    time, after their evaluation there. ``say``: told where the race stands now and
    then. -> lr -> the WorkerError that failed it."""
    for engine in racers.values():
        engine.begin()
    live, errors, t = dict(racers), {}, 0.0
    noted = time.monotonic()
    while live:
        if say is not None and time.monotonic() - noted >= RACE_NOTE_SECONDS:
            noted = time.monotonic()
            say(f"{t:.3g} virtual s: " + ", ".join(
                f"lr {lr:g} {score(e)}" for lr, e in live.items()))
        t += step
        reached = []
        for lr, engine in list(live.items()):
            try:
                stopped = engine.advance(t)
            except WorkerError as exc:  # it diverged: out of the race
                errors[lr], stopped = exc, "error"
            if stopped:
                del live[lr]
                if stopped == "target":
                    reached.append(engine.sched.now)
        # only once every engine has played up to t, its evaluation there included: one
        # stopped earlier in this loop would miss an evaluation it had not yet scheduled
        for other in live.values() if reached else ():
            other.stop_at(min(reached))
    return errors


def score(engine) -> str:
    """The latest evaluation of a racing engine, as its metric prints it."""
    last, metric = engine.rec.last_eval, engine.rec.metric
    return "not evaluated" if last is None else f"{metric.format(last[metric.name])}"
