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
