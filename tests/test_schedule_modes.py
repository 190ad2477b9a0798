"""--lr-schedule and --warmup in the modes: the lr of every step is the rule's, exactly.

The oracle is tasks_for_tests:dense_rows (one weight per row, gradient 1 on each row of the
batch): a row trained at step k moves by exactly -lr(k), so the weights hold every step's lr.
"""

import collections

import torch

from asyncsgd.core.schedule import Schedule
from conftest import read_events, read_json

ROWS, BATCH = 100, 8
STEPS = -(-ROWS // BATCH)  # 13 steps an epoch, the last of 4 rows
COMMON = ("--task", "tasks_for_tests:dense_rows", "--samples", ROWS, "--lr", 1, "--threads", 1,
          "--progress", "off", "--eval-every", 0.05)


def _weights(run_dir) -> torch.Tensor:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]["weight"]


def _expected_one_epoch(rule) -> collections.Counter:
    """Each step's rows end at -lr(k) in float32: BATCH rows a step, the last step 4."""
    want = collections.Counter()
    for k in range(STEPS):
        rows = min(BATCH, ROWS - k * BATCH)
        want[torch.tensor(-rule(k), dtype=torch.float32).item()] += rows
    return want


def test_single_follows_the_schedule_and_resume_continues_it(tmp_path, run_cli_here):
    rule = Schedule(1.0, "cosine", steps=2 * STEPS, warmup=3)
    flags = (*COMMON, "--lr-schedule", "cosine", "--warmup", 3)
    once = tmp_path / "once"
    res = run_cli_here("single", *flags, "--epochs", 1, "--out", once)
    assert res.returncode == 0, res.stderr
    # --epochs 1: cosine's length is 13 steps, so this run decays to 0 over one epoch
    short = Schedule(1.0, "cosine", steps=STEPS, warmup=3)
    assert collections.Counter(_weights(once).tolist()) == _expected_one_epoch(short)
    evals = [e for e in read_events(once) if e["event"] == "eval"]
    assert evals[0]["lr"] == short(0) and evals[-1]["lr"] == short(STEPS - 1)
    for e in evals[1:]:  # the lr of the latest step, the samples telling which
        assert e["lr"] == short(-(-e["samples"] // BATCH) - 1) if e["samples"] else short(0)

    # Two epochs in one go, and one epoch then a --resume to two: the same weights, bit for
    # bit, since the resumed run takes up the schedule at step 13 (cosine:26: one length).
    whole, split = tmp_path / "whole", tmp_path / "split"
    fixed = (*COMMON, "--lr-schedule", f"cosine:{2 * STEPS}", "--warmup", 3)
    assert run_cli_here("single", *fixed, "--epochs", 2, "--out", whole).returncode == 0
    assert run_cli_here("single", *fixed, "--epochs", 1, "--out", split).returncode == 0
    res = run_cli_here("single", "--resume", split, "--epochs", 2, "--progress", "off")
    assert res.returncode == 0, res.stderr
    assert torch.equal(_weights(whole), _weights(split))
    assert not torch.equal(_weights(whole), _weights(once))
    assert read_json(split / "summary.json")["lr"] == 1.0  # the peak lr, as before schedules
    last = [e for e in read_events(split) if e["event"] == "eval"][-1]
    assert last["lr"] == rule(2 * STEPS - 1)


def test_cosine_without_a_length_is_refused_with_the_fix(run_cli_here):
    res = run_cli_here("compare", "--lr-schedule", "cosine", "--modes", "single",
                       "--budget", 1)
    assert res.returncode != 0
    assert "--lr-schedule cosine" in res.stderr and "cosine:5000" in res.stderr


def test_hogwild_follows_one_schedule_over_the_shared_count(tmp_path, run_cli):
    """One process: its steps are the shared count's, so each row holds its step's lr."""
    out = tmp_path / "hog"
    res = run_cli("hogwild", *COMMON, "--procs", 1, "--epochs", 1, "--lr-schedule",
                  "step:4:0.5", "--warmup", 2, "--out", out)
    assert res.returncode == 0, res.stderr
    rule = Schedule(1.0, "step", every=4, gamma=0.5, warmup=2)
    assert collections.Counter(_weights(out).tolist()) == _expected_one_epoch(rule)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["state"]["schedule_steps"] == STEPS
    assert [e for e in read_events(out) if e["event"] == "eval"][-1]["lr"] == rule(STEPS - 1)


def test_ps_shard_follows_the_schedule_by_its_updates_through_a_resume(server, cli_env):
    """dense_counter: every push's gradient is the batch size, 8, so update k takes exactly
    8 x lr(k) off the one weight. 10 updates, then a --resume of 10 more: the 20 are the
    schedule's updates 0..19, the resumed shard going on from its checkpoint's version."""
    from asyncsgd.run.checkpoint import load_checkpoint
    from conftest import Server, finish, worker
    task = ["--task", "tasks_for_tests:dense_counter", "--samples", 80]
    first = server(*task, "--lr", 0.25, "--lr-schedule", "cosine:20", "--warmup", 2)
    (code, _, err), = finish([worker(cli_env, first.address, 0, 1, *task, "--epochs", 1)])
    assert code == 0, err
    assert first.wait()[0] == 0
    resumed = Server(cli_env, first.out, "--resume", first.out)
    try:
        (code, _, err), = finish([worker(cli_env, resumed.address, 0, 1, *task, "--epochs", 1)])
        assert code == 0, err
        assert resumed.wait()[0] == 0
    finally:
        resumed.close()
    assert read_json(first.out / "summary.json")["updates"] == 20
    rule, w = Schedule(0.25, "cosine", steps=20, warmup=2), torch.zeros(1)
    for k in range(20):
        w.sub_(torch.tensor(8.0), alpha=rule(k))
    assert torch.equal(load_checkpoint(first.out / "checkpoint.pt")["model"]["w"], w)
    last = [e for e in read_events(first.out) if e["event"] == "eval"][-1]
    assert last["lr"] == rule(19)


def test_simulate_runs_the_schedule_in_its_modes(run_cli_here, tmp_path):
    """The virtual clock: single's lr is that of its latest update (samples / batch of
    them); the parameter server's real ShardState takes its lrs from the same rule."""
    out = tmp_path / "sim"
    res = run_cli_here("simulate", "--task", "tasks_for_tests:blob_dataset", "--samples", 200,
                       "--progress", "off", "--modes", "single,ps-async", "--workers", 2,
                       "--batch-size", 16, "--lr", 0.1, "--lr-schedule", "step:5:0.5",
                       "--warmup", 3, "--budget", 1, "--step-time", "10ms", "--eval-every",
                       0.05, "--out", out)
    assert res.returncode == 0, res.stderr
    rule = Schedule(0.1, "step", every=5, gamma=0.5, warmup=3)
    # the last evaluation's samples count a step in flight at the budget's end: left out
    single = [e for e in read_events(out / "single-r1") if e["event"] == "eval"][:-1]
    assert len(single) > 5
    assert all(e["lr"] == rule(max(0, e["samples"] // 16 - 1)) for e in single)
    ps = {e["lr"] for e in read_events(out / "ps-async-r1") if e["event"] == "eval"}
    assert len(ps) > 5 and ps <= {rule(k) for k in range(1000)}


def test_ddp_ranks_step_together_through_the_schedule(tmp_path, run_cli):
    """Two ranks of 50 rows, 7 steps each (the last of 2 rows a rank): a row trained at step
    k ends at -lr(k) / 2, the ranks' averaged gradient; the length is the 7 steps."""
    out = tmp_path / "ddp"
    res = run_cli("ddp", *COMMON, "--procs", 2, "--epochs", 1, "--lr-schedule", "linear",
                  "--warmup", 2, "--out", out)
    assert res.returncode == 0, res.stderr
    rule = Schedule(1.0, "linear", steps=7, warmup=2)
    want = collections.Counter()
    for k in range(7):
        want[torch.tensor(-rule(k) / 2, dtype=torch.float32).item()] += 16 if k < 6 else 4
    assert collections.Counter(_weights(out).tolist()) == want
