"""The parameter server with real processes and sockets on 127.0.0.1."""

import json
import os
import signal
import subprocess
import time

import msgpack
import pytest
import torch

from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.servers.sharding import auto_shards, saved_shards, shard_count
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import (ERROR, HELLO, PUSH, STATS, VERSION, WELCOME, Message, Segment,
                                    encode)
from conftest import (Server, asyncsgd_cmd, finish, free_port, read_events, read_json, wait_for,
                      worker)


@pytest.mark.parametrize("consistency", ["async", "sync"])
def test_exact_oracle_two_shards_three_workers(server, cli_env, consistency):
    """Integer gradients, SGD lr 1: final = initial - sum of every acknowledged push."""
    rows, epochs = 999, 2
    srv = server("--task", "tasks_for_tests:index_counter", "--samples", rows, "--shards", 2,
                 "--workers", 3, "--consistency", consistency, "--sync-reduce", "sum")
    procs = [worker(cli_env, srv.address, r, 3, "--task", "tasks_for_tests:index_counter",
                    "--samples", rows, "--epochs", epochs) for r in range(3)]
    results = finish(procs)
    for code, out, err in results:
        assert code == 0, err
    code, out, err = srv.wait()
    assert code == 0, err
    assert "--shards 2 for a model of 0.004 MB" in err and "--shards auto chooses 1" in err, \
        "a second shard for a tiny model is named as the slower choice"
    summary = read_json(srv.out / "summary.json")
    assert summary["stopped_by"] == "workers_done"
    # Every row was trained on exactly `epochs` times, by exactly one worker.
    weight = load_checkpoint(srv.out / "checkpoint.pt")["model"]["weight.weight"]
    assert torch.equal(weight, torch.full((rows, 1), -float(epochs)))
    pushes = sum(int(out.split(" pushes")[0].split()[-1]) for _, out, _ in results)
    assert pushes == 3 * epochs * 42  # 333 rows per worker, batch 8: 42 steps an epoch
    per_shard = pushes if consistency == "async" else pushes // 3  # sync: one update a round
    assert summary["updates"] == 2 * per_shard


def test_sync_applies_the_mean_of_a_round_by_default(server, cli_env):
    """dense_counter, SGD lr 1, two workers of 125 pushes: each push's gradient is the batch
    size, 8. A round's mean is 8 (its sum would be 16), so the weight ends at -125 x 8."""
    task = ["--task", "tasks_for_tests:dense_counter", "--samples", 2000]
    srv = server(*task, "--workers", 2, "--consistency", "sync")
    for code, out, err in finish([worker(cli_env, srv.address, r, 2, *task, "--epochs", 1)
                                  for r in range(2)]):
        assert code == 0 and "125 steps, 125 pushes" in out, err
    code, _, err = srv.wait()
    assert code == 0, err
    assert read_json(srv.out / "summary.json")["updates"] == 125
    assert load_checkpoint(srv.out / "checkpoint.pt")["model"]["w"].item() == -125 * 8


def test_ctrl_c_saves_the_run_as_the_shards_hold_it(server, cli_env):
    """Ctrl-C long after the server's last evaluation: its summary and checkpoint.pt are
    what the shards hold when it stops (main: those of the evaluation at its start,
    samples 0 and w = 0, and summary.json without updates or staleness)."""
    task = ["--task", "tasks_for_tests:dense_counter", "--samples", 2000]
    srv = server(*task, "--workers", 2, "--no-exit-when-done", "--eval-every", 1000)
    for code, out, err in finish([worker(cli_env, srv.address, r, 2, *task, "--epochs", 1)
                                  for r in range(2)]):
        assert code == 0 and "125 pushes" in out, err
    srv.proc.send_signal(signal.SIGINT)
    code, _, err = srv.wait()
    assert code == 130, err
    summary = read_json(srv.out / "summary.json")
    assert (summary["status"], summary["stopped_by"]) == ("interrupted", "interrupted")
    assert (summary["samples"], summary["updates"]) == (2000, 250), summary
    assert len(summary["workers_joined"]) == 2 and summary["shards"] == 1
    assert load_checkpoint(srv.out / "checkpoint.pt")["model"]["w"].item() == -2000


