"""What ray-job's driver lets Ray print: plain text where its output is not a terminal (a log
file), and not Ray's notice that token authentication is on, which comes with every run."""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping, Optional

# Ray prints each actor's lines on the driver behind a prefix it colours unless this is "0"
COLOR = "RAY_COLOR_PREFIX"
# Where Ray (2.52 on) logs "Token authentication is enabled for this Ray cluster. Set
# RAY_AUTH_MODE=disabled to opt out", a notice of its default for a Ray that ray.init starts
AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


def driver_environment(environ: Mapping[str, str], terminal: bool) -> dict:
    """The variables to set before ray.init, given the environment and whether stdout and
    stderr are both terminals; a variable the user set is left alone."""
    if COLOR not in environ and (not terminal or environ.get("NO_COLOR")):
        return {COLOR: "0"}
    return {}


def on_a_terminal() -> bool:
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


class TokenNotice(logging.Filter):
    """Drops the notice that token authentication is on: it changes nothing (the
    authentication stays as Ray chose it) and repeats on every run. Ray's warning that
    authentication is off, the one that matters, still passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(AUTH_NOTICE)


class DriverOutput:
    """Sets driver_environment's variables in os.environ and filters the notice; restore()
    puts back what was there."""

    def __init__(self, environ: Optional[dict] = None):
        self._environ = os.environ if environ is None else environ
        self._set = driver_environment(self._environ, on_a_terminal())
        self._environ.update(self._set)
        self._filter = TokenNotice()
        logging.getLogger(AUTH_LOGGER).addFilter(self._filter)

    def restore(self) -> None:
        for name, value in self._set.items():
            if self._environ.get(name) == value:
                self._environ.pop(name)
        self._set = {}
        logging.getLogger(AUTH_LOGGER).removeFilter(self._filter)
