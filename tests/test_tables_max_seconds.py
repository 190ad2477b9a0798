"""--max-seconds holds with a large table served by row: the final pull of every row for
checkpoint.pt, and the shards' saves as they stop, are set aside before the limit as the final
evaluation is, and the run still saves its whole trained table.

Measured (a ps-server on ctr:rows=100000,tables=1, a 2.6-million-row table, and two workers,
--max-seconds 30, experiments/README.md "--max-seconds with tables"): before, the run ended
34.2 s after its start, 37.1 s beside 4 busy processes on its core; the stop left, in those
runs, a pull of every row (1.4 s, 2.1 s), the shard's save and drain (2.7 s, 4.1 s) and the
server's checkpoint (0.2 s, 0.8 s), none of them set aside.
"""

import pytest
import torch

from asyncsgd.core.tasks import load_task
from asyncsgd.run.checkpoint import load_checkpoint
from conftest import finish, read_json, worker

pytestmark = [pytest.mark.processes, pytest.mark.solo]  # it times itself

TASK = ["--task", "ctr:rows=20000,tables=1", "--samples", 20000]
LIMIT = 14.0
# After the stop, beyond the reserve: the shards' drain (1.5 s at least, as in a dense run,
# where a worker the front welcomed may still be on its way) and the error of each estimate
OVER = 4.0


def test_a_tables_run_ends_near_max_seconds_with_its_whole_table_saved(server, cli_env,
                                                                      cache_dir):
    srv = server(*TASK, "--workers", 2, "--epochs", 1000, "--max-seconds", LIMIT,
                 "--checkpoint-every", 0)
    results = finish([worker(cli_env, srv.address, r, 2, *TASK) for r in range(2)])
    for code, _, err in results:
        assert code == 0, err
    code, _, err = srv.wait()
    assert code == 0, err
    summary = read_json(srv.out / "summary.json")
    assert summary["stopped_by"] == "max_seconds", summary
    assert summary["train_seconds"] < LIMIT + OVER, summary["train_seconds"]
    # the saved model holds the trained table, pulled before the shard's last pushes: a row
    # it holds trained the shard's final table holds trained too, rows no batch touched stay
    # as the model began, and (two workers, a few steps after that pull) most trained rows
    name = "tables.0.weight"
    saved = load_checkpoint(srv.out / "checkpoint.pt")["model"][name]
    shard = load_checkpoint(srv.out / "shard-0.pt")["shard"]["sparse"]["tables"][0]["weight"]
    task = load_task(TASK[1], samples=20000, cache_dir=str(cache_dir))
    initial = task.build_model(0).get_parameter(name).detach()
    assert saved.shape == shard.shape == initial.shape == (26 * 20000, 16)
    in_saved, in_shard = (saved != initial).any(dim=1), (shard != initial).any(dim=1)
    assert bool((in_saved <= in_shard).all())
    assert torch.equal(saved[~in_shard], initial[~in_shard])
    assert 0.5 * int(in_shard.sum()) <= int(in_saved.sum()), (in_saved.sum(), in_shard.sum())
    assert 0 < int(in_shard.sum()) < len(saved)
    assert summary["tables"][name]["rows"] == len(saved)
