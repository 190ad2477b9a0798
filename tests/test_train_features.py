"""--amp bf16, --clip-grad-norm and --accumulate in Hogwild's processes and PS workers."""

from __future__ import annotations

import torch

from conftest import finish, read_json, worker

CNN = ("--task", "mnist1d-cnn", "--target", 0.9, "--epochs", 200, "--max-seconds", 60,
       "--progress", "off", "--eval-every", 0.5)


def test_hogwild_bf16_with_clipping_trains_to_the_target(tmp_path, run_cli):
    """2 processes reached 90% in ~3.5 s, bf16 or not (an AMD EPYC with AVX512-BF16)."""
    out = tmp_path / "run"
    res = run_cli("hogwild", *CNN, "--procs", 2, "--threads", 1, "--amp", "bf16",
                  "--clip-grad-norm", 1.0, "--out", out, timeout=120)
    assert res.returncode == 0, res.stderr
    summary = read_json(out / "summary.json")
    assert summary["stopped_by"] == "target" and summary["amp"] == "bf16"
    clipping = summary["clipping"]
    assert clipping["max_norm"] == 1.0 and 0 < clipping["clipped_steps"] <= clipping["steps"]


def test_ps_workers_bf16_accumulating_train_to_the_target(server, cli_env):
    """2 workers, bf16, 2 micro-batches a push, clipped: 90% in ~9 s of the server's."""
    srv = server(*CNN, "--workers", 2)
    results = finish([worker(cli_env, srv.address, r, 2, "--task", "mnist1d-cnn", "--epochs",
                             200, "--amp", "bf16", "--accumulate", 2, "--clip-grad-norm", 5)
                      for r in range(2)])
    for code, out, err in results:
        assert code == 0, err
        steps, samples = out.split(" steps")[0].split()[-1], out.split(" samples")[0].split()[-1]
        assert int(samples.replace(",", "")) > 60 * int(steps)  # 64 rows a step, 2 x 32
        assert "--clip-grad-norm 5 clipped " in out and f" of {steps} steps' gradients" in out
    code, _, err = srv.wait()
    assert code == 0, err
    assert read_json(srv.out / "summary.json")["stopped_by"] == "target"


def test_hogwild_and_ps_workers_compute_under_bf16_autocast(tmp_path, run_cli, server,
                                                           cli_env):
    """The probe model raises unless its training forward runs under bf16 autocast."""
    probe = ("--task", "tasks_for_tests:autocast_probe", "--epochs", 1)
    res = run_cli("hogwild", *probe, "--procs", 2, "--threads", 1, "--amp", "bf16",
                  "--progress", "off", "--out", tmp_path / "hogwild")
    assert res.returncode == 0, res.stderr
    srv = server(*probe[:2], "--workers", 1)
    [(code, _, err)] = finish([worker(cli_env, srv.address, 0, 1, *probe, "--amp", "bf16")])
    assert code == 0, err
    assert srv.wait()[0] == 0
    res = run_cli("hogwild", *probe, "--procs", 1, "--threads", 1, "--progress", "off",
                  "--out", tmp_path / "off")
    assert res.returncode == 1 and "not running under bf16 autocast" in res.stderr


def test_ddp_accumulates_under_no_sync_exactly(tmp_path, run_cli):
    """dense_rows (a summed loss: each row's weight gets gradient 1 a training), lr 1, 2
    ranks, steps of 2 micro-batches of 5 rows: each micro-batch weighs 1/2 and the ranks
    average, so every training moves a row's weight by exactly -1/4. A micro-batch lost,
    or one rank's left out of the all-reduce, would break the equality."""
    out = tmp_path / "run"
    res = run_cli("ddp", "--task", "tasks_for_tests:dense_rows", "--procs", 2, "--threads", 1,
                  "--epochs", 2, "--batch-size", 5, "--accumulate", 2, "--lr", 1,
                  "--progress", "off", "--dist-timeout", 60, "--out", out, timeout=120)
    assert res.returncode == 0, res.stderr
    summary = read_json(out / "summary.json")
    assert summary["samples"] == 2000 and summary["steps"] == 100  # 500 rows a rank, 10 a step
    weights = torch.load(out / "checkpoint.pt", weights_only=True)["model"]["weight"]
    assert torch.equal(weights, torch.full_like(weights, -2 / 4))
