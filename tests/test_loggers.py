"""--log-to mlflow|wandb and the API's on_eval: what each is told is metrics.jsonl's, read back
through MLflow's own client and W&B's own reader of its offline files."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import asyncsgd
from asyncsgd.errors import CallbackError, ConfigError
from asyncsgd.run.loggers import mlflow_uri
from asyncsgd.run.sinks import EvalFollower, Sink, Sinks, callbacks
from conftest import one_line_error, read_events, read_json

SAMPLES = 500  # mnist1d: 400 training rows, 100 test rows


def _tiny(tmp_path, cache_dir, name="run", **kw):
    return {**dict(task="mnist1d-mlp", samples=SAMPLES, epochs=1, progress="off",
                   eval_every=0.05, threads=1, cache_dir=str(cache_dir),
                   out=str(tmp_path / "runs" / name)), **kw}


def _evals(run_dir):
    return [e for e in read_events(run_dir) if e["event"] == "eval"]


@pytest.fixture
def no_tracking_env(monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)


def _mlflow_run(store: Path, run_dir: Path):
    """The MLflow run of ``run_dir`` in the file store ``store``, with its client."""
    pytest.importorskip("mlflow", reason="the loggers extra: pip install 'asyncsgd[loggers]'")
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    exp = client.get_experiment_by_name("asyncsgd")
    runs = client.search_runs([exp.experiment_id],
                              f"attributes.run_name = '{run_dir.name}'")
    assert len(runs) == 1, runs
    return client, runs[0]


def _assert_mlflow_holds(run_dir: Path, summary: dict):
    client, run = _mlflow_run(run_dir.parent / "mlruns", run_dir)
    evals = _evals(run_dir)
    for key in ("accuracy", "loss", "t"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == \
            [(e["samples"], e[key]) for e in evals], key
    assert run.data.params["task"] == "mnist1d-mlp"
    assert run.data.params["log_to"] == ",".join(read_json(run_dir / "config.json")
                                                 ["config"]["log_to"])
    assert run.data.metrics["summary/final_metric"] == summary["final_metric"]
    assert run.data.metrics["summary/samples"] == summary["samples"]
    assert run.info.status == "FINISHED"


# -- pure objects ------------------------------------------------------------------------

class _Boom(Sink):
    name = "boom"

    def __init__(self):
        self.calls = 0

    def on_eval(self, record):
        self.calls += 1
        raise ValueError("no")


def test_a_failing_sink_is_dropped_and_its_failure_raised_once():
    seen, boom = [], _Boom()
    sinks = Sinks([boom, *callbacks(seen.append)])
    sinks.eval({"samples": 1})
    sinks.eval({"samples": 2})
    assert boom.calls == 1 and seen == [{"samples": 1}, {"samples": 2}]
    with pytest.raises(CallbackError, match=r"^boom raised ValueError: no \(in on_eval\); "
                                            "the run stopped and was saved"):
        sinks.raise_failure()
    sinks.raise_failure()  # once: the run's saving goes on


def test_callbacks_take_functions_and_sinks_and_refuse_the_rest():
    sink = Sink()
    made = callbacks(print, [sink])
    assert made[1] is sink and made[0].name == "callback print"
    with pytest.raises(ConfigError, match="3 is neither a function nor"):
        callbacks(callbacks=[3])


def test_the_follower_tells_whole_eval_lines_only(tmp_path):
    metrics, seen = tmp_path / "metrics.jsonl", []
    follow = EvalFollower(metrics, callbacks(seen.append))
    assert not follow.poll()  # nothing written yet
    metrics.write_text('{"event": "start"}\n{"event": "eval", "samples": 0}\n{"event": "ev')
    follow.poll()
    with open(metrics, "a") as fh:
        fh.write('al", "samples": 5}\n')
    follow.end({"status": "ok"})
    assert seen == [{"event": "eval", "samples": 0}, {"event": "eval", "samples": 5}]


def test_mlflow_store_is_beside_the_run_unless_the_env_says(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert mlflow_uri(tmp_path / "runs" / "r1") == (tmp_path / "runs" / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking:5000")
    assert mlflow_uri(tmp_path / "runs" / "r1") == "http://tracking:5000"


def test_a_missing_logger_library_is_one_line_before_the_run(run_cli_here, tmp_path,
                                                             monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if not installed
    res = run_cli_here("single", "--task", "mnist1d-mlp", "--samples", SAMPLES, "--out",
                       tmp_path / "r", "--log-to", "wandb")
    one_line_error(res, "--log-to wandb needs the wandb package: pip install "
                        "'asyncsgd[loggers]' (or drop --log-to wandb)")
    assert res.returncode == 2 and not (tmp_path / "r").exists()


# -- runs in this process ----------------------------------------------------------------

def test_on_eval_gets_exactly_metrics_jsonl_and_mlflow_holds_them(tmp_path, cache_dir,
                                                                   no_tracking_env):
    got = []
    result = asyncsgd.single(**_tiny(tmp_path, cache_dir, epochs=3, log_to=("mlflow",)),
                             on_eval=got.append)
    run_dir = Path(result.run_dir)
    assert got == _evals(run_dir) and len(got) >= 2
    _assert_mlflow_holds(run_dir, result.summary)


def test_a_callback_that_raises_stops_the_run_which_is_saved(tmp_path, cache_dir):
    def picky(record):
        if record["samples"] > 0:
            raise RuntimeError("enough")

    with pytest.raises(CallbackError, match=r"^callback test_a_callback_that_raises_stops_"
                                            r"the_run_which_is_saved.<locals>.picky raised "
                                            "RuntimeError: enough"):
        asyncsgd.single(**_tiny(tmp_path, cache_dir, epochs=50), on_eval=picky)
    run_dir = tmp_path / "runs" / "run"
    summary = read_json(run_dir / "summary.json")
    assert summary["status"] == "failed" and "picky raised RuntimeError" in summary["error"]
    assert summary["samples"] < 50 * 400 and (run_dir / "checkpoint.pt").exists()


# -- runs with processes -----------------------------------------------------------------

def _wandb_history(run_dir: Path) -> tuple:
    """(history rows, final summary, exit code) of the run's offline W&B files, read by
    W&B's own reader of its transaction log (wandb leet inspect --json)."""
    wandb = shutil.which("wandb", path=str(Path(__import__("sys").executable).parent))
    if wandb is None:
        pytest.skip("the loggers extra: pip install 'asyncsgd[loggers]'")
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run([wandb, "leet", "inspect", "--json", str(offline)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    (code,) = [r["exit"]["exit_code"] for r in records if r["type"] == "exit"]
    return rows, summary, code


@pytest.mark.processes
def test_hogwild_logs_to_both_and_calls_back_in_the_parent(tmp_path, cache_dir,
                                                           no_tracking_env):
    pytest.importorskip("wandb", reason="the loggers extra: pip install 'asyncsgd[loggers]'")
    got = []
    result = asyncsgd.hogwild(**_tiny(tmp_path, cache_dir, procs=2,
                                      log_to=("mlflow", "wandb")), callbacks=[got.append])
    run_dir = Path(result.run_dir)
    evals = _evals(run_dir)
    assert got == evals
    _assert_mlflow_holds(run_dir, result.summary)
    rows, summary, code = _wandb_history(run_dir)
    assert [{k: r[k] for k in ("samples", "t", "loss", "accuracy")} for r in rows] == \
        [{k: e[k] for k in ("samples", "t", "loss", "accuracy")} for e in evals]
    assert summary["final_metric"] == result.summary["final_metric"] and code == 0


@pytest.mark.processes
def test_ddp_calls_back_in_the_launching_parent(tmp_path, cache_dir):
    got = []
    result = asyncsgd.ddp(**_tiny(tmp_path, cache_dir, procs=2), on_eval=got.append)
    assert got == _evals(result.run_dir) and len(got) >= 2


def test_log_to_is_checked_and_saved_as_a_list(tmp_path):
    with pytest.raises(ConfigError, match=r"log_to='mlfow': 'mlfow' is not one of"):
        asyncsgd.single(log_to=("mlfow",))
    cfg = asyncsgd.SingleConfig(log_to="wandb")
    assert cfg.to_dict()["log_to"] == ["wandb"]


def test_compare_hands_log_to_to_every_run(tmp_path):
    from asyncsgd.comparison.mode_run import ModeRun
    from asyncsgd.config import CompareConfig
    from asyncsgd.config.modes import parse_modes

    cfg = CompareConfig(procs=2, log_to=("mlflow", "wandb"))
    for spec in parse_modes("single,hogwild,ddp,ps-async"):
        command = " ".join(map(str, ModeRun(cfg, spec, 0, tmp_path, {}, shown=None).command()))
        assert " --log-to mlflow --log-to wandb" in command, command
