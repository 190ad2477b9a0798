"""Hogwild with real spawned processes: it learns, splits data exactly, locks, resumes."""

import torch

from asyncsgd import HogwildConfig
from asyncsgd.modes.hogwild import train
from asyncsgd.run.checkpoint import load_checkpoint
from conftest import read_events, read_json


def _cfg(tmp_path, **kw):
    base = dict(progress="off", checkpoint_every=0, eval_every=0.5, out=str(tmp_path / "run"),
                start_method="forkserver")
    base.update(kw)
    return HogwildConfig(**base)


def test_mnist1d_cnn_learns_with_spawn(tmp_path, cache_dir):
    result = train(_cfg(tmp_path, task="mnist1d-cnn", procs=2, epochs=15, start_method="spawn",
                        cache_dir=str(cache_dir)))
    s = result.summary
    assert s["status"] == "ok" and s["stopped_by"] == "epochs"
    assert s["final_accuracy"] >= 0.6, s  # chance is 0.1
    assert s["samples"] == 15 * 4000
    events = read_events(result.run_dir)
    losses = [e["loss"] for e in events if e["event"] == "train"]
    assert losses[-1] < losses[0]
    workers = {e["worker"] for e in events if e["event"] == "train"}
    assert workers == {0, 1}
    evals = [e for e in events if e["event"] == "eval"]
    assert evals[0]["samples"] == 0 and evals[0]["loss"] > 2.0  # before any update: ~ln(10)
    assert evals[-1]["loss"] < 0.6 * evals[0]["loss"]  # Hogwild varies run to run: relative
    assert evals[0]["accuracy"] < 0.3 < evals[-1]["accuracy"]
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    config = read_json(tmp_path / "run" / "config.json")
    assert config["mode"] == "hogwild" and config["config"]["procs"] == 2
    assert {"torch", "python", "asyncsgd"} <= set(config["versions"])


def test_sparse_logreg_learns_far_above_chance(tmp_path):
    result = train(_cfg(tmp_path, task="sparse-logreg", procs=2, epochs=3, samples=20000))
    s = result.summary
    majority = 0.56  # the larger class's share of the generated labels
    assert s["final_accuracy"] >= majority + 0.15, s
    assert s["samples"] == 3 * 16000


def test_partitions_are_disjoint_and_cover_the_data(tmp_path):
    """Every row's weight drops by exactly 1 per epoch: each row trained on exactly once."""
    from tasks_for_tests import index_counter
    task = index_counter(samples=1003)
    train(_cfg(tmp_path, task="tasks_for_tests:index_counter", samples=1003, procs=3, epochs=2),
          task=task)
    weights = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"]["weight.weight"]
    assert torch.equal(weights, torch.full((1003, 1), -2.0))


def test_token_ring_with_uneven_workers_finishes_exactly(tmp_path):
    """5 processes share 2 cores through the ring; early finishers must not stall the rest."""
    from tasks_for_tests import index_counter
    task = index_counter(samples=997)
    result = train(_cfg(tmp_path, procs=5, epochs=3, samples=997, share_cores="ring",
                        quantum_ms=5, task="tasks_for_tests:index_counter"), task=task)
    assert result.summary["token_ring"] is True
    weights = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"]["weight.weight"]
    assert torch.equal(weights, torch.full((997, 1), -3.0))
    steps = {}
    for e in read_events(result.run_dir):
        if e["event"] == "train":
            steps[e["worker"]] = steps.get(e["worker"], 0) + e["steps"]
    assert set(steps) == set(range(5))


def test_locked_updates_lose_nothing(tmp_path):
    """4 processes update one dense scalar under the lock: no read-modify-write is lost."""
    from tasks_for_tests import dense_counter
    task = dense_counter(samples=2000)
    result = train(_cfg(tmp_path, procs=4, epochs=3, lock=True, samples=2000,
                        task="tasks_for_tests:dense_counter"), task=task)
    assert result.summary["lock"] is True
    w = load_checkpoint(tmp_path / "run" / "checkpoint.pt")["model"]["w"]
    assert w.item() == -3 * 2000


def test_resume_continues_from_the_checkpoint(tmp_path, run_cli):
    out = tmp_path / "run"
    first = run_cli("hogwild", "--task", "mnist1d-cnn", "--procs", "2", "--epochs", "2",
                    "--out", out, "--progress", "off", "--start-method", "forkserver")
    assert first.returncode == 0, first.stderr
    before = read_json(out / "summary.json")
    assert before["samples"] == 2 * 4000
    second = run_cli("hogwild", "--resume", out, "--epochs", "5", "--progress", "off")
    assert second.returncode == 0, second.stderr
    after = read_json(out / "summary.json")
    assert after["samples"] == 5 * 4000  # 3 more epochs, not 5
    events = read_events(out)
    resume_at = next(i for i, e in enumerate(events) if e["event"] == "resume")
    first_eval_after = next(e for e in events[resume_at:] if e["event"] == "eval")
    # Same weights, same deterministic evaluation: the resumed run starts where the first ended.
    assert first_eval_after["accuracy"] == before["final_accuracy"]
    assert first_eval_after["t"] >= before["train_seconds"]
    assert load_checkpoint(out / "checkpoint.pt")["epochs_done"] == 5
    assert after["final_accuracy"] >= before["final_accuracy"] - 0.05

    wrong = run_cli("hogwild", "--resume", out, "--task", "mnist1d-mlp")
    assert wrong.returncode != 0
    assert "keeps its task" in wrong.stderr and "Traceback" not in wrong.stderr


def test_target_accuracy_and_max_seconds_stop_the_run(tmp_path):
    hit = train(_cfg(tmp_path, procs=2, epochs=1000, target_accuracy=0.5, eval_every=0.2))
    s = hit.summary
    assert s["stopped_by"] == "target_accuracy" and s["status"] == "ok"
    assert s["best_accuracy"] >= 0.5 and s["time_to_target"] is not None  # final may dip after
    assert s["samples"] < 1000 * 4000
    evals = [e for e in read_events(hit.run_dir) if e["event"] == "eval"]
    assert s["time_to_target"] == next(e["t"] for e in evals if e["accuracy"] >= 0.5)

    capped = train(_cfg(tmp_path, procs=2, epochs=1000, max_seconds=3, out=str(tmp_path / "b")))
    c = capped.summary
    assert c["stopped_by"] == "max_seconds"
    assert 3 <= c["train_seconds"] < 3 + 15  # stop, join and final evaluation are bounded
    assert c["time_to_target"] is None and c["target_accuracy"] is None
