"""The settings a run gets from the Python API (and so the CLI): a settings dataclass with
keyword settings over it, checked; with ``resume``, the saved run's settings under those
given.

Apart from ``asyncsgd.api`` so that a worker's start need not import every mode
(experiments/README.md, "Start-up and exit").
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..config import (RENAMED, DDPConfig, HogwildConfig, ServerConfig, SingleConfig,
                      config_from_dict, make_config)
from ..config.files import NOT_WRITTEN, WRITTEN, dump
from ..core.files import atomic_write
from ..errors import ConfigError
from .rundir import RunDir

log = logging.getLogger(__name__)

# The settings of each mode a run directory names, and the command and function resuming it.
MODES = {"hogwild": (HogwildConfig, "hogwild", "asyncsgd.hogwild"),
         "single": (SingleConfig, "single", "asyncsgd.single"),
         "ddp": (DDPConfig, "ddp", "asyncsgd.ddp"),
         "ps": (ServerConfig, "ps-server", "asyncsgd.ps.serve")}


def configure(cls, config: Any, settings: dict, saved_as: Any = None,
              anew: frozenset = frozenset()):
    """``config`` (a ``cls`` or None) with ``settings`` over it, checked; with ``resume``,
    the saved run's settings under the given ones: the keywords, and the dataclass's fields
    that differ from their defaults (as flags given beside --resume override).
    ``saved_as``: the settings class of the resumed run where it is not ``cls`` (a Ray job
    resumes a ps-server run): only the saved settings ``cls`` has are taken. ``anew``:
    settings decided anew, never taken from the saved run."""
    cfg = make_config(cls, config, settings)
    if not getattr(cfg, "resume", None):
        return cfg
    given = set(settings) | ({f.name for f in dataclasses.fields(cls)
                              if getattr(config, f.name) != f.default} if config else set())
    if "out" in given:
        raise ConfigError("out (--out) cannot be combined with resume (--resume): a resumed "
                          "run continues in its own directory")
    known = {f.name for f in dataclasses.fields(cls)} - set(anew)
    saved = saved_settings(RunDir.open(cfg.resume), saved_as or cls)
    return make_config(cls, config_from_dict(cls, {
        **{k: v for k, v in saved.items() if k in known},
        **{k: getattr(cfg, k) for k in given}, "resume": cfg.resume, "out": None}))


def saved_settings(run: RunDir, cls) -> dict:
    """The settings ``run`` saved, for ``cls``. A run of another mode is refused first,
    before anything is said about its settings (a Hogwild run's --procs is no single
    setting, and warning about it before refusing would only mislead)."""
    record = run.read_config()
    mode = record.get("mode")
    if mode != cls.mode:
        hint = (f"; resume it with 'asyncsgd {MODES[mode][1]} --resume {run.path}' or "
                f"{MODES[mode][2]}(resume=...)" if mode in MODES else "")
        raise ConfigError(f"{run.path} is a {mode} run, not a {cls.mode} run{hint}")
    saved = {RENAMED.get(k, k): v for k, v in record.get("config", {}).items()}
    known = {f.name for f in dataclasses.fields(cls)}
    retired = sorted(set(saved) - known)
    if retired:  # settings this mode no longer has (single's --start-method, never used)
        log.warning("ignoring saved setting(s) %s: %s no longer has them", ", ".join(retired),
                    MODES[mode][1])
    return {k: v for k, v in saved.items() if k in known}


def write_settings_file(run: RunDir, cfg: Any) -> None:
    """The run's config.yaml: its settings as ``asyncsgd COMMAND --config`` reads them back,
    without where the run is (out, resume), so that a run started from it makes its own."""
    entry = MODES.get(cfg.mode)
    if entry is None or type(cfg) is not entry[0]:
        return  # the simulator's runs: no command takes their settings
    text = dump(cfg, entry[1], leave_out=NOT_WRITTEN)
    atomic_write(run.path / WRITTEN, lambda fh: fh.write(text.encode()))
