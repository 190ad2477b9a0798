"""The run directory: one format written by every training mode.

    RUN_DIR/
      config.json     every setting, the task, versions, host, command line
      config.yaml     the settings as a file for --config (``settings.write_settings_file``)
      metrics.jsonl   one JSON object per event (see ``metrics.py``)
      summary.json    the task's final metric, samples/s, wall time, time to target, ...
      checkpoint.pt   the latest model (see ``checkpoint.py``)
      tensorboard/    event files, with --tensorboard

``compare`` and ``plot`` read any mode's directory alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from ..core.files import atomic_write
from ..errors import CheckpointError, ConfigError
from ..version import __version__

CONFIG, METRICS, SUMMARY = "config.json", "metrics.jsonl", "summary.json"
CHECKPOINT = "checkpoint.pt"


def _write_json(path: Path, obj: dict) -> None:
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    atomic_write(path, lambda fh: fh.write(text.encode()))


def environment() -> dict:
    """Versions and host facts recorded with every run."""
    import numpy
    import torch
    versions = {"asyncsgd": __version__, "python": platform.python_version(),
                "torch": torch.__version__, "numpy": numpy.__version__}
    for name in ("zmq", "msgpack"):
        try:
            mod = __import__(name)
            versions[name] = getattr(mod, "__version__", None) or ".".join(
                map(str, getattr(mod, "version", ())))
        except ImportError:
            pass
    host = {"hostname": socket.gethostname(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "cuda": torch.cuda.is_available()}
    if host["cuda"]:
        host["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"versions": versions, "host": host}


class RunDir:
    """A run directory on disk."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    @classmethod
    def create(cls, out: Optional[str], mode: str) -> "RunDir":
        """Make a fresh run directory: ``out``, or ``runs/<time>-<mode>``."""
        if out is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            base = Path("runs") / f"{stamp}-{mode}"
            path, n = base, 1
            while path.exists():
                n += 1
                path = base.with_name(f"{base.name}-{n}")
        else:
            path = Path(out)
        made = [p for p in (path, *path.parents) if not p.exists()]  # what mkdir will make
        if path.exists() and (path / CONFIG).exists():
            raise ConfigError(f"--out {path} already holds a run; choose a new directory, "
                              f"or continue it with --resume {path}")
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"cannot write the run directory {path}: {exc.strerror or exc}; "
                              "choose a writable place with --out DIR") from exc
        run = cls(path)
        run.made = made
        return run

    made: tuple = ()  # the directories ``create`` made, deepest first

    @contextlib.contextmanager
    def removed_on_error(self) -> Iterator["RunDir"]:
        """Around what a mode does before its run writes anything (loading and checking the
        task): an error there removes the directories ``create`` made, so a failed start
        leaves nothing behind and the same --out works next time. A directory that was
        there before, or that holds anything, stays."""
        try:
            yield self
        except BaseException:
            with contextlib.suppress(OSError):
                for directory in self.made:
                    directory.rmdir()  # only when empty
            raise

    @classmethod
    def open(cls, path: str) -> "RunDir":
        """An existing run directory (for --resume, compare and plot)."""
        run = cls(Path(path))
        if not run.path.exists():
            raise ConfigError(f"{path} does not exist; pass a run directory an asyncsgd run "
                              "wrote (its --out, e.g. runs/hogwild-...)")
        if not (run.path / CONFIG).is_file():
            raise ConfigError(f"{path} is not a run directory (no {CONFIG}); "
                              "pass a directory written by an asyncsgd run")
        return run

    def write_config(self, mode: str, config: dict, task: dict,
                     argv: Optional[list] = None) -> None:
        record = {"mode": mode, "config": config, "task": task,
                  "command": argv if argv is not None else sys.argv,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **environment()}
        _write_json(self.path / CONFIG, record)

    def read_config(self) -> dict:
        return self._read_json(CONFIG)

    def write_summary(self, summary: dict) -> None:
        _write_json(self.path / SUMMARY, summary)

    def read_summary(self) -> dict:
        return self._read_json(SUMMARY)

    def events(self) -> Iterator[dict]:
        """Every event in metrics.jsonl; a torn last line (a killed writer) is skipped."""
        path = self.path / METRICS
        if not path.exists():
            return
        with open(path) as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue

    def _read_json(self, name: str) -> dict:
        try:
            with open(self.path / name) as fh:
                return json.load(fh)
        except FileNotFoundError as exc:
            raise CheckpointError(f"{self.path / name} is missing") from exc
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{self.path / name} is not valid JSON: {exc}") from exc
