"""What ray-job's driver lets Ray print (asyncsgd/jobs/ray_env.py, issue 40 friction 16): no
colour codes in a log file, and not Ray's notice that token authentication is on."""

import importlib.util
import logging
from pathlib import Path

import pytest

from asyncsgd.jobs.ray_env import (AUTH_LOGGER, AUTH_NOTICE, COLOR, DriverOutput, TokenNotice,
                                   driver_environment)

# Ray 2.60's two messages, word for word (authentication_token_setup.py)
ENABLED = ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled "
           "to opt out. For more information, see "
           "https://docs.ray.io/en/latest/ray-security/token-auth.html")
DISABLED = ("Token authentication is disabled for this Ray cluster. Anyone with network access "
            "to the cluster can run arbitrary code and access its data.")


@pytest.mark.parametrize("environ,terminal,expected", [
    ({}, False, {COLOR: "0"}),  # asyncsgd ray-job ... > log.txt 2>&1
    ({}, True, {}),  # a terminal: Ray's colours
    ({"NO_COLOR": "1"}, True, {COLOR: "0"}),  # https://no-color.org
    ({"NO_COLOR": ""}, True, {}),  # set but empty does not count
    ({COLOR: "1"}, False, {}),  # the user's choice stands
    ({COLOR: "0"}, True, {}),
])
def test_colour_is_off_where_the_output_is_not_a_terminal(environ, terminal, expected):
    assert driver_environment(environ, terminal) == expected


def _record(message: str, level=logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(AUTH_LOGGER, level, "authentication_token_setup.py", 85, message,
                             None, None)


def test_only_the_notice_that_authentication_is_on_is_dropped():
    notice = TokenNotice()
    assert not notice.filter(_record(ENABLED))
    assert notice.filter(_record(DISABLED))  # a warning that matters passes
    assert notice.filter(_record("Generated new authentication token and saved to /x",
                                 logging.INFO))


def test_the_driver_output_is_restored_after_the_job():
    environ = {"PATH": "/bin"}
    output = DriverOutput(environ)  # under pytest stdout is captured: not a terminal
    assert environ == {"PATH": "/bin", COLOR: "0"}
    assert not logging.getLogger(AUTH_LOGGER).filter(_record(ENABLED))
    output.restore()
    assert environ == {"PATH": "/bin"}
    assert logging.getLogger(AUTH_LOGGER).filter(_record(ENABLED))
    kept = {COLOR: "1"}
    DriverOutput(kept).restore()
    assert kept == {COLOR: "1"}


def test_the_installed_ray_logs_the_notice_where_the_filter_sits():
    """The logger and the words the filter looks for are the installed Ray's (read as text:
    importing Ray would cost the fast tier seconds)."""
    spec = importlib.util.find_spec("ray")
    if spec is None:
        pytest.skip("Ray is not installed (pip install -e '.[dev,ray]')")
    source = Path(spec.submodule_search_locations[0], *AUTH_LOGGER.split(".")[1:])
    text = source.with_suffix(".py").read_text()
    assert "logging.getLogger(__name__)" in text
    assert f'"{AUTH_NOTICE}. Set "' in text
