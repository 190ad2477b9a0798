"""Progress on long work: a live bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from ..core.scoring import Metric


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60:02d}:{seconds % 60:02d}" if seconds < 3600 else \
        f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Shows samples done, samples/s and the latest evaluation.

    ``style`` is ``bar`` (redrawn in place, for terminals), ``log`` (a line
    every ``log_every`` seconds, for files and CI) or ``off``; ``auto``
    picks ``bar`` when the stream is a terminal.
    """

    def __init__(self, label: str, total: Optional[int], style: str = "auto",
                 stream: TextIO = sys.stderr, log_every: float = 5.0):
        if style == "auto":
            style = "bar" if getattr(stream, "isatty", lambda: False)() else "log"
        self.label, self.total, self.style, self.stream = label, total, style, stream
        self.log_every = log_every
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

    def update(self, t: float, samples: int, rate: float, force: bool = False) -> None:
        if self.style == "off":
            return
        now = time.monotonic()
        if self.style == "bar":
            if force or now - self._last_draw >= 0.2:
                self._last_draw = now
                self._draw(t, samples, rate)
        elif force or now - self._last_log >= self.log_every:
            self._last_log = now
            self.stream.write(f"[{self.label}] {_fmt_time(t)} {self._status(samples, rate)}\n")
            self.stream.flush()

    def _status(self, samples: int, rate: float) -> str:
        done = f"{samples:,}" + (f"/{self.total:,}" if self.total else "") + " samples"
        parts = [done, f"{rate:,.0f} samples/s"]
        if self._eval:
            parts.append(self._eval)
        if self._note:
            parts.append(self._note)
        return " | ".join(parts)

    def _draw(self, t: float, samples: int, rate: float) -> None:
        bar = ""
        if self.total:
            frac = min(1.0, samples / self.total)
            filled = int(frac * 20)
            bar = f"{frac * 100:3.0f}% |{'#' * filled}{'.' * (20 - filled)}| "
        line = f"\r[{self.label}] {bar}{_fmt_time(t)} {self._status(samples, rate)}"
        self.stream.write(line + "\x1b[K")  # erase what a longer previous line left
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self.style == "bar" and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
