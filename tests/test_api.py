"""The Python API as a user calls it: the scripts of docs/python-api.md, every command's
function, the parameter server from Python, load_run, and the CLI calling exactly these
functions."""

import importlib.util
import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import asyncsgd
from asyncsgd import (CompareResult, ConfigError, DDPConfig, HogwildConfig, RunResult,
                      SingleConfig)
from conftest import free_port, one_line_error, read_events, read_json

ROOT = Path(__file__).parent.parent
SAMPLES = 500  # mnist1d: 400 training rows, 100 test rows
TRAIN = 400


def _tiny(tmp_path, cache_dir, name, **kw):
    """Settings of a run that takes seconds: one epoch of a small mnist1d MLP."""
    return {**dict(task="mnist1d-mlp", samples=SAMPLES, epochs=1, progress="off",
                   eval_every=0.5, threads=1, cache_dir=str(cache_dir),
                   out=str(tmp_path / name)), **kw}


def _readme_scripts():
    """The Python scripts of docs/python-api.md: its python blocks that call asyncsgd's API."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "python-api.md").read_text(),
                        re.S)
    return [b for b in blocks if re.search(r"asyncsgd\.(hogwild|single|ddp|compare|ps\.)", b)]


def test_every_readme_script_has_the_main_guard():
    """Without the guard, a script that starts processes fails with "An attempt has been
    made to start a new process before the current process has finished its bootstrapping
    phase": every block of the guide that calls the API must have it."""
    scripts = _readme_scripts()
    assert len(scripts) >= 2
    for script in scripts:
        assert 'if __name__ == "__main__":' in script, script


@pytest.mark.parametrize("index", [0, 1])
def test_readme_scripts_run(tmp_path, cli_env, index):
    """Each script of the guide, saved as a file and run as one, verbatim except for its budget:
    every ``epochs=N`` becomes ``epochs=1``, and the server's address 127.0.0.1:5555 one
    of the free ports here. What it prints is what the run directory holds."""
    script = _readme_scripts()[index]
    script = re.sub(r"\bepochs=\d+", "epochs=1", script)
    script = script.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{free_port()}")
    (tmp_path / "script.py").write_text(script)
    res = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=cli_env,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert "bootstrapping phase" not in res.stderr
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    summary = read_json(runs[0] / "summary.json")
    assert summary["status"] == "ok"
    if "asyncsgd.hogwild" in script:
        run = runs[0].relative_to(tmp_path)
        assert f"final accuracy {summary['final_metric']:.3f}, run in {run}" in res.stdout
        evals = [e for e in read_events(runs[0]) if e["event"] == "eval"]
        assert f"{len(evals)} evaluations, the last at {evals[-1]['t']:.1f} s" in res.stdout
        predicted = re.search(r"predicted (\[.*?\]) true (\[.*?\])", res.stdout)
        assert predicted and len(json.loads(predicted.group(1))) == 8, res.stdout
    else:
        assert summary["mode"] == "ps" and summary["workers_joined"] and summary["updates"] > 0
        assert (f"{summary['updates']} updates, final accuracy {summary['final_metric']:.3f}"
                in res.stdout)


@pytest.mark.processes
def test_hogwild_takes_a_config_keywords_or_both(tmp_path, cache_dir):
    """The dataclass, with keywords over it: config.json holds the merged settings."""
    cfg = HogwildConfig(**_tiny(tmp_path, cache_dir, "run", procs=2, epochs=3))
    result = asyncsgd.hogwild(cfg, epochs=2, lock=True)
    assert isinstance(result, RunResult)
    assert result.summary["samples"] == 2 * TRAIN  # 2 epochs: each row twice, 2 processes
    saved = read_json(Path(result.run_dir) / "config.json")
    assert saved["mode"] == "hogwild"
    assert saved["config"] == {**cfg.to_dict(), "epochs": 2, "lock": True}


