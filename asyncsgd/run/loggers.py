"""The loggers of --log-to: MLflow (a local mlruns/ file store by default) and W&B (offline
unless WANDB_MODE says otherwise), each a sink of the run's settings, evaluations and summary.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable

from ..errors import ConfigError
from .sinks import Sink

LOGGERS = ("mlflow", "wandb")
EXPERIMENT = "asyncsgd"  # MLflow's experiment and W&B's project of every run
_SKIPPED = {"event", "samples", "wall"}  # the step and the wall time, not metrics


def _need(module: str, what: str):
    try:
        return __import__(module)
    except ImportError as exc:
        raise ConfigError(f"--log-to {what} needs the {module} package: pip install "
                          f"'asyncsgd[loggers]' (or drop --log-to {what})") from exc


def numbers(record: dict, skip: Iterable = _SKIPPED) -> dict:
    """The numeric fields of a record (booleans, texts and nested values left out)."""
    return {k: v for k, v in record.items() if k not in skip
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_settings(settings: dict) -> dict:
    """Settings as MLflow params: texts, a tuple as its items joined, None as 'none'."""
    def text(v):
        if isinstance(v, (list, tuple)):
            return ",".join(map(str, v))
        return "none" if v is None else str(v)
    return {k: text(v)[:6000] for k, v in settings.items()}  # MLflow's longest param value


def mlflow_uri(run_path: Path) -> str:
    """$MLFLOW_TRACKING_URI, else the file store mlruns/ beside the run directory (in
    --out), shared by the runs written there."""
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        (Path(run_path).resolve().parent / "mlruns").as_uri()


class MlflowSink(Sink):
    """One MLflow run per run directory (its name; a resumed run continues it): params,
    every evaluation's metrics at step = samples, the summary's numbers as ``summary/*``
    and summary.json as an artifact."""

    name = "--log-to mlflow"

    def __init__(self, run_path: Path):
        _need("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient
        self.uri = mlflow_uri(run_path)
        if self.uri.startswith("file:"):  # MLflow 3 refuses its file store unless told
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(EXPERIMENT)
        path = str(Path(run_path).resolve())
        found = self.client.search_runs([exp_id], f"tags.`asyncsgd.run_dir` = '{path}'",
                                        max_results=1)
        self.resumed = bool(found)
        self.run_id = found[0].info.run_id if found else self.client.create_run(
            exp_id, run_name=Path(run_path).name, tags={"asyncsgd.run_dir": path}).info.run_id

    def on_start(self, settings: dict) -> None:
        if self.resumed:  # MLflow params are written once; a resume keeps the first
            return
        from mlflow.entities import Param
        params = [Param(k, v) for k, v in flat_settings(settings).items()]
        for i in range(0, len(params), 100):  # MLflow's most params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def on_eval(self, record: dict) -> None:
        from mlflow.entities import Metric
        stamp = int(record["wall"] * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(k, float(v), stamp, int(record["samples"]))
            for k, v in numbers(record).items()])

    def on_end(self, summary: dict) -> None:
        from mlflow.entities import Metric
        stamp, step = int(time.time() * 1000), int(summary.get("samples") or 0)
        self.client.log_batch(self.run_id, metrics=[
            Metric(f"summary/{k}", float(v), stamp, step)
            for k, v in numbers(summary, skip=()).items()])
        self.client.log_dict(self.run_id, summary, "summary.json")
        status = {"ok": "FINISHED", "interrupted": "KILLED"}.get(summary.get("status"), "FAILED")
        self.client.set_terminated(self.run_id, status)


class WandbSink(Sink):
    """One W&B run, its files in the run directory (RUN_DIR/wandb/), offline unless
    $WANDB_MODE is set: settings as its config, every evaluation as a history row
    against ``samples``, the summary as its summary."""

    name = "--log-to wandb"

    def __init__(self, run_path: Path):
        wandb = _need("wandb", "wandb")
        self.run = wandb.init(project=EXPERIMENT, name=Path(run_path).name,
                              dir=str(run_path), mode=os.environ.get("WANDB_MODE") or "offline",
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("samples")
        self.run.define_metric("*", step_metric="samples")

    def on_start(self, settings: dict) -> None:
        self.run.config.update(settings, allow_val_change=True)

    def on_eval(self, record: dict) -> None:
        self.run.log({**numbers(record), "samples": int(record["samples"])})

    def on_end(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if summary.get("status") == "ok" else 1)


def check_loggers(names: Iterable[str]) -> None:
    """Each logger's library is installed: checked before the run directory is made."""
    for name in names:
        _need(name, name)


def open_loggers(names: Iterable[str], run_path: Path) -> list:
    """The sinks of --log-to, in the order given, each once."""
    kinds = {"mlflow": MlflowSink, "wandb": WandbSink}
    return [kinds[name](run_path) for name in dict.fromkeys(names)]
