"""Compare's mode names: what ``ps-ssp:2``, ``diloco:8`` or ``ddp+fp16`` runs.

Each name in ``--modes`` expands to a ``ModeSpec``: the command that runs it and the
flags it adds to that command and to a parameter server's workers.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from typing import Optional, Union

from .values import parse_compress
from ..errors import ConfigError

SSP_DEFAULT = 2


@dataclass(frozen=True)
class ModeSpec:
    """A mode as --modes names it, and the command that runs it."""

    name: str
    command: str  # single | hogwild | ddp | ps-server
    consistency: Optional[str] = None
    # ps-backup:B: sync rounds that do not wait for B workers; ps-backup:auto: "auto"
    backup_workers: Union[int, str] = 0
    optimizer: str = "sgd"  # the shards' rule: nesterov / delayed-nesterov for Local SGD
    flags: tuple = ()  # of its command (ps-server's, or single/hogwild/ddp's)
    worker_flags: tuple = ()  # of each parameter-server worker

    @property
    def slug(self) -> str:
        return self.name.replace(":", "-")


# DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov, lr 0.7, momentum 0.9
OUTER = ("--lr", "0.7", "--momentum", "0.9")
# ps-dc-asgd: Zheng et al. 2017's lambda_0, also MXNet's DCASGD default
DC_ASGD = ("--dc-asgd", "0.04")
LOCAL_STEPS_DEFAULT = 8
# What a parameter-server mode's +SUFFIX adds to its workers (topk:RATIO too)
WIRE_FLAGS = {"bf16": ("--push-dtype", "bf16", "--pull-dtype", "bf16"),
              "fp16": ("--push-dtype", "fp16", "--pull-dtype", "fp16"),
              "int8": ("--compress", "int8")}

# A mode's +dynamic: data handed out on demand (--data-dispatch dynamic)
DYNAMIC = "+dynamic"
DYNAMIC_FLAGS = ("--data-dispatch", "dynamic")


def parse_modes(text: str) -> list:
    """``single,hogwild,ps-async,ps-ssp,ps-ssp:4,ps-sync,ps-backup:1,ps-backup:auto,ddp,...``
    -> [ModeSpec]."""
    specs, seen = [], set()
    for name in (m.strip() for m in text.split(",")):
        if not name:
            continue
        spec = _mode(name)
        if spec is None:
            raise ConfigError(f"--modes: unknown mode {name!r}; choose from single, hogwild, "
                              "ps-async, ps-dc-asgd, ps-ssp (or ps-ssp:K), ps-sync, ps-backup (or "
                              "ps-backup:B, ps-backup:auto), ddp, diloco (or diloco:H, "
                              "diloco:auto[:H]), async-diloco (or "
                              "async-diloco:H, async-diloco:auto[:H]), ddp+balance, ddp+fp16, "
                              "ddp+bf16, ddp+powersgd (or "
                              "ddp+powersgd:RANK), ddp-local (or ddp-local:H); a "
                              "parameter-server mode +bf16, +fp16, +int8 or +topk:RATIO "
                              "(ps-async+int8); ps-sync+balance or ps-backup:B+balance; "
                              "+dynamic (ps-async+dynamic, hogwild+dynamic)")
        if name in seen:
            raise ConfigError(f"--modes: {name} is listed twice; use --repeats to run it again")
        seen.add(name)
        specs.append(spec)
    if not specs:
        raise ConfigError("--modes is empty; name at least one mode, e.g. --modes hogwild")
    return specs


def _mode(name: str) -> Optional[ModeSpec]:
    """The mode ``name`` means, or None."""
    def number(pattern: str, default: int) -> Optional[int]:
        found = re.fullmatch(pattern + r"(?::(\d+))?", name)
        return None if found is None else int(found.group(1) or default)

    if name.endswith("+balance") and not name.startswith("ddp"):
        return _balanced(name)
    if name.endswith(DYNAMIC):
        return _dynamic(name)
    if "+" in name and not name.startswith("ddp"):  # a PS mode, compressed: ps-async+int8
        base, _, wire = name.partition("+")
        spec, flags = _mode(base), WIRE_FLAGS.get(wire)
        if flags is None and wire.startswith("topk:"):
            try:
                flags = ("--compress", wire) if parse_compress(wire) else None
            except ConfigError:
                flags = None
        if spec is None or spec.command != "ps-server" or flags is None:
            return None
        return dataclasses.replace(spec, name=name, worker_flags=spec.worker_flags + flags)
    if name in ("single", "hogwild", "ddp"):
        return ModeSpec(name, name)
    if name in ("ps-async", "ps-sync"):
        return ModeSpec(name, "ps-server", name[3:])
    if name == "ps-dc-asgd":
        return ModeSpec(name, "ps-server", "async", flags=DC_ASGD)
    if number("ps-ssp", SSP_DEFAULT) is not None:
        return ModeSpec(name, "ps-server", f"ssp:{number('ps-ssp', SSP_DEFAULT)}")
    if name == "ps-backup:auto":  # rounds close at an adaptive deadline
        return ModeSpec(name, "ps-server", "sync", "auto")
    if number("ps-backup", 1):
        return ModeSpec(name, "ps-server", "sync", number("ps-backup", 1))
    if name == "ddp+balance":  # batches sized to the ranks' speeds
        return ModeSpec(name, "ddp", flags=("--balance", "batch"))
    if name in ("ddp+fp16", "ddp+bf16") or number("ddp\\+powersgd", 1):
        return ModeSpec(name, "ddp", flags=("--comm-hook", name[4:]))
    if number("ddp-local", LOCAL_STEPS_DEFAULT):
        return ModeSpec(name, "ddp", flags=(
            "--local-steps", str(number("ddp-local", LOCAL_STEPS_DEFAULT))))
    dylu = _dylu(name)
    if dylu is not None:
        return dylu
    for prefix, consistency, rule in (("diloco", "sync", "nesterov"),
                                      ("async-diloco", "async", "delayed-nesterov")):
        steps = number(prefix, LOCAL_STEPS_DEFAULT)
        if steps:
            return ModeSpec(name, "ps-server", consistency, optimizer=rule, flags=OUTER,
                            worker_flags=("--local-steps", str(steps)))
    return None


def _balanced(name: str) -> Optional[ModeSpec]:
    """ps-sync+balance, ps-backup:B+balance: sync rounds whose batches shard 0 sizes to
    each worker's speed (--balance batch); None for any other mode."""
    spec = _mode(name[:-len("+balance")])
    if spec is None or spec.command != "ps-server" or spec.consistency != "sync" \
            or spec.worker_flags:
        return None
    return dataclasses.replace(spec, name=name, flags=spec.flags + ("--balance", "batch"))


