"""The Python API: one function per command, each what the command runs (``cli.py`` only parses
options and calls these).

    import asyncsgd

    if __name__ == "__main__":   # children import the calling script again: guard the run
        result = asyncsgd.hogwild(task="mnist1d-cnn", procs=4, epochs=30)

Each takes its command's settings dataclass, or its fields as keywords, or both (keywords
win), checked as the options are; with ``resume``, the saved settings under those given.
``task=`` takes a task's name, a top-level function returning a Task, or a Task
(``Task.from_model``). The training functions also take ``on_eval=fn`` (and
``callbacks=[...]``): ``fn(record)`` in this process at each evaluation; one that raises
stops the run, which is saved, then ``CallbackError`` names it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

from .config import (CompareConfig, DDPConfig, HogwildConfig, PlotConfig, SimulateConfig,
                     SingleConfig)
from .errors import ConfigError
from .modes import hogwild as hogwild_mode
from .run.recorder import RunResult
from .run.given_task import task_from, task_given, task_named
from .run.settings import configure
from .run.sinks import attached
from .run.sinks import callbacks as as_sinks

# Each other command's own modules are imported by its function: importing them all cost
# ``asyncsgd hogwild`` 0.2-0.4 s of its start-up (``python -X importtime``: the report's
# plots, the comparison runner and the simulator; experiments/README.md, "Start-up and exit").
if TYPE_CHECKING:
    from .analysis.publish import Plotted
    from .comparison.runner import CompareResult
    from .run.reader import Run
    from .simulator.simulate import SimulateResult


def hogwild(config: Optional[HogwildConfig] = None, /, *, on_eval: Optional[Callable] = None,
            callbacks: Iterable = (), **settings: Any) -> RunResult:
    """``asyncsgd hogwild``: processes updating one shared model without locks. Returns
    the run's directory and its summary.json. ``on_eval`` (and each of ``callbacks``) is
    called here with each evaluation's record, as metrics.jsonl holds it."""
    config, settings, source = task_given(config, settings)
    cfg = configure(HogwildConfig, config, settings)
    with attached(as_sinks(on_eval, callbacks)):
        return hogwild_mode.train(cfg, task_from(source, cfg))


def single(config: Optional[SingleConfig] = None, /, *, on_eval: Optional[Callable] = None,
           callbacks: Iterable = (), **settings: Any) -> RunResult:
    """``asyncsgd single``: plain SGD in this process, the baseline. Returns the run's
    directory and its summary.json. ``on_eval``, ``callbacks``: as ``hogwild``'s."""
    config, settings, source = task_given(config, settings)
    from .modes import single as single_mode
    cfg = configure(SingleConfig, config, settings)
    with attached(as_sinks(on_eval, callbacks)):
        return single_mode.train(cfg, task_from(source, cfg))


def ddp(config: Optional[DDPConfig] = None, /, *, on_eval: Optional[Callable] = None,
        callbacks: Iterable = (), **settings: Any) -> Optional[RunResult]:
    """``asyncsgd ddp``: synchronous DistributedDataParallel. Returns the run's directory and
    its summary.json; None in a rank other than 0 under torchrun (rank 0 writes the run).
    ``on_eval``, ``callbacks``: as ``hogwild``'s (under torchrun, rank 0's are called)."""
    config, settings, source = task_given(config, settings)
    from .modes import ddp as ddp_mode
    cfg = configure(DDPConfig, config, settings)
    with attached(as_sinks(on_eval, callbacks)):
        return ddp_mode.train(cfg, task_from(source, cfg))


def compare(config: Optional[CompareConfig] = None, /, **settings: Any) -> CompareResult:
    """``asyncsgd compare``: every mode on the same task, seeds and budget, one after
    another (``clock="virtual"``: in the simulator, as ``simulate``). Returns the
    report's directory, its table and every attempt (``.failed``: those that failed)."""
    from .comparison.runner import compare as run_compare
    config, settings = task_named(config, settings, "compare's runs")
    return run_compare(configure(CompareConfig, config, settings))


def simulate(config: Optional[SimulateConfig] = None, /, **settings: Any) -> SimulateResult:
    """``asyncsgd simulate``: every mode in this process on a virtual clock, learning for
    real, under a cost model (the task's profile, or the step time, gradient size and
    links given). Returns the report's directory, its table, every attempt (``.failed``:
    those that failed) and the cost model."""
    from .simulator.simulate import simulate as run_simulate
    config, settings = task_named(config, settings, "simulate's runs")
    return run_simulate(configure(SimulateConfig, config, settings))


def plot(*run_dirs: Union[str, Path], config: Optional[PlotConfig] = None,
         **settings: Any) -> Plotted:
    """``asyncsgd plot``: the table, report.md and plots of any run directories (of any
    mode, or of a compare) in ``out``. Returns the table's text, the warnings (settings
    that differ, runs cut short) and the runs not counted as results."""
    from .analysis.publish import report_runs
    cfg = configure(PlotConfig, config, settings)
    if not run_dirs:
        raise ConfigError("plot: give at least one run directory")
    return report_runs(list(run_dirs), Path(cfg.out), cfg.target, allow_mixed=cfg.allow_mixed)


def load_run(path: Union[str, Path]) -> Run:
    """Read the run directory ``path`` of any training mode: its settings, its metrics as
    a list of records and its summary; ``.model()`` loads the trained model."""
    from .run.reader import Run
    return Run.load(path)
