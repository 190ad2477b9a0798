"""Progress on long work: a live bar on a terminal, plain log lines otherwise.

    [hogwild]  41% |########............| 00:06 25,000/60,000 samples | ... | ETA 00:08

Not tqdm or rich: their ETA ignores a time budget, their clock is their own object's rather
than the run's, and neither writes plain periodic lines for files and CI.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Optional, TextIO

from ..core.scoring import Metric

BAR_WIDTH = 20


def fmt_time(seconds: float) -> str:
    """mm:ss, or h:mm:ss from an hour on (whole seconds, down)."""
    seconds = int(max(0.0, seconds))
    return f"{seconds // 60:02d}:{seconds % 60:02d}" if seconds < 3600 else \
        f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _columns(stream: TextIO) -> int:
    """The width of the terminal ``stream`` is (stderr, while stdout may be a pipe)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size((100, 24)).columns


class Progress:
    """Shows samples done, samples/s, the ETA and the latest evaluation.

    ``style`` is ``bar`` (redrawn in place, for terminals), ``log`` (a line
    every ``log_every`` seconds, for files and CI) or ``off``; ``auto``
    picks ``bar`` when the stream is a terminal. ``total``: the samples at which the
    work ends (epochs x samples per epoch), ``seconds``: its time budget, counted on the
    clock ``update`` is given from ``since`` (a resumed run's clock starts past 0).
    The ETA is when the nearer of the two budgets ends; the bar fills by the same.
    """

    def __init__(self, label: str, total: Optional[int], style: str = "auto",
                 stream: TextIO = sys.stderr, log_every: float = 5.0,
                 seconds: Optional[float] = None, since: float = 0.0):
        if style == "auto":
            style = "bar" if getattr(stream, "isatty", lambda: False)() else "log"
        self.label, self.total, self.style, self.stream = label, total, style, stream
        self.log_every = log_every
        self.seconds, self.since = seconds, since
        self._last_draw = 0.0
        self._last_log = float("-inf")
        self._eval = ""
        self._note = ""
        self._drawn = False

    def evaluated(self, metric: Metric, score: float, loss: float) -> None:
        self._eval = f"test {metric.name} {metric.format(score)} loss {loss:.3f}"

    def note(self, text: str) -> None:
        """One more part of the status, e.g. the share of time stragglers waited."""
        self._note = text

    def eta(self, t: float, samples: int, rate: float) -> Optional[float]:
        """Seconds until the time budget ends or, at ``rate``, the samples are done,
        whichever comes first; None when neither is known."""
        left = []
        if self.seconds:
            left.append(max(0.0, self.since + self.seconds - t))
        if self.total and rate > 0:
            left.append(max(0, self.total - samples) / rate)
        return min(left) if left else None

    def fraction(self, t: float, samples: int) -> Optional[float]:
        """How far the budget nearer its end is used, 0 to 1; None when neither is known."""
        done = []
        if self.seconds:
            done.append((t - self.since) / self.seconds)
        if self.total:
            done.append(samples / self.total)
        return min(1.0, max(0.0, *done)) if done else None

    def due(self, force: bool = False) -> bool:
        """Whether ``update`` would draw or log now: a caller that builds its ``note`` every
        step (a worker's) skips that work while nothing is shown."""
        if self.style == "off":
            return False
        last, every = (self._last_draw, 0.2) if self.style == "bar" else \
            (self._last_log, self.log_every)
        return force or time.monotonic() - last >= every

    def update(self, t: float, samples: int, rate: float, force: bool = False) -> None:
        if not self.due(force):
            return
        if self.style == "bar":
            self._last_draw = time.monotonic()
            self._draw(t, samples, rate)
        else:
            self._last_log = time.monotonic()
            self.stream.write(self.line(t, samples, rate) + "\n")
            self.stream.flush()

    def line(self, t: float, samples: int, rate: float) -> str:
        """The log line (the bar's text less its bar)."""
        return f"[{self.label}] {fmt_time(t)} {self._status(t, samples, rate)}"

    def _status(self, t: float, samples: int, rate: float) -> str:
        done = f"{samples:,}" + (f"/{self.total:,}" if self.total else "") + " samples"
        parts = [done, f"{rate:,.0f} samples/s"]
        eta = self.eta(t, samples, rate)
        if eta is not None:
            parts.append(f"ETA {fmt_time(eta)}")
        if self._eval:
            parts.append(self._eval)
        if self._note:
            parts.append(self._note)
        return " | ".join(parts)

    def _draw(self, t: float, samples: int, rate: float) -> None:
        bar = ""
        frac = self.fraction(t, samples)
        if frac is not None:
            filled = int(frac * BAR_WIDTH)
            bar = f"{frac * 100:3.0f}% |{'#' * filled}{'.' * (BAR_WIDTH - filled)}| "
        line = f"[{self.label}] {bar}{fmt_time(t)} {self._status(t, samples, rate)}"
        # one terminal line, or each redraw would start a new one
        width = _columns(self.stream)
        self.stream.write("\r" + line[:max(1, width - 1)] + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.style == "bar" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
