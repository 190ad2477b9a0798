"""Config files: a command's settings read from YAML, TOML or JSON, and written as YAML.

Keys are the settings' names (``batch_size`` or ``batch-size``), flat or nested under their
--help group's slug (``training: {lr: 0.1}``); a run directory's config.json reads as its
settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from .groups import TITLES, group_of, slug
from .options import RENAMED

FORMATS = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}
WRITTEN = "config.yaml"  # the effective settings in every run directory
# where a run is, not how it trains: a run started again from its file makes its own directory
NOT_WRITTEN = ("out", "resume")


def load(path: str, names: Iterable[str], command: str) -> dict:
    """The settings in file ``path`` as ``{name: value}``, each one of ``names`` (the
    settings of ``asyncsgd command``), in the file's order."""
    data = _read(path)
    if {"mode", "config"} <= set(data) and isinstance(data["config"], dict):
        data = {k: v for k, v in data["config"].items() if k not in NOT_WRITTEN}  # config.json
    names, slugs = set(names), {slug(t) for t in TITLES}
    found, unknown = {}, []
    for key, value in data.items():
        key = _name(key)
        items = value.items() if key in slugs and isinstance(value, dict) else [(key, value)]
        for name, item in items:
            name = RENAMED.get(_name(name), _name(name))
            if name not in names:
                unknown.append(str(name))
            elif name in found:
                raise ConfigError(f"--config {path}: {name} is given twice (flat and in a "
                                  "group, or in two groups); keep one")
            else:
                found[name] = item
    if unknown:
        raise ConfigError(f"--config {path}: unknown setting(s) {', '.join(unknown)} for "
                          f"asyncsgd {command}; keys are the option names of 'asyncsgd "
                          f"{command} --help' (batch_size or batch-size), flat or under their "
                          "group's title (training: {lr: 0.1})")
    return found


def dump(cfg: Any, command: str, leave_out: Iterable[str] = ()) -> str:
    """Settings ``cfg`` as YAML that ``asyncsgd command --config`` reads back, under their
    --help groups."""
    import yaml
    flat, grouped = {}, {slug(t): {} for t in TITLES}
    for f in dataclasses.fields(cfg):
        if f.name not in leave_out:
            title = group_of(f.name)
            (grouped[slug(title)] if title else flat)[f.name] = _plain(getattr(cfg, f.name))
    tree = {**flat, **{k: v for k, v in grouped.items() if v}}
    return (f"# asyncsgd {command}: read back with 'asyncsgd {command} --config FILE' "
            "(options given beside it win)\n"
            + yaml.safe_dump(tree, sort_keys=False, default_flow_style=False))


def _name(key: Any) -> Any:
    return key.replace("-", "_") if isinstance(key, str) else key


def _plain(value: Any) -> Any:
    """A setting as YAML writes it: parsed values as their text, tuples as lists."""
    if isinstance(value, str):
        return str(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _read(path: str) -> dict:
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise ConfigError(f"--config {path}: name it .yaml, .yml, .toml or .json so that its "
                          "format is known")
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file; give the path of a settings "
                          "file (asyncsgd CMD --print-config writes one)") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc}); check "
                          "the path and its permissions") from None
    try:
        data = _parse(kind, raw)
    except ConfigError:
        raise
    except Exception as exc:  # each parser's own error: its message says where
        mark = getattr(exc, "problem_mark", None)  # YAML's: its message spans lines
        where = (f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}" if mark
                 else " ".join(str(exc).split()))
        raise ConfigError(f"--config {path}: not valid {kind} ({where}); fix the "
                          "file") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: holds a {type(data).__name__}, not settings; "
                          "write 'name: value' lines (e.g. lr: 0.1)")
    return data


def _parse(kind: str, raw: bytes) -> Any:
    if kind == "JSON":
        return json.loads(raw)
    if kind == "YAML":
        import yaml
        return yaml.safe_load(raw)
    try:
        import tomllib
    except ImportError:  # Python before 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError("a TOML config file needs Python 3.11 or the tomli package "
                              "(pip install tomli); or write it as YAML") from None
    return tomllib.loads(raw.decode())
