"""From settings dataclasses to click options and back: what the CLI and the Python API
share, so that a value given either way is checked the same."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import click

from ..errors import ConfigError

# settings renamed since run directories were first written: old name -> new
RENAMED = {"target_accuracy": "target"}

# the attribute by which a command function made with ``click_options`` names its settings
SETTINGS = "asyncsgd_settings"


def config_from_dict(cls, data: dict):
    """Build ``cls`` from a dict, naming unknown keys instead of failing obscurely."""
    data = {RENAMED.get(k, k): v for k, v in data.items()}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"known: {', '.join(sorted(names))}")
    return cls(**data)


def make_config(cls, config: Any = None, given: Optional[dict] = None):
    """``cls`` from ``config`` (an instance of exactly ``cls``; None: the defaults) with the
    settings ``given`` over it, every value checked as its CLI option checks it: what the
    Python API takes (``asyncsgd.hogwild(procs=0)`` fails as ``--procs 0`` does)."""
    if config is not None and type(config) is not cls:
        raise ConfigError(f"expected a {cls.__name__}, got a {type(config).__name__}; pass a "
                          f"{cls.__name__} or its settings as keyword arguments")
    given = dict(given or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - set(fields))
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"known: {', '.join(sorted(fields))}")
    cfg = dataclasses.replace(config, **given) if config is not None else cls(**given)
    checked = {name: _checked(f, getattr(cfg, name)) for name, f in fields.items()}
    return dataclasses.replace(cfg, **checked)


def _checked(f: dataclasses.Field, value: Any) -> Any:
    """``value`` of field ``f`` converted and checked by its option's click type."""
    if value is None or f.type in (bool, "bool"):
        return value
    kind = _click_type(f)
    if f.metadata.get("multiple"):
        values = (value,) if isinstance(value, str) else tuple(value)
        return values if kind is None else tuple(_converted(f, kind, v) for v in values)
    return _converted(f, kind, value)


def _converted(f: dataclasses.Field, kind: Any, value: Any) -> Any:
    """One value of field ``f`` through its option's click type ``kind`` (None: as given)."""
    if kind is None:
        return os.fspath(value) if isinstance(value, os.PathLike) else value
    try:
        return click.types.convert_type(kind).convert(value, None, None)
    except click.BadParameter as exc:
        raise ConfigError(f"{f.name}={value!r}: {exc.message}") from None


def _click_type(f: dataclasses.Field) -> Any:
    """The click type of field ``f``'s option; None where click takes the text as it is."""
    if f.metadata.get("type") is not None:
        return f.metadata["type"]
    return {int: int, "int": int, float: float, "float": float}.get(f.type)


def identity_fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("identity")]


def click_options(cls):
    """Decorator adding one click option per field of the dataclass ``cls``."""

    def decorate(func):
        for f in reversed(dataclasses.fields(cls)):
            meta = f.metadata
            flag = "--" + f.name.replace("_", "-")
            kwargs = dict(help=meta.get("help", ""), show_default=True,
                          default=f.default)
            if f.type in (bool, "bool"):
                if f.default:  # a flag that is on by default needs a way to turn it off
                    flag = f"{flag}/--no-{flag[2:]}"
                kwargs["is_flag"] = True
            elif _click_type(f) is not None:
                kwargs["type"] = _click_type(f)
            if meta.get("show"):
                kwargs["show_default"] = meta["show"]
            elif f.default is None:
                kwargs["show_default"] = "none"
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            if meta.get("multiple"):
                kwargs["multiple"] = True
            func = click.option(flag, *meta.get("aliases", ()), f.name, **kwargs)(func)
        setattr(func, SETTINGS, cls)
        return func

    return decorate
