"""Structured setting values and the click types that check them.

``--consistency`` and ``--compress`` are parsed once, where the command line or the Python
API gives them, and travel as values whose parts the code reads; the other structured
options are checked when given and kept as their text.
"""

from __future__ import annotations

from typing import Any

import click

from ..errors import ConfigError


def parse_consistency(text: str) -> tuple:
    """``async`` → ("async", 0); ``ssp:K`` → ("ssp", K); ``sync`` → ("sync", 0)."""
    if text in ("async", "sync"):
        return text, 0
    if text.startswith("ssp:"):
        try:
            bound = int(text[4:])
        except ValueError:
            bound = -1
        if bound >= 0:
            return "ssp", bound
    raise ConfigError(f"--consistency {text!r}: use async, ssp:K (K >= 0 clocks) or sync")


def parse_compress(text: str) -> tuple:
    """``(kind, ratio)`` of a --compress value: ("none", 0), ("int8", 0), ("topk", R)."""
    kind, _, ratio = text.partition(":")
    if kind in ("none", "int8") and not ratio:
        return kind, 0.0
    if kind == "topk":
        try:
            value = float(ratio)
        except ValueError:
            value = float("nan")
        if 0 < value <= 0.5:
            return kind, value
    raise ConfigError(f"--compress {text!r}: use none, int8 or topk:RATIO with 0 < RATIO <= 0.5 "
                      "(e.g. topk:0.01 sends the largest 1%; above half, an index and a value "
                      "per value kept cost more than float32 itself)")


def parse_comm_hook(text: str) -> tuple:
    """``(kind, rank)`` of a --comm-hook value; a ConfigError naming the valid ones."""
    kind, _, rank = text.partition(":")
    if kind in ("allreduce", "fp16", "bf16") and not rank:
        return kind, 0
    if kind == "powersgd" and (not rank or (rank.isdigit() and int(rank) >= 1)):
        return kind, int(rank or 1)
    raise ConfigError(f"--comm-hook {text!r}: use allreduce, fp16, bf16 or powersgd[:RANK] "
                      "with RANK >= 1")


def parse_evict(text: str) -> tuple:
    """``(kind, bound)`` of an --evict value: ("none", 0), ("ttl", SECONDS), ("lfu", ROWS)."""
    kind, _, bound = text.partition(":")
    if kind == "none" and not bound:
        return kind, 0
    try:
        value = float(bound) if kind == "ttl" else int(bound)
    except ValueError:
        value = 0
    if kind in ("ttl", "lfu") and value > 0 and value != float("inf"):
        return kind, value
    raise ConfigError(f"--evict {text!r}: use none, ttl:SECONDS (drop rows untouched for that "
                      "long, e.g. ttl:600) or lfu:ROWS (keep at most ROWS rows per shard, "
                      "e.g. lfu:1000000)")


class _Parsed(str):
    """A setting's text with the parts it parsed to, read-only. It stays a str so that
    config.json, summary.json and the server's handshake carry the text as given."""

    _parts: tuple = ()

    def __new__(cls, text: str):
        value = super().__new__(cls, text)
        value.__dict__.update(zip(cls._parts, cls._parse(str(text))))
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")


class Consistency(_Parsed):
    """--consistency: ``kind`` async, ssp or sync; ``bound``, ssp's K clocks (else 0)."""

    kind: str
    bound: int
    _parts = ("kind", "bound")
    _parse = staticmethod(parse_consistency)


class Compression(_Parsed):
    """--compress: ``kind`` none, int8 or topk; ``ratio``, topk's share kept (else 0)."""

    kind: str
    ratio: float
    _parts = ("kind", "ratio")
    _parse = staticmethod(parse_compress)


class ValueType(click.ParamType):
    """The click type of a parsed value: the option's text becomes the value."""

    def __init__(self, value: type, name: str):
        self.value, self.name = value, name

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None or isinstance(value, self.value):
            return value
        try:
            return self.value(str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


class CheckedText(click.ParamType):
    """A value such as --slowdown's or --comm-hook's: checked when parsed, kept as the text
    given."""

    def __init__(self, name: str, parse: Any):
        self.name, self._parse = name, parse

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return None
        try:
            self._parse(str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


class _AutoOrCount(click.ParamType):
    """``auto`` or a whole number of at least ``minimum``."""

    def __init__(self, name: str, minimum: int):
        self.name, self.minimum = name, minimum

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if value == "auto" or (type(value) is int and value >= self.minimum):
            return value
        text = str(value).strip()
        if text.isascii() and text.isdecimal() and int(text) >= self.minimum:
            return int(text)
        self.fail(f"{value!r} is neither auto nor a whole number of at least {self.minimum}",
                  param, ctx)


SHARD_COUNT = _AutoOrCount("auto|N", 1)  # --shards
BACKUP_WORKERS = _AutoOrCount("N|auto", 0)  # --backup-workers

AUTO_LOCAL_STEPS = 8  # plain ``--local-steps auto``: the fastest worker's H (DiLoCo's usual)


def parse_local_steps(value: Any) -> tuple:
    """``(auto, H)`` of a --local-steps value: ``4`` -> (False, 4); ``auto`` -> (True, 8);
    ``auto:H`` -> (True, H), H the fastest worker's local steps (DyLU)."""
    if type(value) is int and value >= 1:
        return False, value
    text = str(value).strip()
    kind, sep, steps = text.partition(":")
    if text.isascii() and text.isdecimal() and int(text) >= 1:
        return False, int(text)
    if kind == "auto" and not sep:
        return True, AUTO_LOCAL_STEPS
    if kind == "auto" and steps.isascii() and steps.isdecimal() and int(steps) >= 1:
        return True, int(steps)
    raise ConfigError(f"--local-steps {value!r}: use a whole number H >= 1, auto or auto:H "
                      f"(each worker's H sized to its speed, the fastest's H; auto: "
                      f"{AUTO_LOCAL_STEPS})")


class _LocalSteps(click.ParamType):
    """--local-steps: a whole number of at least 1 (an int), or ``auto[:H]`` (its text)."""

    name = "H|auto[:H]"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            auto, steps = parse_local_steps(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        return str(value).strip() if auto else steps


LOCAL_STEPS_VALUE = _LocalSteps()

