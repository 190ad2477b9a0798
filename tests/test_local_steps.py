"""Local SGD / DiLoCo on the parameter server, bit for bit: workers train --local-steps H with
their inner optimizer and push the pseudo-gradient (pulled minus local parameters); the
shards apply their outer rule to it. A real server and real workers are checked against the
same training written with torch.optim in this one process: the model the server ends
with must be the reference's to the last bit.

DiLoCo (sync): each round the shards average one pseudo-gradient per worker and step
Nesterov momentum. Asynchronous Local SGD with one worker: its pushes apply in the one
order there is, through delayed Nesterov."""

import pytest
import torch

from asyncsgd.core.signature import PS_PARTITION_SEED
from asyncsgd.core.tasks import epoch_order, load_task, partition_indices
from asyncsgd.run.checkpoint import load_checkpoint
from conftest import finish, read_json, worker
from test_rules import DelayedNesterovReference

TASK = "tasks_for_tests:regression"
SAMPLES = 120  # 96 training rows: 48 a worker of 2, 3 batches of 16 an epoch
EPOCHS = 3


def _batches(task, world: int, rank: int, epochs: int):
    """The batches worker ``rank`` of ``world`` trains on, in its order (as the worker)."""
    part = partition_indices(len(task.train), world, rank, PS_PARTITION_SEED)
    for epoch in range(epochs):
        order = epoch_order(part, 0, rank, epoch)
        for start in range(0, len(order), task.batch_size):
            yield task.train.rows(order[start:start + task.batch_size])


class _ReferenceWorker:
    """One worker's inner training with torch.optim, its optimizer kept across rounds."""

    def __init__(self, task, inner: str, lr: float, weight_decay: float, batches):
        self.task, self.batches = task, batches
        self.model = task.build_model(0)
        params = list(self.model.parameters())
        self.opt = (torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)
                    if inner == "adamw" else
                    torch.optim.SGD(params, lr=lr, weight_decay=weight_decay, foreach=False,
                                    momentum=0.9 if inner == "momentum" else 0.0))

    def round(self, theta: torch.Tensor, steps: int) -> torch.Tensor:
        """H steps from ``theta``; the pseudo-gradient theta - local."""
        torch.nn.utils.vector_to_parameters(theta.clone(), self.model.parameters())
        for _ in range(steps):
            (inputs,), targets = next(self.batches)
            self.opt.zero_grad()
            self.task.loss_fn(self.model(inputs), targets).backward()
            self.opt.step()
        return theta - torch.nn.utils.parameters_to_vector(self.model.parameters()).detach()


def _server_model(out) -> torch.Tensor:
    model = load_task(TASK, samples=SAMPLES).build_model(0)
    model.load_state_dict(load_checkpoint(out / "checkpoint.pt")["model"])
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def _train(server, cli_env, server_args, worker_args, world):
    srv = server("--task", TASK, "--samples", SAMPLES, "--workers", world, *server_args)
    procs = [worker(cli_env, srv.address, r, world, "--task", TASK, "--samples", SAMPLES,
                    "--epochs", EPOCHS, *worker_args) for r in range(world)]
    results = finish(procs, timeout=120)
    code, _, err = srv.wait()
    assert code == 0, err
    for w_code, w_out, w_err in results:
        assert w_code == 0, w_err
        assert f"{96 // world // 16 * EPOCHS} steps, " in w_out, w_out
    return srv.out