def test_malformed_input_is_refused_and_the_server_keeps_serving(server, cli_env):
    srv = server("--task", "mnist1d-cnn", "--shards", 1)
    from asyncsgd.core.tasks import load_task
    signature = Layout.of(load_task("mnist1d-cnn").build_model(0)).signature()
    welcome = srv.request(encode(Message(type=HELLO, worker="probe", seq=1,
                                         meta={"signature": signature})))
    assert welcome.type == WELCOME
    shard = welcome.meta["shards"][0]["port"]

    def header(**fields):
        base = {"v": VERSION, "t": PUSH, "w": "bad", "i": 1, "s": 1, "c": 0, "sh": 0, "m": {},
                "d": []}
        base.update(fields)
        return msgpack.packb(base)

    token = welcome.meta["token"]  # admitted: the shard checks what it holds, not who sent it
    nan = encode(Message(type=PUSH, worker="probe", incarnation=0, seq=9, shard=0, token=token,
                         segments=[Segment(0, torch.full((10,), float("nan")))]))
    inf = encode(Message(type=PUSH, worker="probe", incarnation=0, seq=10, shard=0, token=token,
                         segments=[Segment(0, torch.full((10,), float("inf")))]))
    cases = [
        ([header()[:-4]], "bad-header"),
        ([b"\x81" + b"\xff" * (70 * 1024)], "header-too-large"),
        ([header(v=99)], "bad-version"),
        ([header(t="reboot")], "bad-type"),
        ([header(d=[[0, "float32", [4]]]), b"\x00" * 10], "length-mismatch"),
        ([header(d=[[0, "complex64", [1]]]), b"\x00" * 8], "bad-dtype"),
        (nan, "non-finite"),
        (inf, "non-finite"),
    ]
    for frames, code in cases:
        for port in (shard, None):
            reply = srv.request([bytes(f) for f in frames], port=port)
            assert reply.type == ERROR, (code, reply)
            expected = code if port or code not in ("non-finite",) else "bad-type"
            assert reply.meta["code"] == expected, (code, port, reply.meta)
    def shard_updates():
        return srv.request(encode(Message(type=STATS, seq=2)), port=shard).meta["updates"]

    assert shard_updates() == 0  # nothing was applied
    # ...and a good worker still trains, with garbage flying meanwhile.
    good = worker(cli_env, srv.address, 0, 1, "--epochs", 3)
    for _ in range(20):
        assert srv.request([header(v=7)], port=shard).type == ERROR
        time.sleep(0.05)
    (code, out, err), = finish([good])
    assert code == 0, err
    code, _, err = srv.wait()
    assert code == 0, err
    assert read_json(srv.out / "summary.json")["updates"] == 3 * 125  # 125 pushes an epoch


