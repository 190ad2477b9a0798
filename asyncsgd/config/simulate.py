"""Settings of ``asyncsgd simulate``: compare's modes on a virtual clock, with the cost
model that stands for the cluster simulated.

The structured values whose parts are plain numbers (--slow-workers, --leave, --join) are
parsed here; times, sizes and rates (--step-time, --gradient-bytes, --link, --latency) by
the simulator's cost model, as the command starts.
"""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError
from .compare import BUDGET, LINK, MODES, REPEATS, STOP_AT_TARGET, TUNE, TUNE_BUDGET
from .knobs import knob, settings
from .ps import WORKERS
from .shared import (ACCUMULATE, BATCH_SIZE, CLIP_GRAD_NORM, DATA, EPOCHS, EVAL_EVERY, LR,
                     LR_SCHEDULE, OUT, PACING, PROGRESS, RECORD_DIGESTS, SEED, TARGET, TASK,
                     WARMUP)
from .values import CheckedText


def _number(text: str, flag: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a {'whole ' if kind is int else ''}"
                          "number") from None


def parse_slow_workers(text: Optional[str]) -> tuple:
    """``0.25:4`` -> (0.25, 4.0): a quarter of the workers, drawn by the seed, 4x slower."""
    if not text:
        return 0.0, 1.0
    share, sep, factor = text.partition(":")
    if not sep:
        raise ConfigError(f"--slow-workers {text!r}: use SHARE:FACTOR, e.g. 0.25:4")
    share_, factor_ = _number(share, "--slow-workers"), _number(factor, "--slow-workers")
    if not 0 < share_ <= 1 or factor_ < 1:
        raise ConfigError(f"--slow-workers {text!r}: SHARE is a fraction in (0, 1] and "
                          "FACTOR at least 1, e.g. 0.25:4")
    return share_, factor_


def parse_worker_speeds(text: Optional[str]) -> float:
    """``lognormal:0.5`` -> 0.5: each worker's step-time factor drawn once from a lognormal of
    median 1 and that sigma; none -> 0.0 (every worker at --step-time)."""
    if not text:
        return 0.0
    kind, sep, sigma = text.partition(":")
    if kind != "lognormal" or not sep:
        raise ConfigError(f"--worker-speeds {text!r}: use lognormal:SIGMA, e.g. lognormal:0.5")
    value = _number(sigma, "--worker-speeds")
    if not value > 0:
        raise ConfigError(f"--worker-speeds {text!r}: SIGMA is above 0, e.g. lognormal:0.5")
    return value


def parse_leave(text: Optional[str]) -> tuple:
    """``30:3,60:5`` -> ((30.0, 3), (60.0, 5)): worker 3 leaves at virtual second 30."""
    events = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        at, sep, rank = item.partition(":")
        if not sep:
            raise ConfigError(f"--leave {item!r}: use T:RANK, e.g. 30:3 (worker 3 leaves at "
                              "virtual second 30)")
        events.append((_time(at, "--leave"), _number(rank, "--leave", int)))
    if any(rank < 0 for _, rank in events):
        raise ConfigError(f"--leave {text!r}: ranks count from 0")
    if len({rank for _, rank in events}) < len(events):
        raise ConfigError(f"--leave {text!r}: a worker leaves once")
    return tuple(sorted(events))


def parse_join(text: Optional[str]) -> tuple:
    """``45,90`` -> ((45.0,), (90.0,)): a new worker joins at each of those virtual seconds."""
    return tuple(sorted((_time(item.strip(), "--join"),)
                        for item in (text or "").split(",") if item.strip()))


def _time(text: str, flag: str) -> float:
    value = _number(text, flag)
    if not value >= 0:
        raise ConfigError(f"{flag}: time {text!r} is before the start (virtual seconds >= 0)")
    return value


