"""Checkpoints under SIGKILL: a writer killed during a save leaves the previous one loadable."""

import random
import subprocess
import sys
import time

import torch

from asyncsgd.run.checkpoint import load_checkpoint
from faults import record_figure

WRITER = """
import sys, torch
from asyncsgd.run.checkpoint import save_checkpoint
path, start = sys.argv[1], int(sys.argv[2])
blob = torch.empty(8 * 2 ** 20)  # 32 MiB: a save takes long enough to be hit
for i in range(start, start + 10 ** 6):
    blob.fill_(i)
    save_checkpoint(path, {"i": i, "blob": blob})
    print(i, flush=True)
"""


def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path, cli_env):
    path = tmp_path / "shard-0.pt"
    rng, kills, mid_save, last = random.Random(3), 12, 0, -1
    for _ in range(kills):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(last + 1)],
                                  env=cli_env, stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout.readline(), "the writer saved nothing"  # one save done
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            writer.kill()
            writer.wait(10)
        mid_save += any(tmp_path.glob("shard-0.pt.*.tmp"))  # it died inside a save
        record = load_checkpoint(path)
        assert record["i"] > last and torch.equal(record["blob"], torch.full_like(
            record["blob"], record["i"]))  # one whole save, never a mix of two
        last = record["i"]
    assert mid_save >= 1, "no kill landed inside a save; make the saves longer"
    # The next save removes what killed writers left behind.
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(last + 1)],
                              env=cli_env, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline()
    finally:
        writer.kill()
        writer.wait(10)
    leftovers = [p for p in tmp_path.glob("shard-0.pt.*.tmp")
                 if f".{writer.pid}." not in p.name]
    assert leftovers == []
    record_figure("checkpoint SIGKILL during save", kills=kills, kills_mid_save=mid_save,
                  unloadable_checkpoints=0)


def test_a_shard_that_fails_as_it_starts_is_named_with_its_error(tmp_path, run_cli):
    """A resumed run whose shard checkpoint is corrupt: the shard raises before it listens,
    its pipe to the server closes, and the server reports the shard's error and exits 1
    (it said "interrupted" and exited 130 before, as if stopped by Ctrl-C)."""
    out = tmp_path / "run"
    args = ("--task", "tasks_for_tests:dense_counter", "--workers", 1, "--progress", "off")
    first = run_cli("ps-server", *args, "--out", out, "--max-seconds", 2, "--eval-every", 0.5)
    assert first.returncode == 0, first.stderr
    (out / "shard-0.pt").write_bytes(b"not a checkpoint")
    res = run_cli("ps-server", "--resume", out, "--progress", "off", "--max-seconds", 2)
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("error: shard 0 raised an exception"), res.stderr
    assert "shard-0.pt is not a readable checkpoint" in res.stderr
    assert "interrupted" not in res.stderr
