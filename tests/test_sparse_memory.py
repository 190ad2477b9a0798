"""A shard's memory stays flat under --evict lfu while its raw ids grow without bound
(experiments/sparse_memory.py: a real ps-server on ctr, --id-space hashed, fed 4,096 new ids
a step by a hand-made worker), and grows with the ids without eviction."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
LFU_ROWS, IDS = 16_384, 524_288

pytestmark = pytest.mark.processes


def test_lfu_keeps_the_shards_rss_flat_while_ids_grow_and_none_does_not(tmp_path, cli_env):
    out = tmp_path / "rows.json"
    # two servers started and fed 128 steps each: 25 to 40 s on the 2-core machine
    res = subprocess.run([sys.executable, str(EXPERIMENTS / "sparse_memory.py"), "--ids",
                          str(IDS), "--evict", f"lfu:{LFU_ROWS}", "--evict", "none",
                          "--json", str(out)],
                         env=cli_env, capture_output=True, text=True, timeout=240,
                         stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lfu, none = json.loads(out.read_text())
    assert lfu["ids_seen"] == none["ids_seen"] == IDS
    assert (lfu["rows_held"], lfu["created"], lfu["evictions"]) == \
        (LFU_ROWS, IDS, IDS - LFU_ROWS)
    assert (none["rows_held"], none["created"], none["evictions"]) == (IDS, IDS, 0)
    # The bound from lfu's rows: the table's bytes at LFU_ROWS (1.6 MiB: rows, slots and id
    # map, ~100 B a row) four times over, plus 16 MiB for what any first pushes leave (frames,
    # torch's allocator): 22.4 MiB. Measured at these sizes: lfu +9.1 MiB (272.2 -> 281.3),
    # +0.6 after the table filled (the last 7/8 of the ids); none +91.4 MiB (272.2 -> 363.6).
    # At 2 million ids: lfu:100000 +24.8 MiB, none +340 MiB (experiments/README.md, "Sparse
    # tables: the shard's memory").
    bound = 16 + 4 * lfu["table_mib"]
    assert lfu["rss_after_mib"] - lfu["rss_before_mib"] < bound, lfu
    assert lfu["rss_max_mib"] - lfu["rss_warm_mib"] < 4 + lfu["table_mib"], lfu
    assert none["rss_after_mib"] - none["rss_before_mib"] > bound, none