def check_ranks(leave: tuple, workers: int) -> None:
    """Every worker --leave names exists among ``workers`` (``--workers``)."""
    beyond = sorted(rank for _, rank in leave if rank >= workers)
    if beyond:
        raise ConfigError(f"--leave names worker(s) {', '.join(map(str, beyond))}, but "
                          f"--workers {workers} has workers 0..{workers - 1}")


STEP_TIME = knob(
    "step_time", Optional[str], None,
    "Virtual time of one worker's step (forward and backward of a batch): a duration "
    "(120ms, 2ms, 500us, 1.5s), or lognormal:MEDIAN:SIGMA for a draw per step with that "
    "median and log-spread, e.g. lognormal:2ms:0.5.", metavar="TIME|lognormal:TIME:SIGMA",
    show="the task's, measured here: the median of a few dozen steps on one thread")
GRADIENT_BYTES = knob(
    "gradient_bytes", Optional[str], None,
    "Bytes of one gradient (and of the parameters): what a push, a pull and an all-reduce "
    "carry, e.g. 100MB, 20KB, 1.5GiB. Give it to stand for a larger model than the task's: "
    "the learning stays the task's, the times are those of this size.", metavar="SIZE",
    show="4 bytes per parameter of the task's model")
LATENCY = knob(
    "latency", Optional[str], None,
    "Latency of each simulated link, one way: 20us, 0.5ms. A ring all-reduce pays it 2(N-1) "
    "times.", metavar="TIME", show="the loopback's, measured (experiments/README.md)")
SLOW_WORKERS = knob(
    "slow_workers", Optional[str], None,
    "A share of the workers, drawn by --seed, whose every step takes FACTOR times as long: "
    "SHARE:FACTOR, e.g. 0.25:4 (a quarter of them 4x slower). --slowdown names the slow "
    "ranks instead.", type=CheckedText("SHARE:FACTOR", parse_slow_workers),
    metavar="SHARE:FACTOR", show="none")
WORKER_SPEEDS = knob(
    "worker_speeds", Optional[str], None,
    "A population of unequal workers: lognormal:SIGMA draws each worker's factor once, by "
    "--seed, from a lognormal of median 1 (exp of a normal of mean 0 and that sigma); its "
    "every step takes that factor times --step-time. E.g. lognormal:0.5 (about a third of "
    "the workers 1.6x slower or more, as many 1.6x faster).",
    type=CheckedText("lognormal:SIGMA", parse_worker_speeds), metavar="lognormal:SIGMA",
    show="none")
LEAVE = knob(
    "leave", Optional[str], None,
    "Workers that leave for good at a virtual time: T:RANK[,...], e.g. 30:3 (worker 3 leaves "
    "at virtual second 30; its step in flight is lost). Sync modes then wait for the workers "
    "left.", type=CheckedText("T:RANK", parse_leave), metavar="T:RANK[,...]", show="none")
JOIN = knob(
    "join", Optional[str], None,
    "New workers joining at virtual times: T[,...], e.g. 45,90 (one joins at 45 s and one at "
    "90 s, ranks --workers, --workers + 1, ...).", type=CheckedText("T", parse_join),
    metavar="T[,...]", show="none")

SimulateConfig = settings(
    "SimulateConfig", "simulate", "Settings of ``asyncsgd simulate``: compare's modes in "
    "one process on a virtual clock, learning for real.", TASK, *DATA, MODES, WORKERS,
    STEP_TIME, GRADIENT_BYTES, LINK, LATENCY, SLOW_WORKERS, WORKER_SPEEDS, PACING, LEAVE, JOIN,
    BUDGET, TARGET, STOP_AT_TARGET, TUNE, TUNE_BUDGET, REPEATS, SEED, BATCH_SIZE, LR, EPOCHS,
    EVAL_EVERY, OUT, PROGRESS, RECORD_DIGESTS, LR_SCHEDULE, WARMUP, CLIP_GRAD_NORM, ACCUMULATE,
    module=__name__)
