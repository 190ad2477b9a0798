"""Sinks: what else a run tells its settings, each evaluation and its summary to, beside
metrics.jsonl: the loggers of --log-to and the Python API's ``on_eval`` callbacks.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

from ..errors import CallbackError, ConfigError

log = logging.getLogger(__name__)


class Sink:
    """Told, in the process that records the run: its settings as it starts, every eval
    record of metrics.jsonl as it is written, its summary.json as it ends."""

    name = "sink"

    def on_start(self, settings: dict) -> None:
        """``settings``: config.json's ``config`` (every setting of the run)."""

    def on_eval(self, record: dict) -> None:
        """``record``: the eval event exactly as metrics.jsonl holds it."""

    def on_end(self, summary: dict) -> None:
        """``summary``: summary.json; the last call a sink gets."""


class Callback(Sink):
    """A user's function, called with each eval record (the API's ``on_eval``)."""

    def __init__(self, fn: Callable[[dict], object]):
        self.fn = fn
        self.name = "callback " + (getattr(fn, "__qualname__", None) or repr(fn))

    def on_eval(self, record: dict) -> None:
        self.fn(dict(record))  # a copy: what the callback does to it stays there


class Sinks:
    """Every sink of a run. A sink that raises is dropped and its failure kept, so the
    run can stop and save itself (``raise_failure``) without the sink being called again."""

    def __init__(self, sinks: Iterable[Sink] = ()):
        self.sinks = list(sinks)
        self.failure: Optional[CallbackError] = None
        self._raised = False

    def _each(self, method: str, value: dict) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(value)
            except Exception as exc:  # noqa: BLE001 - a user's code may raise anything
                self.sinks.remove(sink)
                log.error("%s failed in %s: %r", sink.name, method, exc)
                if self.failure is None:
                    self.failure = CallbackError(
                        f"{sink.name} raised {type(exc).__name__}: {exc} (in {method}); "
                        "the run stopped and was saved: fix or remove it")
                    self.failure.__cause__ = exc

    def start(self, settings: dict) -> None:
        self._each("on_start", settings)

    def eval(self, record: dict) -> None:
        self._each("on_eval", record)

    def end(self, summary: dict) -> None:
        self._each("on_end", summary)
        self.sinks = []

    def raise_failure(self) -> None:
        """Raise a sink's failure, once: the run stops at it and then saves itself."""
        if self.failure is not None and not self._raised:
            self._raised = True
            raise self.failure


_ATTACHED: contextvars.ContextVar = contextvars.ContextVar("asyncsgd_sinks", default=())


@contextlib.contextmanager
def attached(sinks: Iterable[Sink]) -> Iterator[None]:
    """The runs recorded in this thread within the block also tell ``sinks`` (the API's
    callbacks reach the Recorder of whichever mode it calls, without every mode passing
    them on)."""
    token = _ATTACHED.set(tuple(_ATTACHED.get()) + tuple(sinks))
    try:
        yield
    finally:
        _ATTACHED.reset(token)


def attached_sinks() -> tuple:
    """The sinks ``attached`` in this thread now."""
    return tuple(_ATTACHED.get())


def callbacks(on_eval: Optional[Callable] = None, callbacks: Iterable = ()) -> list:
    """The API's ``on_eval`` and ``callbacks=[...]`` as sinks: a function is called with
    each eval record; a ``Sink`` is kept as it is. Anything else is refused here."""
    given = ([on_eval] if on_eval is not None else []) + list(callbacks or ())
    out = []
    for item in given:
        if isinstance(item, Sink):
            out.append(item)
        elif callable(item):
            out.append(Callback(item))
        else:
            raise ConfigError(f"on_eval/callbacks: {item!r} is neither a function nor an "
                              "asyncsgd.run.sinks.Sink; pass a function taking the eval record")
    return out


class EvalFollower:
    """Tells ``sinks`` the eval records another process writes into ``metrics`` (DDP's
    rank 0 records a run its launching parent started: the API's callbacks live here)."""

    def __init__(self, metrics: Path, sinks: Iterable[Sink]):
        self.path, self.sinks, self._offset = Path(metrics), Sinks(sinks), 0

    def poll(self) -> bool:
        """Tell the complete eval lines written since the last poll; True once a sink
        failed (the caller then stops the run)."""
        if self.sinks.sinks and self.path.exists():
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                for line in fh:
                    if not line.endswith(b"\n"):
                        break  # being written: read it whole next time
                    self._offset += len(line)
                    record = json.loads(line)
                    if record.get("event") == "eval":
                        self.sinks.eval(record)
        return self.sinks.failure is not None

    def end(self, summary: Optional[dict]) -> None:
        """The last evaluations, then the summary; raises a sink's failure."""
        self.poll()
        if summary is not None:
            self.sinks.end(summary)
        self.sinks.raise_failure()