def _dylu(name: str) -> Optional[ModeSpec]:
    """``diloco:auto[:H]``, ``async-diloco:auto[:H]``: DiLoCo whose workers' local steps
    shard 0 sizes to their speeds, the fastest running H (DyLU); None for another name."""
    found = re.fullmatch(r"((?:async-)?diloco):auto(?::(\d+))?", name)
    base = found and _mode(f"{found.group(1)}:{found.group(2) or LOCAL_STEPS_DEFAULT}")
    if not base:
        return None
    return dataclasses.replace(base, name=name, worker_flags=(
        "--local-steps", f"auto:{base.worker_flags[1]}"))


def _dynamic(name: str) -> Optional[ModeSpec]:
    """``ps-async+dynamic``, ``hogwild+dynamic``: the parameter server or Hogwild's shared
    counter hands the rows out on demand (--data-dispatch dynamic)."""
    spec = _mode(name[:-len(DYNAMIC)])
    if spec is None or spec.command not in ("ps-server", "hogwild"):
        return None
    return dataclasses.replace(spec, name=name, flags=spec.flags + DYNAMIC_FLAGS)


def parse_mode_args(items: tuple, specs: list) -> dict:
    """``('hogwild=--lock', 'worker=--push-every 4')`` -> {name: [flags]}."""
    known = {s.name for s in specs} | {"worker"}
    extra: dict = {}
    for item in items:
        name, sep, flags = item.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise ConfigError(f"--mode-args {item!r}: use MODE=FLAGS with MODE one of "
                              f"{', '.join(sorted(known))}, e.g. 'hogwild=--lock'")
        try:
            extra.setdefault(name, []).extend(shlex.split(flags))
        except ValueError as exc:
            raise ConfigError(f"--mode-args {item!r}: {exc}") from exc
    return extra

