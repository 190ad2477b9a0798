"""Dynamic dispatch on the virtual clock, through the real shard: coverage against static."""

from __future__ import annotations

from test_simulator import MS, _costs, _setup, _traced


def _run(tmp_path, mode, **kw):
    engine, result = _traced(tmp_path, mode, _setup(workers=4, costs=_costs(
        step=2 * MS, bandwidth=1e8, slowdown=((3, 4.0),)), **kw), name=mode)
    return engine, result.summary


def test_a_4x_straggler_of_4_skews_static_partitions_and_not_dynamic_dispatch(tmp_path):
    _, static = _run(tmp_path, "ps-async", max_seconds=3.0)
    _, dynamic = _run(tmp_path, "ps-async+dynamic", max_seconds=3.0)
    assert static["coverage"]["granularity"] == "partition"
    assert static["coverage"]["spread"] > 3
    assert dynamic["coverage"]["granularity"] == "sample"
    assert dynamic["coverage"]["spread"] <= 1.1
    assert dynamic["rehanded"] == 0 and dynamic["unattributed"] == 0


def test_every_row_exactly_once_per_epoch_when_a_worker_leaves_mid_chunk(tmp_path):
    engine, summary = _run(tmp_path, "ps-async+dynamic", epochs=3, leave=((0.05, 1),))
    counts = engine.state.dispatcher.counts
    assert counts.min().item() == counts.max().item() == 3
    assert summary["coverage"]["spread"] == 1.0
    assert summary["rehanded"] > 0 and summary["finished"]