@pytest.mark.processes
def test_single_and_ddp_run_from_python(tmp_path, cache_dir):
    one = asyncsgd.single(**_tiny(tmp_path, cache_dir, "single", batch_size=40))
    two = asyncsgd.ddp(DDPConfig(**_tiny(tmp_path, cache_dir, "ddp", batch_size=20, procs=2)))
    for result, mode in ((one, "single"), (two, "ddp")):
        assert isinstance(result, RunResult)
        assert result.summary["mode"] == mode and result.summary["stopped_by"] == "epochs"
        assert result.summary["samples"] == TRAIN
        assert read_json(Path(result.run_dir) / "config.json")["config"]["batch_size"] == \
            {"single": 40, "ddp": 20}[mode]


@pytest.mark.processes
def test_compare_runs_from_python(tmp_path, cache_dir):
    result = asyncsgd.compare(modes="single,hogwild", procs=2, budget=60, epochs=1,
                              samples=SAMPLES, task="mnist1d-mlp", eval_every=0.5,
                              cache_dir=str(cache_dir), out=str(tmp_path / "cmp"),
                              progress="off")
    assert isinstance(result, CompareResult)
    assert not result.failed, [a.error for a in result.failed]
    assert [a.label for a in result.attempts] == ["single", "hogwild"]
    assert (result.out / "report.md").is_file()
    for attempt in result.attempts:
        assert read_json(Path(attempt.run_dir) / "summary.json")["samples"] == TRAIN


