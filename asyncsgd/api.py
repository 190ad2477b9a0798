"""The Python API: one function per command, each what the command runs (``cli.py`` only parses
options and calls these).

    import asyncsgd

    if __name__ == "__main__":   # children import the calling script again: guard the run
        result = asyncsgd.hogwild(task="mnist1d-cnn", procs=4, epochs=30)

Each takes its command's settings dataclass, or its fields as keywords, or both (keywords
win), checked as the options are; with ``resume``, the saved settings under those given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from .analysis.compare import CompareResult
from .analysis.compare import compare as run_compare
from .analysis.publish import Plotted, report_runs
from .config import (CompareConfig, DDPConfig, HogwildConfig, PlotConfig, SingleConfig,
                     config_from_dict)
from .core.tasks import Task, task_of
from .errors import CheckpointError, ConfigError
from .modes import ddp as ddp_mode
from .modes import hogwild as hogwild_mode
from .modes import single as single_mode
from .run.checkpoint import load_checkpoint
from .run.recorder import RunResult
from .run.rundir import RunDir
from .run.settings import MODES, configure, saved_settings


def hogwild(config: Optional[HogwildConfig] = None, /, **settings: Any) -> RunResult:
    """``asyncsgd hogwild``: processes updating one shared model without locks. Returns
    the run's directory and its summary.json."""
    return hogwild_mode.train(configure(HogwildConfig, config, settings))


def single(config: Optional[SingleConfig] = None, /, **settings: Any) -> RunResult:
    """``asyncsgd single``: plain SGD in this process, the baseline. Returns the run's
    directory and its summary.json."""
    return single_mode.train(configure(SingleConfig, config, settings))


def ddp(config: Optional[DDPConfig] = None, /, **settings: Any) -> Optional[RunResult]:
    """``asyncsgd ddp``: synchronous DistributedDataParallel. Returns the run's directory and
    its summary.json; None in a rank other than 0 under torchrun (rank 0 writes the run)."""
    return ddp_mode.train(configure(DDPConfig, config, settings))


def compare(config: Optional[CompareConfig] = None, /, **settings: Any) -> CompareResult:
    """``asyncsgd compare``: every mode on the same task, seeds and budget, one after
    another. Returns the report's directory, its table and every attempt (``.failed``:
    those that failed)."""
    return run_compare(configure(CompareConfig, config, settings))


@dataclass
class Run:
    """A finished (or running) run, read back: what ``load_run`` returns."""

    path: Path
    mode: str  # hogwild, single, ddp or ps
    config: Any  # its settings: a HogwildConfig, SingleConfig, DDPConfig or ServerConfig
    metrics: list  # every event of metrics.jsonl, oldest first: pandas.DataFrame(run.metrics)
    summary: dict  # summary.json; empty while the run has not ended
    _task: Optional[Task] = field(default=None, repr=False, compare=False)

    def task(self) -> Task:
        """The run's task, with its data (built once)."""
        if self._task is None:
            self._task = task_of(self.config)
        return self._task

    def model(self, device: str = "cpu"):
        """The task's model with the weights of the run's checkpoint (the final ones of a
        finished run), in eval mode: ready for inference."""
        checkpoint = load_checkpoint(RunDir(self.path).checkpoint)
        model = self.task().build_model(self.config.seed)
        try:
            model.load_state_dict(checkpoint["model"])
        except (KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{RunDir(self.path).checkpoint} does not fit task "
                                  f"{self.task().name}'s model: {str(exc).splitlines()[0]}"
                                  ) from exc
        return model.to(device).eval()


def plot(*run_dirs: Union[str, Path], config: Optional[PlotConfig] = None,
         **settings: Any) -> Plotted:
    """``asyncsgd plot``: the table, report.md and plots of any run directories (of any
    mode, or of a compare) in ``out``. Returns the table's text, the warnings (settings
    that differ, runs cut short) and the runs not counted as results."""
    cfg = configure(PlotConfig, config, settings)
    if not run_dirs:
        raise ConfigError("plot: give at least one run directory")
    return report_runs(list(run_dirs), Path(cfg.out), cfg.target, allow_mixed=cfg.allow_mixed)


def load_run(path: Union[str, Path]) -> Run:
    """Read the run directory ``path`` of any training mode: its settings, its metrics as
    a list of records and its summary; ``.model()`` loads the trained model."""
    run = RunDir.open(str(path))
    mode = run.read_config().get("mode")
    if mode not in MODES:
        raise CheckpointError(f"{path} holds a run of mode {mode!r}; load_run reads "
                              f"{', '.join(MODES)} runs")
    config = config_from_dict(MODES[mode][0], saved_settings(run, MODES[mode][0]))
    summary = run.read_summary() if (run.path / "summary.json").is_file() else {}
    return Run(run.path, mode, config, list(run.events()), summary)