@pytest.mark.parametrize("consistency", ["ssp:1", "sync"])
def test_killed_worker_does_not_stall_the_survivor(server, cli_env, consistency):
    srv = server("--task", "mnist1d-cnn", "--workers", 2, "--consistency", consistency,
                 "--heartbeat-timeout", 1.5)
    survivor = worker(cli_env, srv.address, 0, 2, "--epochs", 6, "--heartbeat", 0.2)
    victim = worker(cli_env, srv.address, 1, 2, "--epochs", 1000, "--heartbeat", 0.2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and srv.stats()["updates"] < 50:
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait()
    (code, out, err), = finish([survivor], timeout=120)
    assert code == 0, err
    steps = int(out.split(" steps")[0].split()[-1])
    assert steps == 6 * 63  # 2000 samples each, batch 32: 63 steps an epoch, all done
    assert time.monotonic() - killed_at < 60
    code, _, err = srv.wait()
    assert code == 0, err
    summary = read_json(srv.out / "summary.json")
    assert summary["stopped_by"] == "workers_done"


def test_unreachable_server_is_one_clear_line(run_cli):
    res = run_cli("worker", "--server", f"tcp://127.0.0.1:{free_port()}", "--server-timeout", 1,
                  "--progress", "off", timeout=60)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no answer from the server"), res.stderr


def test_worker_with_another_model_is_refused(server, run_cli):
    srv = server("--task", "mnist1d-cnn")
    res = run_cli("worker", "--server", srv.address, "--task", "mnist1d-mlp", "--progress", "off",
                  "--server-timeout", 10)
    assert res.returncode == 2
    assert "refused" in res.stderr and "mnist1d-cnn" in res.stderr
    assert "Traceback" not in res.stderr
    assert srv.stats()["refused_handshakes"] == 1


@pytest.mark.parametrize("args, fragment", [
    (["--consistency", "ssp:x"], "use async, ssp:K"),
    (["--bind", "localhost:5555"], "use tcp://HOST:PORT"),
    (["--shards", "0"], "--shards"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--busy-poll-us", "-1"], "--busy-poll-us"),
])
def test_bad_server_flags_are_one_clear_line(run_cli_here, args, fragment, tmp_path):
    res = run_cli_here("ps-server", *args, "--out", tmp_path / "run")
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and fragment in lines[0], res.stderr


def test_port_in_use_is_one_clear_line(server, run_cli, tmp_path):
    srv = server("--task", "mnist1d-cnn")
    res = run_cli("ps-server", "--bind", srv.address, "--out", tmp_path / "x", timeout=60)
    assert res.returncode != 0 and "cannot listen on --bind" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_ps_stats_reports_a_running_server(server, cli_env, run_cli):
    """One worker pulls after every push, so each of its 20 pushes has staleness 0 on each of
    the 2 shards: the histogram holds exactly those 40. With --busy-poll-us 0 on both
    sides, neither polls: the shards count no poll."""
    task = ["--task", "tasks_for_tests:dense_pair", "--samples", 160, "--busy-poll-us", 0]
    srv = server(*task, "--shards", 2, "--no-exit-when-done")
    (code, out, err), = finish([worker(cli_env, srv.address, 0, 1, *task, "--epochs", 1)])
    assert code == 0 and "20 steps, 20 pushes" in out, err
    wait_for(lambda: srv.stats()["updates"] == 40, 30, "the evaluator's next read of the shards")
    res = run_cli("ps-stats", "--server", srv.address, "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)
    assert stats["shards"] == 2 and stats["task"] == "tasks_for_tests:dense_pair"
    assert [s["busy_polls"] for s in stats["shard_stats"]] == [0, 0]
    assert stats["updates"] == 40 and stats["staleness"] == [40] + [0] * 63
    assert len(stats["joined"]) == 1 and stats["left"] == stats["joined"]
    # The run's metrics carry the same: updates, updates/s and staleness percentiles.
    last = [e for e in read_events(srv.out) if e["event"] == "eval"][-1]
    assert last["updates"] == 40 and last["staleness_p50"] == last["staleness_p99"] == 0
    assert last["updates_per_second"] >= 0


def test_resume_continues_from_the_shard_checkpoints(server, cli_env, tmp_path):
    first = server("--task", "mnist1d-cnn", "--optimizer", "momentum", "--lr", 0.05)
    (code, _, err), = finish([worker(cli_env, first.address, 0, 1, "--epochs", 3)])
    assert code == 0, err
    assert first.wait()[0] == 0
    before = read_json(first.out / "summary.json")
    assert before["updates"] == 3 * 125 and (first.out / "shard-0.pt").is_file()
    state = load_checkpoint(first.out / "shard-0.pt")["shard"]
    assert state["version"] == 375 and "momentum_buffer" in state["rule"]["state"]

    resumed = Server(cli_env, first.out, "--resume", first.out)
    try:
        (code, _, err), = finish([worker(cli_env, resumed.address, 0, 1, "--epochs", 1)])
        assert code == 0, err
        assert resumed.wait()[0] == 0
    finally:
        resumed.close()
    after = read_json(first.out / "summary.json")
    assert after["updates"] == 375 + 125  # the shard's counters and version went on
    events = [json.loads(line) for line in open(first.out / "metrics.jsonl")]
    at = next(i for i, e in enumerate(events) if e["event"] == "resume")
    first_eval = next(e for e in events[at:] if e["event"] == "eval")
    assert first_eval["accuracy"] == before["final_metric"]  # same parameters, same evaluation


@pytest.mark.parametrize("params,workers,cores,expected", [
    (5_000, 1, 2, 1),  # mnist1d-cnn: 20 KB
    (250_000, 1, 16, 1),  # 1 MB
    (2_499_999, 1, 3, 1), (2_500_000, 1, 3, 2),  # 10 MB: the second shard's 5 MB
    (2_500_000, 1, 2, 1),  # 2 shards and the worker would be 3 processes on 2 cores
    (2_500_000, 2, 2, 1), (2_500_000, 4, 2, 1),  # the workers keep both cores busy
    (10 * 2 ** 20, 1, 2, 1), (10 * 2 ** 20, 1, 4, 3),  # 40 MiB: the cores the worker leaves
    (10 * 2 ** 20, 2, 4, 2), (10 * 2 ** 20, 3, 4, 1),
    (10 * 2 ** 20, 1, 16, 8), (10 * 2 ** 20, 4, 16, 4),  # 4: cores // workers
    (10 * 2 ** 20, 1, 1, 1), (10 * 2 ** 20, 0, 2, 1)])  # --workers 0 counts as 1
def test_auto_shards_give_a_shard_per_5_mb_within_the_spare_cores(params, workers, cores,
                                                                  expected):
    assert auto_shards(params, workers, cores) == expected
    assert shard_count("auto", params, workers, cores) == expected
    assert shard_count(3, params, workers, cores) == 3  # a number given is kept
    # never more shards than the cores the workers leave, unless it is the one shard
    assert expected == 1 or expected + max(1, workers) <= cores


def test_auto_shards_say_why_in_the_log(caplog):
    """The count and both bounds it met reach the log (ps-server -v)."""
    import logging
    with caplog.at_level(logging.INFO, logger="asyncsgd.servers.sharding"):
        assert shard_count("auto", 10 * 2 ** 20, 1, 2) == 1
    assert ("--shards auto: 1 for 41.9 MB of parameters, 1 expected worker(s), 2 core(s) (a "
            "shard per 5 MB, at most the 1 core(s) the workers leave and cores // workers)"
            ) in caplog.text


def test_a_resumed_run_keeps_its_shard_count_under_auto(run_cli, cli_env, tmp_path):
    """wide_counter: 16.8 MB of float32, one expected worker, 2 shards; resumed with
    --shards auto on one core, where auto would choose 1 shard, it keeps the run's 2."""
    out, task = tmp_path / "run", ["--task", "tasks_for_tests:wide_counter", "--samples", 64]
    res = run_cli("ps-server", *task, "--workers", 1, "--shards", 2, "--max-seconds", 4,
                  "--out", out, "--bind", "tcp://127.0.0.1:0", "--progress", "off")
    assert res.returncode == 0, res.stderr
    assert read_json(out / "summary.json")["shards"] == 2 == saved_shards(out)
    assert auto_shards(1 << 22, 1, 1) == 1
    one_core = {min(os.sched_getaffinity(0))}
    res = subprocess.run(asyncsgd_cmd(
        "ps-server", "--resume", out, "--shards", "auto", "--max-seconds", 4,
        "--bind", "tcp://127.0.0.1:0", "--progress", "off", "-v"), env=cli_env,
        capture_output=True, text=True, timeout=240,
        preexec_fn=lambda: os.sched_setaffinity(0, one_core))  # as taskset would
    assert res.returncode == 0, res.stderr
    assert "--shards auto: 2, as the resumed run's shard checkpoints" in res.stderr
    assert read_json(out / "summary.json")["shards"] == 2


def test_rank_and_world_come_from_flags_torchrun_or_slurm():
    from asyncsgd.config import WorkerConfig
    from asyncsgd.errors import ConfigError
    from asyncsgd.workers.worker import rank_and_world
    assert rank_and_world(WorkerConfig(), {}) == (0, 1)
    assert rank_and_world(WorkerConfig(), {"RANK": "2", "WORLD_SIZE": "4"}) == (2, 4)
    assert rank_and_world(WorkerConfig(), {"SLURM_PROCID": "1", "SLURM_NTASKS": "3"}) == (1, 3)
    assert rank_and_world(WorkerConfig(rank=0, world=2), {"RANK": "5", "WORLD_SIZE": "9"}) == (0, 2)
    with pytest.raises(ConfigError, match="outside"):
        rank_and_world(WorkerConfig(), {"RANK": "3", "WORLD_SIZE": "3"})
    with pytest.raises(ConfigError, match="not an integer"):
        rank_and_world(WorkerConfig(), {"RANK": "x"})


def test_push_every_with_dc_asgd_and_staleness_lr_trains(server, cli_env):
    # A push carries the sum of 4 steps' gradients: the server's lr is scaled down to match.
    srv = server("--task", "mnist1d-cnn", "--workers", 2, "--dc-asgd", 0.04, "--staleness-lr",
                 "--optimizer", "sgd", "--lr", 0.03)
    env = dict(cli_env, WORLD_SIZE="2")
    procs = [subprocess.Popen(
        asyncsgd_cmd("worker", "--server", srv.address, "--threads", 1, "--progress", "off",
                     "--epochs", 3, "--push-every", 4),
        env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL) for r in range(2)]
    results = finish(procs)
    for code, out, err in results:
        assert code == 0, err
        # 63 steps an epoch x 3 = 189 steps: 47 full pushes of 4 steps and the last step flushed.
        assert "189 steps, 48 pushes" in out, out
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    assert summary["updates"] == 2 * 48
    assert summary["dc_uncompensated"] == 0  # each worker pulled first, and 8 copies fit both
    assert summary["final_metric"] > 0.2  # chance is 0.1


@pytest.mark.parametrize("consistency", ["async", "ssp:2", "sync"])
def test_two_workers_and_two_shards_reach_85_percent_on_mnist1d_cnn(server, cli_env, consistency):
    """docs/parameter-server.md's bar: 85% test accuracy within 5 minutes on this machine,
    in every mode."""
    srv = server("--task", "mnist1d-cnn", "--shards", 2, "--workers", 2,
                 "--consistency", consistency, "--target", 0.85, "--max-seconds", 300)
    procs = [worker(cli_env, srv.address, r, 2, "--task", "mnist1d-cnn", "--epochs", 1000)
             for r in range(2)]
    for code, out, err in finish(procs, timeout=360):
        assert code == 0, err
        assert "the server ended training" in out
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    assert summary["stopped_by"] == "target", summary
    assert summary["best_metric"] >= 0.85 and summary["time_to_target"] <= 300
