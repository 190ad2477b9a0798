"""``asyncsgd plot`` of run directories it did not see run: each run once, one task per
table, unlike settings warned about, a failed start counted as failed; and loss curves
that end where training ended, not in a drop made by the last, partial report.

Real run directories (``asyncsgd single`` of a small task, a parameter server that
failed at start on a port in use) are made once for the module, in parallel; the rest
are written with the project's own writers (RunDir, MetricsLog).
"""

import os
import socket
import subprocess

import pytest

from asyncsgd.analysis.plots import figure_data, figures, loss_curve
from asyncsgd.analysis.publish import report_runs, setting_warnings, task_groups, write_results
from asyncsgd.analysis.report import Attempt, Goal, mode_rows, parse_table
from asyncsgd.core.scoring import ACCURACY, PERPLEXITY
from asyncsgd.errors import ConfigError
from asyncsgd.run.metrics import MetricsLog, summarize, train_curve
from asyncsgd.run.reader import Run
from asyncsgd.run.rundir import RunDir
from conftest import TESTS, asyncsgd_cmd, read_events

SMALL = ["--task", "mnist1d-cnn", "--samples", "600", "--progress", "off"]
RUNS = {  # directory -> command
    "bs32": ["single", *SMALL, "--epochs", "1"],
    "bs64": ["single", *SMALL, "--epochs", "1", "--batch-size", "64", "--lr", "0.05"],
    "counter": ["single", "--task", "tasks_for_tests:dense_counter", "--epochs", "1",
                "--progress", "off"],
}
FAILED_START = ("failed at start: no summary.json, and its metrics.jsonl (1 event(s)) "
                "records no evaluation and no training; its error is not in the run "
                "directory (see the output of the command that ran it)")


@pytest.fixture(scope="module")
def env(cache_dir):
    return dict(os.environ, ASYNCSGD_CACHE=str(cache_dir),
                PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, env):
    """Three finished runs and a parameter server that failed at start (its port was
    taken: it wrote config.json and a start event, then stopped), side by side in one
    directory; all four commands run at once."""
    where = tmp_path_factory.mktemp("runs")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        commands = {**RUNS, "ps-port-taken": ["ps-server", *SMALL, "--bind",
                                              f"tcp://127.0.0.1:{port}"]}
        procs = {name: subprocess.Popen(asyncsgd_cmd(*cmd, "--out", where / name), env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, stdin=subprocess.DEVNULL)
                 for name, cmd in commands.items()}
        done = {name: (p.wait(180), p.communicate()) for name, p in procs.items()}
    for name in RUNS:
        assert done[name][0] == 0, done[name]
    code, (_, err) = done["ps-port-taken"]
    assert code != 0 and "Address already in use" in err, err
    return where