@pytest.mark.parametrize("inner, lr, wd", [("adamw", 0.01, 0.1), ("sgd", 0.05, 0.0)])
def test_sync_diloco_equals_torch_optim_bit_for_bit(server, cli_env, inner, lr, wd):
    """2 workers, H = 3, 2 shards: 3 rounds of the mean pseudo-gradient through Nesterov."""
    h, world = 3, 2
    out = _train(server, cli_env,
                 ("--optimizer", "nesterov", "--lr", 0.7, "--momentum", 0.9,
                  "--consistency", "sync", "--shards", 2),
                 ("--local-steps", h, "--inner-optimizer", inner, "--local-lr", lr,
                  "--inner-weight-decay", wd), world)

    task = load_task(TASK, samples=SAMPLES)
    theta = torch.nn.Parameter(
        torch.nn.utils.parameters_to_vector(task.build_model(0).parameters()).detach())
    outer = torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    workers = [_ReferenceWorker(task, inner, lr, wd, _batches(task, world, r, EPOCHS))
               for r in range(world)]
    for _ in range(3 * EPOCHS // h):
        pseudo = [w.round(theta.detach(), h) for w in workers]
        theta.grad = (torch.zeros_like(theta) + pseudo[0] + pseudo[1]) / world
        outer.step()
    assert torch.equal(_server_model(out), theta.detach())


def test_async_local_sgd_with_delayed_nesterov_equals_the_reference(server, cli_env):
    """1 worker, H = 4, inner momentum; delayed Nesterov with a period of 2 pushes. A last
    round of 2 steps (18 = 4 * 4 + 2) is pushed when the worker ends: nothing trained is
    lost."""
    h, period = 4, 2
    out = _train(server, cli_env,
                 ("--optimizer", "delayed-nesterov", "--nesterov-period", period,
                  "--lr", 0.5, "--momentum", 0.8),
                 ("--local-steps", h, "--inner-optimizer", "momentum", "--local-lr", 0.05), 1)

    task = load_task(TASK, samples=SAMPLES)
    theta = torch.nn.Parameter(
        torch.nn.utils.parameters_to_vector(task.build_model(0).parameters()).detach())
    outer = DelayedNesterovReference([theta], lr=0.5, momentum=0.8, period=period)
    ref = _ReferenceWorker(task, "momentum", 0.05, 0.0, _batches(task, 1, 0, EPOCHS))
    for steps in (h, h, h, h, 2):
        theta.grad = ref.round(theta.detach(), steps)
        outer.step()
    assert torch.equal(_server_model(out), theta.detach())


def test_local_steps_and_push_every_are_one_or_the_other(run_cli_here):
    res = run_cli_here("worker", "--local-steps", 4, "--push-every", 2, "--server-timeout", 1)
    assert res.returncode == 2
    assert "--local-steps 4 and --push-every 2: choose one" in res.stderr


@pytest.mark.parametrize("dense", [(), ("--dense", "sync", "--sync-reduce", "sum")])
def test_local_steps_with_tables_served_by_row_push_each_windows_rows_once(
        server, cli_env, dense):
    """tasks_for_tests:table_counter (a 48-row table served by row, one dense scalar), 2
    workers, H = 4 at local lr 1, the shards' sgd at lr 1: every row ends at minus the times
    it was trained (-2) and the scalar at -96, so the loss is exactly -98, asynchronous or
    with the dense part in rounds that add the workers' pseudo-gradients (Persia's hybrid:
    rows apply on arrival). Each worker's 6 steps (3 batches of 8 an epoch) are 2 windows:
    4 batches touching 24 distinct rows (the epoch's 24 and the next epoch's first 8
    again), then 2 touching 16. Rows pulled and pushed: 2 x (24 + 16) = 80, against 96 a
    step at a time; each window's rows came with the push before it (the first with a
    pull), so no more were pulled."""
    args = ("--task", "tasks_for_tests:table_counter", "--samples", 48)
    srv = server(*args, "--lr", 1, "--workers", 2, *dense)
    procs = [worker(cli_env, srv.address, r, 2, *args, "--epochs", 2, "--local-steps", 4,
                    "--local-lr", 1) for r in range(2)]
    for code, out, err in finish(procs):
        assert code == 0, err
        assert "6 steps, 2 pushes" in out, out
    assert srv.wait()[0] == 0
    summary = read_json(srv.out / "summary.json")
    assert summary["final_loss"] == -98.0, summary
    updates = 2 if dense else 4  # a round of 2 pushes is one update
    assert (summary["rows_pulled"], summary["rows_pushed"], summary["updates"]) == \
        (80, 80, updates)


def test_local_steps_with_tables_need_the_batches_known_ahead(server, cli_env):
    """--data-dispatch dynamic hands a worker one batch at a time: a window of H batches'
    rows cannot be pulled ahead, and the worker says so in one line."""
    args = ("--task", "tasks_for_tests:table_counter", "--samples", 48)
    srv = server(*args, "--lr", 1, "--workers", 1, "--data-dispatch", "dynamic")
    (code, _, err), = finish([worker(cli_env, srv.address, 0, 1, *args, "--local-steps", 4)])
    assert code != 0
    assert "--data-dispatch dynamic hands batches out one at a time" in err, err
