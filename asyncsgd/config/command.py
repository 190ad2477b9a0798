"""A command whose options are a settings dataclass: --config, --print-config, --help in groups.

Click has no option groups or config files: the file's settings become the command's
default_map (so options given beside it win), and the help lists options by ``groups``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import click

from ..errors import ConfigError
from . import files
from .groups import OTHER, TITLES, group_of
from .options import SETTINGS, make_config

_PRINT = "asyncsgd.print_config"
_COL_MAX = 30  # click's write_dl default


def given_settings(ctx: click.Context) -> dict:
    """The settings given on the command line or in --config, not left at their default:
    what the command passes to the Python API (with --resume, they override the run's
    saved settings)."""
    return {name: value for name, value in ctx.params.items()
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}


class SettingsCommand(click.Command):
    """A click command; one made with ``click_options(cls)`` also takes --config and
    --print-config, and lists its options in --help by group."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings_class: Optional[type] = getattr(self.callback, SETTINGS, None)
        if self.settings_class is not None:
            self.params += [
                click.Option(["--config"], metavar="FILE", is_eager=True, expose_value=False,
                             callback=_read_config,
                             help="Settings from a YAML (.yaml, .yml), TOML or JSON file: "
                                  "option names as keys (lr: 0.1, batch-size: 64), flat or "
                                  "under their group (training: {lr: 0.1}); a run "
                                  "directory's config.yaml or config.json works too. "
                                  "Options given beside it win.", show_default="none"),
                click.Option(["--print-config"], is_flag=True, expose_value=False,
                             callback=_print_config,
                             help="Print the effective settings (defaults, --config, "
                                  "options) as a YAML file for --config, and exit without "
                                  "running.")]

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        if self.settings_class is None:
            return super().format_options(ctx, formatter)
        sections: dict = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and not isinstance(param, click.Argument):
                sections.setdefault(group_of(param.name) or OTHER, []).append(record)
        # one column width across the sections, as click's single Options section has
        width = min(max(len(term) for rows in sections.values() for term, _ in rows), _COL_MAX)
        for title in TITLES:
            if title in sections:
                with formatter.section(title):
                    formatter.write_dl([(term.ljust(width), text)
                                        for term, text in sections[title]], col_max=_COL_MAX)

    def invoke(self, ctx: click.Context) -> Any:
        if ctx.meta.get(_PRINT):
            click.echo(files.dump(self.effective(ctx), ctx.info_name), nl=False)
            return None
        return super().invoke(ctx)

    def effective(self, ctx: click.Context) -> Any:
        """The settings the command would run with."""
        names = {f.name for f in dataclasses.fields(self.settings_class)}
        given = {k: v for k, v in given_settings(ctx).items() if k in names}
        return make_config(self.settings_class, None, given)


def _print_config(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.meta[_PRINT] = True


def _read_config(ctx: click.Context, param: click.Parameter, path: Optional[str]) -> None:
    """The file's settings as the command's defaults, each checked by its option's type."""
    if path is None:
        return
    cls = ctx.command.settings_class
    options = {p.name: p for p in ctx.command.params
               if p.name in {f.name for f in dataclasses.fields(cls)}}
    defaults = {}
    for name, value in files.load(path, options, ctx.info_name).items():
        if value is None:  # null: the option's default
            continue
        option = options[name]
        if option.multiple and not isinstance(value, list):
            value = [value]
        items = value if option.multiple else [value]
        if any(isinstance(v, (list, dict)) for v in items):
            raise ConfigError(f"--config {path}: {name} takes "
                              f"{'a list of values' if option.multiple else 'one value'}, "
                              f"not {value!r}")
        try:
            option.type_cast_value(ctx, value)
        except (click.BadParameter, ConfigError) as exc:
            why = exc.message if isinstance(exc, click.BadParameter) else str(exc)
            if isinstance(value, bool) and not option.is_flag:
                why += " (YAML reads a bare on/off/yes/no as true/false: quote it, 'off')"
            raise ConfigError(f"--config {path}: {name}: {why} (fix it in the file, or give "
                              f"{option.opts[0]} VALUE)") from None
        defaults[name] = value
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
