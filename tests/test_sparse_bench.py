"""experiments/sparse_ps.py runs: its ddp_rpc baseline (an RPC parameter server holding the
ctr table, two DDP trainers) trains one short epoch as real processes and reports its figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"

pytestmark = pytest.mark.processes


def test_the_ddp_rpc_baseline_trains_and_reports(tmp_path, cli_env):
    out = tmp_path / "rows.json"
    # 4 processes forked from one fork server: 8 to 15 s on the 2-core machine
    res = subprocess.run([sys.executable, str(EXPERIMENTS / "sparse_ps.py"), "--quick",
                          "--only", "ddp_rpc", "--json", str(out)],
                         env=cli_env, capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["baseline"] == "ddp_rpc" and row["task"] == "ctr:rows=100,tables=1"
    assert math.isfinite(row["samples_per_second"]) and row["samples_per_second"] > 0
    assert 0.5 < row["final_auc"] <= 1, row["evals"]
    # one epoch of 5,400 training samples, 32 a trainer's step: 84 steps each
    assert row["samples"] == 2 * 32 * (5400 // 2 // 32)
    assert set(row["rss"]) == {"ps", "master", "trainer0", "trainer1"}
    assert all(v > 0 for v in row["rss"].values())
    # ids and offsets (int64), vectors and their gradient (float32), the dense all-reduce
    assert row["bytes_detail"]["vectors"] == 32 * 26 * 16 * 4
    assert row["bytes_per_step"] == sum(row["bytes_detail"].values())
    assert "| ddp_rpc |" in res.stdout


def test_the_table_gives_each_row_against_ddp_rpc_repeat_by_repeat():
    """summarize and table on made rows: the samples/s median with its range, and the ratio
    to ddp_rpc of the medians and of each seed's pair (the pairs are not the medians')."""
    sys.path.insert(0, str(EXPERIMENTS))
    try:
        import sparse_ps
    finally:
        sys.path.remove(str(EXPERIMENTS))

    def row(baseline, seed, rate):
        setting = sparse_ps.Setting(10, 100, seed=seed)
        return sparse_ps._row(baseline, setting, samples=rate, train_seconds=1.0,
                              evals=[{"train_s": 1.0, "samples": rate, "auc": 0.7,
                                      "loss": 0.5}], default_target=0.9, rss={"p": 1},
                              bytes_per_step=1, bytes_measured=True)

    rows = [row("asyncsgd-local", s, r) for s, r in enumerate((30, 20, 40))] + \
        [row("ddp_rpc", s, r) for s, r in enumerate((10, 10, 20))]
    local, rpc = sparse_ps.summarize(rows)
    assert local["vs_ddp_rpc"] == 3.0 and local["vs_ddp_rpc_each"] == [3.0, 2.0, 2.0]
    assert "vs_ddp_rpc" not in rpc
    text = sparse_ps.table([local, rpc])
    assert "| asyncsgd-local | 260 | 30 (20–40) | 3.00× (3.00, 2.00, 2.00) |" in text
    assert "| ddp_rpc | 260 | 10 (10–20) | — |" in text