@pytest.mark.processes
def test_ps_serve_in_a_thread_and_work_in_this_process(tmp_path, cache_dir):
    """A server thread and a worker in the main thread, as a notebook would run them:
    every push the worker made is one update the server applied; on_eval, called in the
    server's thread, gets exactly the evaluations of metrics.jsonl."""
    address = f"tcp://127.0.0.1:{free_port()}"
    served: list = []
    evals: list = []
    server = threading.Thread(target=lambda: served.append(asyncsgd.ps.serve(
        bind=address, workers=1, task="mnist1d-mlp", samples=SAMPLES, progress="off",
        eval_every=0.5, max_seconds=240, cache_dir=str(cache_dir),
        out=str(tmp_path / "ps"), on_eval=evals.append)), daemon=True)
    server.start()
    try:
        work = asyncsgd.ps.work(server=address, task="mnist1d-mlp", samples=SAMPLES, epochs=1,
                                batch_size=40, rank=0, world=1, threads=1, progress="off",
                                cache_dir=str(cache_dir))
    finally:
        server.join(timeout=240)
    assert not server.is_alive()
    assert isinstance(work, asyncsgd.ps.WorkerResult)
    assert (work.samples, work.steps, work.pushes) == (TRAIN, TRAIN // 40, TRAIN // 40)
    summary = served[0].summary
    assert summary["stopped_by"] == "workers_done"
    assert summary["workers_joined"] == [work.worker]
    assert summary["updates"] == work.pushes
    assert evals == [e for e in read_events(served[0].run_dir) if e["event"] == "eval"]
    assert len(evals) >= 2 and evals[0]["updates"] == 0


@pytest.mark.processes
def test_load_run_gives_settings_metrics_and_the_trained_model(tmp_path, cache_dir):
    cfg = HogwildConfig(**_tiny(tmp_path, cache_dir, "run", procs=2, epochs=2))
    result = asyncsgd.hogwild(cfg)
    run = asyncsgd.load_run(result.run_dir)
    assert run.mode == "hogwild" and run.config == cfg
    assert run.metrics == read_events(result.run_dir)
    assert json.loads(json.dumps(run.metrics)) == run.metrics  # plain records: DataFrame-ready
    if importlib.util.find_spec("pandas"):
        import pandas
        table = pandas.DataFrame(run.metrics)
        assert (table["event"] == "eval").sum() == sum(e["event"] == "eval" for e in run.metrics)
    assert run.summary == result.summary
    model = run.model()
    assert not model.training
    scores = run.task().evaluate(model)  # the final weights: the run's final evaluation
    assert math.isclose(scores["accuracy"], run.summary["final_metric"], abs_tol=1e-6)
    assert math.isclose(scores["loss"], run.summary["final_loss"], abs_tol=1e-5)


def test_bad_settings_are_one_clear_error(tmp_path):
    cases = [
        (lambda: asyncsgd.hogwild(procs=0), "procs=0: 0 is not in the range x>=1"),
        (lambda: asyncsgd.single(epoch=3), "unknown setting(s) epoch for SingleConfig"),
        (lambda: asyncsgd.hogwild(SingleConfig()), "expected a HogwildConfig, got a "
                                                    "SingleConfig"),
        (lambda: asyncsgd.ddp(start_method="fork"), "start_method='fork': 'fork' is not one"),
        (lambda: asyncsgd.ps.serve(device="cuda"), "the parameter server keeps the "
                                                    "parameters in CPU memory"),
        (lambda: asyncsgd.ps.work(slowdown="1:x"), "slowdown='1:x'"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError) as caught:
            call()
        assert message in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="not a run directory"):
        asyncsgd.load_run(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        asyncsgd.load_run(tmp_path / "nothing")


_TRACER = """
import atexit, importlib.util, sys
api = {importlib.util.find_spec(m).origin for m in ("asyncsgd.api", "asyncsgd.ps")}
called = []
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename in api and frame.f_back is not None \\
            and frame.f_back.f_code.co_filename.endswith("cli.py"):
        called.append(frame.f_code.co_name)
atexit.register(lambda: print("api calls:", *called))
sys.setprofile(profile)
from asyncsgd.cli import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("command, args, function, error", [
    ("hogwild", ["--resume", "RUN"], "hogwild", "is a ps run, not a hogwild run"),
    ("single", ["--resume", "RUN"], "single", "is a ps run, not a single run"),
    ("ddp", ["--resume", "RUN"], "ddp", "is a ps run, not a ddp run"),
    ("compare", ["--modes", "single,nosuch"], "compare", "nosuch"),
    ("ps-server", ["--device", "cuda"], "serve", "keeps the parameters in CPU memory"),
    ("worker", ["--rank", 3, "--world", 2], "work", "rank 3 is outside 0..1"),
    ("plot", ["RUN", "RUN"], "plot", "are the same directory"),
    ("ps-stats", ["--server", "tcp://127.0.0.1:9", "--timeout", 0.2], "stats", "no answer from"),
])
def test_the_cli_calls_the_api(tmp_path, cli_env, command, args, function, error):
    """Each command calls its API function (traced in the real CLI process, no mock) and
    reports what that function raised."""
    (tmp_path / "config.json").write_text(json.dumps({"mode": "ps", "config": {}}))
    args = [str(tmp_path) if a == "RUN" else str(a) for a in args]
    quiet = ["--progress", "off"] if command not in ("plot", "ps-stats") else []
    cmd = [sys.executable, "-c", _TRACER, command, *args, *quiet]
    res = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    one_line_error(res, error)
    assert res.stdout.split() == ["api", "calls:", function], res.stdout


def test_the_guides_ps_example_triggers_no_shard_warning(caplog, cache_dir, monkeypatch):
    """Friction 9: the guide's ``asyncsgd.ps.serve(...)`` arguments, as its script passes
    them, through the server's shard count for its task's model: no "--shards auto
    chooses" warning (the library's own advice against the example)."""
    import ast
    import logging

    from asyncsgd.config import ServerConfig, make_config
    from asyncsgd.core.tasks import task_of
    from asyncsgd.servers.sharding import shard_count

    monkeypatch.setenv("ASYNCSGD_CACHE", str(cache_dir))
    script = next(s for s in _readme_scripts() if "asyncsgd.ps.serve" in s)
    call = next(n for n in ast.walk(ast.parse(script)) if isinstance(n, ast.Call)
                and ast.unparse(n.func) == "asyncsgd.ps.serve")
    given = {k.arg: ast.literal_eval(k.value) for k in call.keywords
             if isinstance(k.value, ast.Constant)}
    cfg = make_config(ServerConfig, None, given)
    params = sum(p.numel() for p in task_of(cfg).build_model().parameters())
    with caplog.at_level(logging.WARNING):
        shard_count(cfg.shards, params, cfg.workers, 2)
    assert "--shards" not in caplog.text, caplog.text
