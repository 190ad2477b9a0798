"""The progress display (``run.progress``): its ETA, in the log lines and the bar, and the
clock it is given, from a real ``asyncsgd single``."""

import io
import re
import subprocess
import time

import pytest

from asyncsgd.core.scoring import ACCURACY
from asyncsgd.run.progress import Progress, fmt_time
from conftest import asyncsgd_cmd, read_events


class Terminal(io.StringIO):
    def isatty(self):
        return True


def _log(**kw):
    stream = io.StringIO()
    return Progress("hogwild", style="log", stream=stream, **kw), stream


def test_the_eta_is_the_samples_left_at_the_rate_when_they_end_first():
    progress, stream = _log(total=10_000, seconds=60)
    progress.update(10, 2_000, 200)  # 8,000 samples left at 200/s: 40 s; the budget has 50
    assert progress.eta(10, 2_000, 200) == 40
    assert stream.getvalue() == \
        "[hogwild] 00:10 2,000/10,000 samples | 200 samples/s | ETA 00:40\n"


def test_the_eta_is_the_time_budget_left_when_it_ends_first():
    progress, stream = _log(total=10_000, seconds=60)
    progress.evaluated(ACCURACY, 0.5, 1.25)
    progress.note("waited 10%")
    progress.update(10, 2_000, 100)  # 80 s of samples left, but only 50 s of budget
    assert stream.getvalue() == ("[hogwild] 00:10 2,000/10,000 samples | 100 samples/s | "
                                 "ETA 00:50 | test accuracy 50.0% loss 1.250 | waited 10%\n")
    assert progress.eta(75, 9_000, 100) == 0  # past the budget: nothing left, never negative


def test_a_resumed_runs_budget_counts_from_where_its_clock_resumed():
    progress, _ = _log(total=None, seconds=60, since=100.0)  # resumed at t = 100 s
    assert progress.eta(130, 0, 0) == 30
    assert progress.fraction(130, 0) == 0.5


def test_without_a_budget_there_is_no_eta():
    progress, stream = _log(total=None)
    progress.update(3725, 1_234_567, 4_321.4)
    assert stream.getvalue() == "[hogwild] 1:02:05 1,234,567 samples | 4,321 samples/s\n"
    assert progress.eta(3725, 0, 100) is None and progress.fraction(3725, 0) is None
    # the samples alone give one once the rate is known
    assert Progress("x", 1_000, style="off").eta(1, 0, 0) is None
    assert Progress("x", 1_000, style="off").eta(1, 250, 250) == 3


@pytest.mark.parametrize("seconds, expected", [(0, "00:00"), (59.9, "00:59"), (61, "01:01"),
                                               (3599, "59:59"), (3600, "1:00:00"),
                                               (-3, "00:00")])
def test_times_are_whole_seconds_down(seconds, expected):
    assert fmt_time(seconds) == expected


def test_the_bar_fills_by_the_budget_nearer_its_end_and_fits_one_terminal_line(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    stream = Terminal()
    progress = Progress("single", 10_000, style="auto", stream=stream, seconds=20)
    assert progress.style == "bar"
    progress.update(15, 2_500, 500, force=True)  # samples 25% done, time 75%: 75%, ETA 5 s
    assert stream.getvalue() == ("\r[single]  75% |###############.....| 00:15 2,500/10,000 "
                                 "samples | 500 samples/s | ETA 00:05\x1b[K")
    monkeypatch.setenv("COLUMNS", "40")
    stream.truncate(0)
    stream.seek(0)
    progress.update(16, 3_000, 500, force=True)
    text = stream.getvalue()
    assert text.startswith("\r[single]  80% |####") and text.endswith("\x1b[K")
    assert len(text) - len("\r\x1b[K") == 39  # one column short of the width: no wrap
    progress.close()
    assert stream.getvalue().endswith("\n")


def test_due_says_when_an_update_would_show_something(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    progress, stream = _log(total=1_000, log_every=5.0)
    assert progress.due()  # nothing logged yet
    progress.update(1, 10, 10.0)
    assert stream.getvalue().count("\n") == 1 and not progress.due()
    now[0] += 4.9
    progress.update(2, 20, 10.0)  # not due: nothing written
    assert stream.getvalue().count("\n") == 1 and progress.due(force=True)
    now[0] += 0.1
    assert progress.due()
    progress.update(3, 30, 10.0)
    assert stream.getvalue().count("\n") == 2
    bar = Progress("single", 100, style="bar", stream=Terminal())
    assert bar.due()
    bar.update(1, 1, 1.0)
    now[0] += 0.19
    assert not bar.due()
    now[0] += 0.01
    assert bar.due()
    assert not Progress("single", 100, style="off", stream=io.StringIO()).due(force=True)


def test_a_real_runs_log_lines_have_its_eta_and_its_clock_starts_at_the_launch(cli_env,
                                                                                tmp_path):
    """``asyncsgd single --max-seconds 3``: its first progress line comes after its start
    event (so that event's t, the start-up before the run's bookkeeping began, is at most
    the time from the launch to that line), and every event's t counts from the launch:
    its Unix time less t is when the process was launched, within the kernel's 10 ms
    ticks (and what it takes to fork)."""
    out = tmp_path / "run"
    launched_wall, launched = time.time(), time.monotonic()
    proc = subprocess.Popen(
        asyncsgd_cmd("single", "--samples", 500, "--epochs", 100_000, "--max-seconds", 3,
                     "--eval-every", 0.5, "--progress", "log", "--out", out), env=cli_env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        err = ""
        for line in proc.stderr:
            err += line
            if line.startswith("[single]"):
                first_line_after = time.monotonic() - launched
                break
        err += proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("[single]")]
    assert len(lines) >= 2, err  # the first, and the last (forced) at the end
    for ln in lines:
        m = re.match(r"\[single\] (\d\d):(\d\d) [\d,]+/40,000,000 samples \| [\d,]+ "
                     r"samples/s \| ETA (\d\d):(\d\d)", ln)
        assert m, ln
        elapsed, eta = int(m[1]) * 60 + int(m[2]), int(m[3]) * 60 + int(m[4])
        # whole seconds down of t and of 3 - t: the budget ends long before the epochs
        assert elapsed + eta in (2, 3) or (eta == 0 and elapsed >= 2), ln
    events = read_events(out)
    start = events[0]
    assert start["event"] == "start" and start["clock"] == "command"
    assert 0 < start["t"] <= first_line_after + 0.02
    for e in events:
        assert launched_wall - 0.02 <= e["wall"] - e["t"] <= launched_wall + 0.5, e