def _plot(env, cwd, *args):
    return subprocess.run(asyncsgd_cmd("plot", *args), env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def _one_line_error(res, *fragments):
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _accuracy(run_dir):
    return f"{[e for e in read_events(run_dir) if e['event'] == 'eval'][-1]['accuracy'] * 100:.2f}"


# -- the CLI on real run directories -------------------------------------------------------

def test_plot_warns_of_unlike_settings_and_counts_a_failed_start_as_failed(runs, env):
    res = _plot(env, runs, "bs32", "bs64", "ps-port-taken", "--out", "out")
    assert res.returncode == 0, res.stderr
    warnings = ["these runs differ in batch size per process: 32 (bs32) vs 64 (bs64); the "
                "table compares runs under different settings",
                "these runs differ in learning rate: 0.1 (bs32) vs 0.05 (bs64); the table "
                "compares runs under different settings"]
    assert res.stderr.splitlines() == [
        *(f"warning: {w}" for w in warnings),
        f"warning: ps-port-taken is not counted as a result (failed): {FAILED_START}"]
    assert len(read_events(runs / "ps-port-taken")) == 1  # what the message says it saw
    report = (runs / "out" / "report.md").read_text()
    for w in warnings:
        assert f"- **Warning**: {w}\n" in report
    assert f"- **ps-async**, repeat 1, failed: {FAILED_START}\n" in report
    assert "| ps-async | 1 | 0 | failed | `ps-port-taken` |" in report
    rows = {r["mode"]: r for r in parse_table(report)}
    # the legend and the table tell the runs apart by the settings that differ
    told = {"bs32": "single (batch-size 32, lr 0.1)", "bs64": "single (batch-size 64, lr 0.05)"}
    assert list(rows) == [*told.values(), "ps-async"]
    assert rows["ps-async"]["runs ok"] == "0/1" and rows["ps-async"]["final acc. %"] == "failed"
    for name, label in told.items():
        assert rows[label]["runs ok"] == "1/1"
        assert rows[label]["final acc. %"] == _accuracy(runs / name)
    assert parse_table(res.stdout) == list(rows.values())


def test_plot_refuses_runs_of_different_tasks_unless_allowed(runs, env):
    _one_line_error(_plot(env, runs, "bs32", "counter", "--out", "mixed"),
                    "these runs are of different tasks (task: mnist1d-cnn (bs32) vs "
                    "dense-counter (counter))", "--allow-mixed")
    assert not (runs / "mixed").exists()
    res = _plot(env, runs, "bs32", "counter", "--allow-mixed", "--out", "mixed")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [
        "warning: --allow-mixed: these runs are of 2 tasks (mnist1d-cnn, dense-counter): "
        "each row says its task, speed-ups are over single of the same task, and the "
        "verdict is per task; the plots draw them on the same axes"]
    rows = parse_table((runs / "mixed" / "report.md").read_text())
    assert [(r["mode"], r["task"], r["speed-up (samples/s)"]) for r in rows] == [
        ("single", "mnist1d-cnn", "1.00×"), ("single", "dense-counter", "1.00×")]
    assert rows[1]["final acc. %"] == _accuracy(runs / "counter")
    verdict = res.stdout.split("\n\n")[1]
    assert verdict.startswith("mnist1d-cnn: Best final accuracy: single (")
    assert " dense-counter: Best final accuracy: single (100.00%)" in verdict


def test_plot_refuses_one_directory_given_twice_by_any_path(runs, env):
    (runs / "link").symlink_to(runs / "bs32")
    real = (runs / "bs32").resolve()
    _one_line_error(_plot(env, runs, "bs32", "./bs32", "--out", "twice"),
                    f"bs32 and ./bs32 are the same directory ({real}): give each run once")
    _one_line_error(_plot(env, runs, "bs32", "bs64", "link", "--out", "twice"),
                    f"bs32 and link are the same directory ({real})")
    assert not (runs / "twice").exists()


def test_the_plotted_score_curve_is_each_evaluation_of_the_run(runs):
    """The accuracy figure draws the run's evaluations, in percent, against their time."""
    run = Run.read(runs / "bs32")
    evals = [e for e in read_events(runs / "bs32") if e["event"] == "eval"]
    data = figure_data([("single", [run])], Goal(ACCURACY))
    assert data["accuracy_vs_time.png"] == [
        ("single", 0, [e["t"] for e in evals], [e["accuracy"] * 100 for e in evals])]


# -- loss curves ---------------------------------------------------------------------------

def _run_dir(path, task=None, events=(), summary=True, mode="single", **config):
    """A run directory written with the project's writers: config.json (``config`` as its
    settings, ``task`` as its task record, ``mode`` its mode), ``events`` as (event, t,
    samples, fields) and summary.json from them."""
    run = RunDir.create(str(path), mode)
    run.write_config(mode, {"seed": 0, **config},
                     task or {"name": "synthetic", "train_samples": 100, "test_samples": 10,
                              "metric": ACCURACY.describe()}, argv=[])
    metrics = MetricsLog(run)
    metrics.write("start", 0.0, 0)
    for event, t, samples, fields in events:
        metrics.write(event, t, samples, **fields)
    metrics.close()
    if summary:
        run.write_summary(summarize(list(run.events()), mode=mode, task="synthetic",
                                    target=None, stopped_by="epochs"))
    return Run.read(path)


def _train(t, samples, worker, loss, steps):
    return "train", t, samples, {"worker": worker, "loss": loss, "steps": steps, "epoch": 0}


def _eval(t, samples, accuracy):
    return "eval", t, samples, {"loss": 1.0, "accuracy": accuracy}


# A parameter server's reports: every worker once a second, then the forced last report of
# the one or two steps since, 5 ms later (as ps-sync, ps-ssp, ps-backup runs ended).
PS_EVENTS = [
    _train(1.0, 800, "w0", 2.0, 100), _train(1.0, 800, "w1", 1.0, 100),
    _eval(1.0, 800, 0.5),
    _train(2.0, 1600, "w0", 1.0, 60), _train(2.0, 1600, "w1", 0.5, 40),
    _train(2.005, 1616, "w0", 0.25, 1), _train(2.005, 1616, "w1", 0.125, 1),
    _eval(2.01, 1616, 0.75),
]


def test_the_loss_curve_ends_where_training_ended_without_a_drop(tmp_path):
    """The last report (2 steps, 5 ms after a 100-step one) is folded into the point before:
    (1.0 * 60 + 0.5 * 40 + 0.25 + 0.125) / 102 at its time and samples, not 0.1875 there."""
    run = _run_dir(tmp_path / "ps", events=PS_EVENTS)
    assert train_curve(run.events)[-2:] == [(2.0, 1600, 0.8), (2.005, 1616, 0.1875)]  # the drop
    end = 80.375 / 102
    data = figure_data([("ps-sync", [run])], Goal(ACCURACY))
    assert data["loss_vs_time.png"] == [("ps-sync", 0, [1.0, 2.005], [1.5, end])]
    assert data["loss_vs_samples.png"] == [("ps-sync", 0, [800, 1616], [1.5, end])]
    assert data["accuracy_vs_time.png"] == [("ps-sync", 0, [1.0, 2.01], [50.0, 75.0])]


def test_only_reports_under_half_the_median_steps_are_folded_and_the_first_stands():
    events = [{"event": "train", "t": t, "samples": s, "loss": loss, "steps": steps}
              for t, s, loss, steps in [(0.1, 8, 4.0, 1),      # the start: stands alone
                                        (1.0, 80, 2.0, 9),     # median 9: kept
                                        (1.5, 90, 1.0, 2),     # 2 < 4.5: folded into 1.0
                                        (2.0, 170, 1.5, 10), (3.0, 250, 0.5, 10),
                                        (3.0, 250, 0.25, 10)]]  # one report, two workers
    assert loss_curve(events) == [(0.1, 8, 4.0), (1.5, 90, 20.0 / 11), (2.0, 170, 1.5),
                                  (3.0, 250, 0.375)]
    assert loss_curve([]) == []


# -- what a run's own files say, tasks and settings -----------------------------------------

def test_a_runs_status_is_what_its_files_say(tmp_path):
    trained = [_eval(0.0, 0, 0.1), _train(1.0, 80, 0, 2.0, 10), _eval(1.0, 80, 0.5)]
    assert _run_dir(tmp_path / "ok", events=trained).outcome() == ("ok", None)
    killed = _run_dir(tmp_path / "killed", events=trained, summary=False)
    assert killed.outcome() == ("ok", None) and not killed.recorded_summary
    evaluated_only = _run_dir(tmp_path / "eval", events=trained[:1], summary=False)
    assert evaluated_only.outcome() == ("failed", FAILED_START.replace(
        "(1 event(s)) records no evaluation and no training", "(2 event(s)) records no training"))
    failed = RunDir(tmp_path / "ok")
    failed.write_summary({**failed.read_summary(), "status": "failed",
                          "error": "worker 1 exited with code 1"})
    assert Run.read(tmp_path / "ok").outcome() == ("failed", "worker 1 exited with code 1")
    failed.write_summary({**failed.read_summary(), "status": "interrupted", "error": None,
                          "stopped_by": "interrupted"})
    # stopped by Ctrl-C after it trained: reported for what it saved (with a warning)
    assert Run.read(tmp_path / "ok").outcome() == ("ok", None)
    result = report_runs([tmp_path / "ok"], tmp_path / "out", None)
    assert result.warnings == [f"{tmp_path / 'ok'} was stopped by Ctrl-C or SIGTERM before "
                               "its budget was spent: it is reported for what it recorded"]
    RunDir(tmp_path / "eval").write_summary({"status": "interrupted", "error": None,
                                             "stopped_by": "interrupted"})
    assert Run.read(tmp_path / "eval").outcome() == (
        "interrupted", "summary.json says interrupted (stopped by interrupted)")


def test_a_killed_run_is_reported_with_a_warning(tmp_path):
    trained = [_eval(0.0, 0, 0.1), _train(1.0, 80, 0, 2.0, 10), _eval(1.0, 80, 0.5)]
    _run_dir(tmp_path / "killed", events=trained, summary=False)
    result = report_runs([tmp_path / "killed"], tmp_path / "out", None)
    assert result.warnings == [f"{tmp_path / 'killed'} has no summary.json (killed before it "
                               "finished?): it is reported from what its metrics.jsonl recorded"]
    assert result.failed == []
    assert parse_table(result.text)[0]["runs ok"] == "1/1"


def test_runs_of_one_task_name_with_other_sample_counts_are_other_tasks(tmp_path):
    def attempt(name, train):
        task = {"name": "mnist1d-cnn", "train_samples": train, "test_samples": 1000}
        return Attempt("single", run=_run_dir(tmp_path / name, task), run_dir=name)

    attempts = [attempt("a", 4000), attempt("b", 40000), attempt("c", 4000)]
    with pytest.raises(ConfigError) as err:
        task_groups(attempts, allow_mixed=False)
    assert str(err.value).startswith("these runs are of different tasks (training samples: "
                                     "4000 (a, c) vs 40000 (b)): ")
    groups = task_groups(attempts, allow_mixed=True)
    assert [(name, [a.run_dir for a in group]) for name, group in groups] == [
        ("mnist1d-cnn (4000 train / 1000 test)", ["a", "c"]),
        ("mnist1d-cnn (40000 train / 1000 test)", ["b"])]


def test_settings_are_compared_where_the_runs_record_them(tmp_path):
    """A setting left to the task's default (None) counts as what summary.json says the run
    used; one a run does not record at all is not compared."""
    a = _run_dir(tmp_path / "a", batch_size=None, lr=None, max_seconds=30.0)
    _run_dir(tmp_path / "b", batch_size=32, lr=0.1, max_seconds=60.0)
    c = _run_dir(tmp_path / "c", batch_size=None, max_seconds=30.0)
    for run, used in ((a, {"batch_size": 32, "lr": 0.1}), (c, {"batch_size": 64})):
        RunDir(run.path).write_summary({**run.summary, **used})
    attempts = [Attempt("single", run=Run.read(p), run_dir=p.name) for p in
                (tmp_path / "a", tmp_path / "b", tmp_path / "c")]
    assert setting_warnings(attempts, "mnist1d-cnn") == [
        "runs of mnist1d-cnn differ in batch size per process: 32 (a, b) vs 64 (c); the "
        "table compares runs under different settings",
        "runs of mnist1d-cnn differ in time budget (--max-seconds): 30.0 (a, c) vs 60.0 (b); "
        "the table compares runs under different settings"]


def test_a_run_given_on_its_own_and_in_its_compare_directory_is_refused(tmp_path):
    cmp = tmp_path / "cmp"
    run = _run_dir(cmp / "single-r1", events=[_eval(1.0, 80, 0.5)])
    attempts = [Attempt("single", run=run, run_dir=str(cmp / "single-r1"))]
    write_results(cmp / "results.json", {}, mode_rows(attempts, Goal(ACCURACY)), Goal(ACCURACY))
    assert parse_table(report_runs([cmp], tmp_path / "out", None).text)[0]["mode"] == "single"
    with pytest.raises(ConfigError, match=(
            f"the run {(cmp / 'single-r1').resolve()} is given twice "
            f"\\({cmp} and {cmp / 'single-r1'}\\): give each run once")):
        report_runs([cmp, cmp / "single-r1"], tmp_path / "out2", None)


# -- where the plots go, their axes, titles and legends -------------------------------------

TRAINED = [_eval(0.0, 0, 0.1), _train(1.0, 80, 0, 2.0, 10), _eval(1.0, 80, 0.5)]


def test_an_out_that_cannot_be_written_is_one_line_and_bad_usage(tmp_path, run_cli_here):
    """As root, chmod stops no write: a path under a regular file cannot be made."""
    _run_dir(tmp_path / "run", events=TRAINED)
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "plots"
    with pytest.raises(ConfigError, match=f"^cannot write the plots to {out}: "
                       f"{tmp_path / 'file'} is not a directory; choose a writable place "
                       "with --out DIR$"):
        report_runs([tmp_path / "run"], out, None)
    res = run_cli_here("plot", tmp_path / "run", "--out", out)
    assert res.returncode == 2, res
    assert res.stderr.splitlines() == [f"error: cannot write the plots to {out}: "
                                       f"{tmp_path / 'file'} is not a directory; choose a "
                                       "writable place with --out DIR"]
    for command in (("compare", "--modes", "single", "--budget", "1"), ("simulate",),
                    ("single", "--epochs", "1")):
        res = run_cli_here(*command, "--out", tmp_path / "file" / command[0])
        assert res.returncode == 2, (command, res)
        assert res.stderr.splitlines() == [
            f"error: cannot write the run directory {tmp_path / 'file' / command[0]}: Not a "
            "directory; choose a writable place with --out DIR"], (command, res.stderr)


def _perplexity(t, samples, value):
    return "eval", t, samples, {"loss": 1.0, "perplexity": value}


LM = {"name": "lm", "train_samples": 100, "test_samples": 10,
      "metric": PERPLEXITY.describe()}


def test_perplexity_is_drawn_on_a_log_axis_and_accuracy_on_a_linear_one(tmp_path):
    lm = _run_dir(tmp_path / "lm", LM, [_perplexity(0.0, 0, 300.0), _perplexity(1.0, 80, 4.0),
                                        _perplexity(2.0, 160, 2.0)])
    drawn = {name: fig for name, _, fig in figures([("single", [lm])], Goal(PERPLEXITY, 2.0))}
    assert drawn["perplexity_vs_time.png"].axes[0].get_yscale() == "log"
    assert drawn["loss_vs_time.png"].axes[0].get_yscale() == "linear"
    acc = _run_dir(tmp_path / "acc", events=TRAINED)
    drawn = {name: fig for name, _, fig in figures([("single", [acc])], Goal(ACCURACY))}
    assert drawn["accuracy_vs_time.png"].axes[0].get_yscale() == "linear"


def test_the_time_axis_says_start_up_is_on_it(tmp_path):
    run = _run_dir(tmp_path / "run", events=TRAINED)
    drawn = {name: fig for name, _, fig in figures([("single", [run])], Goal(ACCURACY))}
    for name in ("accuracy_vs_time.png", "loss_vs_time.png"):
        assert drawn[name].axes[0].get_xlabel() == "seconds since the command started"
    virtual = {name: fig for name, _, fig in
               figures([("single", [run])], Goal(ACCURACY, clock="virtual"))}
    assert virtual["loss_vs_time.png"].axes[0].get_xlabel() == "virtual seconds"


def test_plot_names_the_task_the_processes_and_the_settings_that_differ(tmp_path):
    """Runs of one mode with 8 and 2 processes: the legend says procs (not the
    directories' time stamps), the title the task and both counts, a warning the
    difference; runs whose settings are all alike keep their directories' names."""
    for name, procs in (("20261122-101500-hogwild", 8), ("20261122-103000-hogwild", 2)):
        _run_dir(tmp_path / name, events=TRAINED, mode="hogwild", procs=procs)
    result = report_runs([tmp_path / "20261122-101500-hogwild",
                          tmp_path / "20261122-103000-hogwild"], tmp_path / "out", None)
    assert [r["mode"] for r in parse_table(result.text)] == ["hogwild (procs 8)",
                                                             "hogwild (procs 2)"]
    assert result.warnings[-1:] == [  # after the oversubscription a host of < 8 cores has
        f"these runs differ in training processes (workers or ranks): 8 ("
        f"{tmp_path / '20261122-101500-hogwild'}) vs 2 ({tmp_path / '20261122-103000-hogwild'})"
        "; the table compares runs under different settings"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert report.startswith("# asyncsgd plot: synthetic, 2 and 8 processes\n")
    for name in ("a", "b"):
        _run_dir(tmp_path / name, events=TRAINED, mode="hogwild", procs=4)
    result = report_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "out2", None)
    assert [r["mode"] for r in parse_table(result.text)] == ["hogwild (a)", "hogwild (b)"]
    assert not [w for w in result.warnings if "differ" in w]
    assert (tmp_path / "out2" / "report.md").read_text().startswith(
        "# asyncsgd plot: synthetic, 4 processes\n")


def test_runs_that_moved_tensors_through_shared_memory_say_so_on_the_traffic_plot(tmp_path):
    """A same-host parameter server's wire count leaves out what its areas moved: its
    legend names those megabytes; a run without any keeps its plain label."""
    def evals(shared):
        return [("eval", t, 80 * t, {"loss": 1.0, "accuracy": 0.5, "bytes": 1_000_000 * t,
                                     **({"shared_bytes": shared * t} if shared else {})})
                for t in (1, 2)]

    ps = _run_dir(tmp_path / "ps", events=evals(17_500_000), mode="ps", workers=2)
    ddp = _run_dir(tmp_path / "ddp", events=evals(0), mode="ddp", procs=2)
    drawn = {name: fig for name, _, fig in
             figures([("ps-async", [ps]), ("ddp", [ddp])], Goal(ACCURACY))}
    legend = drawn["accuracy_vs_bytes.png"].axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [
        "ps-async (shared memory: 35.0 MB not on the wire)", "ddp"]
    assert ps.summary["shared_bytes"] == 35_000_000 and "shared_bytes" not in ddp.summary
