"""Knobs: each setting declared once, and the settings dataclasses composed of them.

A knob carries its default, its help and its click type, and, in ``per_command``, what
differs for a command that reads it otherwise. ``settings`` turns knobs into one
command's dataclass, so a setting shared by several commands is written in one place.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .values import ValueType

_VARIANT_KEYS = {"help", "default", "show", "annotation"}


@dataclass(frozen=True, eq=False)
class Knob:
    """One setting: what ``knob`` was given (its arguments say what each part means)."""

    name: str
    annotation: Any
    default: Any
    help: str
    type: Any = None
    show: Optional[str] = None
    metavar: Optional[str] = None
    identity: bool = False
    multiple: bool = False
    aliases: tuple = ()
    per_command: dict = field(default_factory=dict)

    def as_field(self, modes: tuple) -> tuple:
        """``(name, annotation, dataclass field)`` as the first of ``modes`` with a variant
        reads it (a command, then the commands its settings come from)."""
        variant = next((self.per_command[m] for m in modes if m in self.per_command), {})
        if isinstance(variant, str):
            variant = {"help": variant}
        meta = {"help": variant.get("help", self.help), "type": self.type,
                "show": variant.get("show", self.show), "metavar": self.metavar,
                "identity": self.identity, "multiple": self.multiple, "aliases": self.aliases}
        return (self.name, variant.get("annotation", self.annotation),
                dataclasses.field(default=variant.get("default", self.default), metadata=meta))


def knob(name: str, annotation: Any, default: Any, help: str, *, type: Any = None,
         show: Optional[str] = None, metavar: Optional[str] = None, identity: bool = False,
         multiple: bool = False, aliases: tuple = (), per_command: Optional[dict] = None) -> Knob:
    """A setting documented for the CLI.

    ``show`` is what --help prints as the default when the value itself would say nothing
    (e.g. ``None`` meaning "the task's default"). ``identity`` marks settings that define
    *what* is trained (task, data): a resumed run must keep them. ``multiple`` makes an
    option that may be given several times; its value is a tuple. ``aliases``: older flags
    that still work. ``per_command``: command (a settings class's ``mode``) -> its help
    text, or a dict of what differs there (help, default, show, annotation).
    """
    per_command = dict(per_command or {})
    for mode, variant in per_command.items():
        if not isinstance(variant, str) and not set(variant) <= _VARIANT_KEYS:
            raise TypeError(f"knob {name}: {mode}'s variant may set only {_VARIANT_KEYS}")
    return Knob(name, annotation, default, help, type, show, metavar, identity, multiple,
                tuple(aliases), per_command)


def settings(name: str, mode: str, doc: str, *parts: Any, extends: Optional[type] = None,
             left_out: frozenset = frozenset(), finish: Optional[Callable] = None,
             module: str) -> type:
    """A settings dataclass of the knobs in ``parts``, in order, as command ``mode`` reads
    them. A part is a knob, a tuple of knobs, or another settings class (its knobs, as that
    command reads those without a variant for ``mode``). ``extends``: the settings class it
    subclasses, whose knobs come first. A name taken already or in ``left_out`` is skipped,
    so a class made of two others takes a shared setting from the first. ``finish(cfg)``:
    settings decided from others once all are parsed (a class that extends this one keeps
    it). ``module`` is where it is defined, as pickle looks it up."""
    entries = []
    for part in ((extends,) if extends else ()) + parts:
        if isinstance(part, Knob):
            entries.append((part, (mode,)))
        elif isinstance(part, type):
            entries += [(k, (mode,) + modes) for k, modes in part.knobs]
        else:
            entries += [(k, (mode,)) for k in part]
    knobs, taken = [], set(left_out)
    for k, modes in entries:
        if k.name not in taken:
            taken.add(k.name)
            knobs.append((k, modes))
    made = dataclasses.make_dataclass(
        name, [k.as_field(modes) for k, modes in knobs], bases=(extends,) if extends else (),
        namespace={"mode": mode, "__doc__": doc, "knobs": tuple(knobs),
                   "to_dict": _to_dict, "__post_init__": _parse_values,
                   **({"finish": finish} if finish else {})})
    made.__module__ = module
    return made


def _to_dict(self) -> dict:
    """The settings as config.json holds them (an option given several times: a list)."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(self).items()}


def _parse_values(self) -> None:
    """Settings of a structured value given as text (the Python API, config.json) become
    that value, checked as the option checks it; an option given several times, a tuple."""
    for f in dataclasses.fields(self):
        kind, value = f.metadata.get("type"), getattr(self, f.name)
        if f.metadata.get("multiple") and isinstance(value, (list, str)):  # config.json's
            setattr(self, f.name, (value,) if isinstance(value, str) else tuple(value))
        if isinstance(kind, ValueType) and value is not None and not isinstance(value, kind.value):
            setattr(self, f.name, kind.value(str(value)))
    finish = getattr(type(self), "finish", None)
    if finish is not None:
        finish(self)
