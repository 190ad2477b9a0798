"""Sparse embedding tables on ctr: the baselines a sparse parameter server is measured against.

    python experiments/sparse_ps.py                    # 7 rows x 3 sizes x 3 repeats
    python experiments/sparse_ps.py --quick            # tiny sizes, < 60 s, --no-save implied
    python experiments/sparse_ps.py --only ddp_rpc --rows 384616   # the 10^7-row table

Three baselines, each training the ctr task's DLRM-like model (``ctr:tables=1``: one table
of ``26 * rows`` x 16, feature ``f``'s id ``i`` at row ``f * rows + i``; bottom and top
MLPs and dot interactions, ``models.DLRMDense``) for one epoch of its train split:

* ``ddp_rpc``: pytorch/examples ``distributed/rpc/ddp_rpc`` applied to ctr. As there, a
  master process places the table on an RPC parameter server (``RemoteModule("ps",
  EmbeddingBag)``) and starts two trainers (``rpc_async(_run_trainer)``); the trainers run
  the dense part under DDP (gloo), look the table up through the RemoteModule inside a
  distributed-autograd context, and step both with one ``DistributedOptimizer(SGD)``
  (the table's rows on the PS, the dense part locally). Differences from the example,
  each for ctr: the EmbeddingBag is ``sparse=True`` (the example's dense gradient would
  send and apply all 26 x rows x 16 floats per step; SGD takes sparse gradients), bags of
  one id each (a DLRM lookup), lr 0.5 (the task's), the init of DLRM's tables (N(0, 0.1)),
  and 4 owned processes on 127.0.0.1 (``rpc_ps.Owned``: forked from one fork server,
  joined with timeouts, exit codes checked) instead of ``mp.spawn``. Trainer 0 evaluates
  the test AUC every ``--eval-every`` steps (the table's test rows through the same
  RemoteModule); the time evaluating is taken out of the train time. Bytes per step are
  *computed* from the tensors a trainer sends and receives (TensorPipe counts none): the
  lookup's ids and offsets (int64), the looked-up vectors and their gradient (float32),
  and gloo's ring all-reduce of the dense gradient (2 ranks: each sends and receives the
  whole gradient once); the optimizer's RPCs carry only a context id and are left out.
* ``asyncsgd-dense``: today's parameter server, the tables inside the flat vector every
  push and pull carries whole, through its CLI (``run_asyncsgd``: ``asyncsgd compare
  --modes ps-async --procs 2 --epochs 1``), read back from the run directory: samples/s
  after start-up (compare's figure), bytes per update ((wire + shared-memory bytes) /
  updates), the AUC curve. Only where it fits: 26 x rows x 16 floats per push.
* ``torchrec``: TorchRec's ``FusedEmbeddingBagCollection`` (fbgemm's CPU kernels,
  rowwise Adagrad fused into the backward) beside the dense part on SGD, one process
  (``experiments/torchrec_ctr.py``), run in its own venv (``--torchrec-python``), since
  TorchRec is no dependency of asyncsgd. When that interpreter is missing or fails, the
  row says so (``TORCHREC_INSTALL``: what installing it did here).

Every row: samples/s (both workers together, train time only), bytes per step (one
worker's step), peak RSS of each process, the test AUC after the epoch, and the train
seconds and samples until the AUC first reached the task's target; medians over
``--repeats`` runs (seeds 0, 1, ...: data order and dense init; the data are the task's),
run in turn so that the machine's drift hits every row alike, with the AUC's range. The
sparse PS's own rows come from ``run_asyncsgd`` with their flags (``ASYNCSGD_RUNS``):
``asyncsgd-sparse`` (one push a step), ``asyncsgd-local`` (a push every ``--local-steps``
H steps, asynchronous Local SGD), ``asyncsgd-hybrid`` (``--dense sync``) and ``single``
(one process, the AUC reference).

Prints a table; writes ``experiments/results/sparse_ps.md`` and ``.json`` (not with
``--quick`` or ``--no-save``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from asyncsgd import load_task
from asyncsgd.core import ctr_data, models
from asyncsgd.core.scoring import auc
from asyncsgd.core.tasks import CTR_LR, partition_indices
from asyncsgd.run.metrics import first_progress, steady_throughput
from asyncsgd.run.reader import Run

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the fork server imports this module by name
    sys.path.insert(0, str(HERE))

from results import save_results  # noqa: E402  (this script's folder)
from rpc_ps import (EXIT_TIMEOUT_S, Owned, _init_rpc, free_port,  # noqa: E402
                    start_context)

NAME = "sparse_ps"
FEATURES, DIM = ctr_data.CATEGORICAL, 16
BASELINES = ("asyncsgd-sparse", "asyncsgd-local", "asyncsgd-hybrid", "single", "ddp_rpc",
             "asyncsgd-dense", "torchrec")
# compare's extra flags of each asyncsgd row: the server's then every worker's. The ctr task
# declares its tables, which a parameter server serves by row unless told --embeddings dense.
# (mode, --mode-args): the hybrid is ps-sync (--dense sync), whose round sums the 2 workers'
# dense gradients at the task's lr, as one process takes 2 steps; rows apply on arrival.
# asyncsgd-local: asynchronous Local SGD, each worker H steps (--local-steps, sparse_ps's
# option) on the rows of its next H batches and the dense part at the task's lr, then one
# push of the pseudo-gradient, which the shards apply as it is (sgd, lr 1).
LOCAL_STEPS = 16
ASYNCSGD_RUNS = {
    "asyncsgd-sparse": ("ps-async", ()),
    "asyncsgd-local": ("ps-async", ("ps-async=--lr 1", "worker=--local-steps {H}")),
    "asyncsgd-hybrid": ("ps-sync", ("ps-sync=--sync-reduce sum",)),
    "asyncsgd-dense": ("ps-async", ("ps-async=--embeddings dense",
                                    "worker=--embeddings dense")),
    "single": ("single", ()),   # the AUC reference: one process, the same data and samples
}
TRAINERS = 2
START_TIMEOUT_S = 180.0   # fork + import + load_task + two rendezvous, on a loaded 2-core box
TRAIN_TIMEOUT_S = 1800.0
TORCHREC_PYTHON = "/work/tmp/torchrec-venv/bin/python"
# What installing TorchRec did on this machine (2026-11-29, python 3.11.7, torch 2.13.0+cpu
# from download.pytorch.org/whl/cpu): `pip install torchrec fbgemm-gpu-cpu` resolved
# torchrec 1.9.2, which requires fbgemm-gpu (the CUDA build) 1.9.0, beside fbgemm-gpu-cpu
# 1.9.0; both install into fbgemm_gpu/, and `import fbgemm_gpu` failed: "libtorch_cuda.so:
# cannot open shared object file". With fbgemm-gpu removed and fbgemm-gpu-cpu 1.9.0 alone:
# "fbgemm_gpu_tbe_index_select.so: undefined symbol _ZN5torch8autograd13_wrap_outputs..."
# (built for another torch). fbgemm-gpu-cpu 1.8.0 and torchrec 1.8.0, both --no-deps,
# import and train on CPU.
TORCHREC_INSTALL = (
    "pip install torchrec fbgemm-gpu-cpu (torch 2.13.0+cpu) gave torchrec 1.9.2 + fbgemm-gpu "
    "1.9.0 (CUDA) + fbgemm-gpu-cpu 1.9.0: import fails (libtorch_cuda.so missing; the cpu "
    "1.9.0 build alone: undefined symbol, built for another torch); fbgemm-gpu-cpu==1.8.0 "
    "and torchrec==1.8.0, both --no-deps, work (2026-11-29)")


@dataclass(frozen=True)
class Setting:
    """One ctr size and how to train it."""

    rows: int                 # ids per feature; the one table holds 26 x rows rows
    samples: int              # generated, 90% train
    batch: int = 32           # per worker, the task's
    lr: float = CTR_LR
    eval_every: int = 100     # steps of one trainer between evaluations
    seed: int = 0
    target: float = 0.0       # AUC whose first crossing is timed; 0: the task's own

    @property
    def task(self) -> str:
        return f"ctr:rows={self.rows},tables=1"


# ---------------------------------------------------------------------------- ddp_rpc

class CtrTable(nn.EmbeddingBag):
    """The ctr model's one table as the RPC parameter server holds it: sum bags (of one id
    each), DLRM's N(0, 0.1) init, sparse gradients."""

    def __init__(self, rows: int, dim: int):
        super().__init__(rows, dim, mode="sum", sparse=True)
        nn.init.normal_(self.weight, std=0.1)


def _memory() -> dict:
    """This process's peak and current RSS, in bytes."""
    with open("/proc/self/statm") as f:
        current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss": current}


def step_bytes(batch: int, dense_params: int) -> dict:
    """One ddp_rpc trainer step's bytes, from the tensors it sends and receives."""
    ids = batch * FEATURES
    return {"lookup": 2 * ids * 8,             # ids and offsets, int64
            "vectors": ids * DIM * 4,          # the looked-up rows, back
            "gradient": ids * DIM * 4,         # their gradient, to the PS
            "allreduce": 2 * dense_params * 4}  # gloo ring, 2 ranks: the gradient out and in


def _evaluate(table, head, layout, split) -> tuple:
    """Test AUC and log loss, the table's rows looked up through the RemoteModule."""
    scores = []
    with torch.no_grad():
        for start in range(0, len(split), 4096):
            (dense, categorical), _ = split.rows(torch.arange(start, min(start + 4096,
                                                                          len(split))))
            ids, = layout.embedding_inputs(dense, categorical)
            rows = table.forward(ids, torch.arange(len(ids))).detach()
            scores.append(head(dense, rows.view(FEATURES, len(dense), DIM).transpose(0, 1)))
    scores = torch.cat(scores)
    loss = models.binary_logloss(scores, split.targets)
    return auc(scores.numpy(), split.targets.numpy()), float(loss)


def _run_trainer(table, rank: int, setting: Setting) -> dict:
    """A trainer's epoch, called by the master over RPC as the example's ``_run_trainer``."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
    from torch.nn.parallel import DistributedDataParallel as DDP

    task = load_task(setting.task, samples=setting.samples)
    with torch.device("meta"):   # its embedding_inputs only: the ids of the one table
        layout = task.model_fn()
    torch.manual_seed(setting.seed)
    model = DDP(models.DLRMDense(FEATURES, ctr_data.DENSE))
    params = table.remote_parameters() + [RRef(p) for p in model.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=setting.lr)
    parts = [partition_indices(len(task.train), TRAINERS, r, setting.seed)
             for r in range(TRAINERS)]
    steps = min(len(p) for p in parts) // setting.batch   # DDP: every rank the same steps
    mine, batch = parts[rank], setting.batch
    evals, eval_s = [], 0.0
    start = time.perf_counter()
    for step in range(steps):
        (dense, categorical), labels = task.train.rows(mine[step * batch:(step + 1) * batch])
        ids, = layout.embedding_inputs(dense, categorical)
        with dist_autograd.context() as context:
            rows = table.forward(ids, torch.arange(len(ids)))
            out = model(dense, rows.view(FEATURES, batch, DIM).transpose(0, 1))
            loss = models.binary_logloss(out, labels)
            dist_autograd.backward(context, [loss])
            opt.step(context)
        if rank == 0 and ((step + 1) % setting.eval_every == 0 or step == steps - 1):
            t0 = time.perf_counter()
            trained_s = t0 - start - eval_s
            score, test_loss = _evaluate(table, model.module, layout, task.test)
            eval_s += time.perf_counter() - t0
            evals.append({"train_s": trained_s, "samples": TRAINERS * batch * (step + 1),
                          "auc": score, "loss": test_loss})
    train_s = time.perf_counter() - start - eval_s
    dense_params = sum(p.numel() for p in model.parameters())
    return {"rank": rank, "steps": steps, "train_seconds": train_s, "evals": evals,
            "dense_params": dense_params, "default_target": task.default_target,
            **_memory()}


def _ps(conn, rpc_port: int) -> None:
    """The parameter server: holds what the master places on it, answers RPCs."""
    from torch.distributed import rpc
    _init_rpc("ps", 0, TRAINERS + 2, "default", rpc_port)
    # rank 0 keeps the rendezvous store: keep it until every rank is through (rpc_ps._serve)
    from torch._C._distributed_rpc import _get_current_rpc_agent
    store = _get_current_rpc_agent().store
    conn.send(("up", {}))
    rpc.shutdown()
    conn.send(("done", _memory()))
    if conn.poll(EXIT_TIMEOUT_S + TRAIN_TIMEOUT_S):
        conn.recv()
    del store


def _table_updates(module_rref) -> int:
    """On the PS: the version counter of the table's weight, which every in-place update
    (one per optimizer step) bumps: the updates applied, counted without a copy (a float64
    checksum of the 10^7-row table cost 1.2 GB of peak RSS)."""
    return module_rref.local_value().weight._version


def _master(conn, rpc_port: int, setting: Setting) -> None:
    """As the example's rank 2: place the table on the PS, run the trainers, wait for them."""
    from torch.distributed import rpc
    from torch.distributed.nn import RemoteModule
    _init_rpc("master", 1, TRAINERS + 2, "default", rpc_port)
    table = RemoteModule("ps", CtrTable, args=(FEATURES * setting.rows, DIM))
    before = rpc.rpc_sync("ps", _table_updates, args=(table.module_rref,))
    futures = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(table, r, setting),
                             timeout=TRAIN_TIMEOUT_S) for r in range(TRAINERS)]
    trainers = [f.wait() for f in futures]
    updates = rpc.rpc_sync("ps", _table_updates, args=(table.module_rref,)) - before
    conn.send(("result", {"trainers": trainers, "master": _memory(), "table_updates": updates}))
    rpc.shutdown()


def _trainer(conn, rpc_port: int, gloo_port: int, rank: int) -> None:
    """A trainer's process: joins DDP's gloo group and the RPC world, then serves the
    master's ``_run_trainer`` call."""
    import torch.distributed as dist
    from torch.distributed import rpc
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", rank=rank, world_size=TRAINERS,
                            init_method=f"tcp://127.0.0.1:{gloo_port}")
    _init_rpc(f"trainer{rank}", 2 + rank, TRAINERS + 2, "default", rpc_port)
    conn.send(("up", {}))
    rpc.shutdown()
    dist.destroy_process_group()
    conn.send(("done", {}))


def run_ddp_rpc(setting: Setting, ctx=None) -> dict:
    """The ddp_rpc pattern on ``setting``: 1 PS, 1 master, 2 trainers, one epoch."""
    rpc_port, gloo_port = free_port(), free_port()
    trainers = [f"trainer{r}" for r in range(TRAINERS)]
    launched = time.monotonic()
    with Owned("ddp_rpc", ctx) as group:
        group.spawn("ps", _ps, rpc_port)
        group.spawn("master", _master, rpc_port, setting)
        for r, name in enumerate(trainers):
            group.spawn(name, _trainer, rpc_port, gloo_port, r)
        group.expect("up", ["ps", *trainers], START_TIMEOUT_S)
        startup_s = time.monotonic() - launched
        result = group.expect("result", ["master"], TRAIN_TIMEOUT_S)["master"]
        done = group.expect("done", ["ps", *trainers], EXIT_TIMEOUT_S)
        group.send("ps", "exit")
    by_rank = result["trainers"]
    steps = sum(t["steps"] for t in by_rank)
    if result["table_updates"] != steps:
        raise RuntimeError(f"ddp_rpc: the PS applied {result['table_updates']} updates to the "
                           f"table, the trainers made {steps} steps")
    lead = by_rank[0]
    samples = TRAINERS * setting.batch * lead["steps"]
    bytes_ = step_bytes(setting.batch, lead["dense_params"])
    return _row("ddp_rpc", setting, samples=samples, train_seconds=lead["train_seconds"],
                evals=lead["evals"], bytes_per_step=sum(bytes_.values()),
                bytes_detail=bytes_, bytes_measured=False, startup_s=startup_s,
                default_target=lead["default_target"],
                rss={"ps": done["ps"]["max_rss"], "master": result["master"]["max_rss"],
                     **{f"trainer{t['rank']}": t["max_rss"] for t in by_rank}})


# ---------------------------------------------------------------------------- asyncsgd

class TreeMemory:
    """Peak RSS of each process under ``pid`` (itself left out), sampled every ``every``
    s from /proc, keyed by the role its command line names (ps-server, worker-N, ...)."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every = pid, every
        self.peak: dict = {}
        self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        parents, rss, role = {}, {}, {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            pid = int(entry)
            parents[pid], rss[pid] = int(fields[1]), int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
            role[pid] = _role([a.decode(errors="replace") for a in argv])
        total = 0
        for pid in rss:
            up, chain = pid, []
            while up in parents and up != self.pid:
                chain.append(up)
                up = parents[up]
            if up != self.pid or not chain:
                continue
            if not rss[pid] or role[chain[-1]] == "?":
                continue   # exiting: nothing mapped, or its command line already gone
            # the process under the root that started it names it (a shard: its server's)
            name = role[pid] if len(chain) == 1 else f"{role[chain[-1]]}/child"
            self.peak[name] = max(self.peak.get(name, 0), rss[pid])
            total += rss[pid]
        self.peak_total = max(self.peak_total, total)


def _role(argv: list) -> str:
    for i, a in enumerate(argv):
        if a in ("ps-server", "worker", "single", "hogwild", "ddp"):
            rank = next((argv[j + 1] for j in range(i, len(argv) - 1)
                         if argv[j] in ("--rank", "--worker-id")), None)
            return a if rank is None else f"{a}-{rank}"
    return os.path.basename(argv[0]) if argv and argv[0] else "?"


def run_asyncsgd(label: str, setting: Setting, out: Path, mode: str = "ps-async",
                 mode_args=(), flags=(), timeout: float = TRAIN_TIMEOUT_S,
                 steps_per_update: int = 1, keep_checkpoints: bool = False) -> dict:
    """One asyncsgd run through its CLI, ``asyncsgd compare --modes MODE --procs 2
    --epochs 1`` on ``setting``, read back from its run directory.

    ``mode_args``: compare's ``--mode-args`` values (``'ps-async=--optimizer adagrad'``,
    ``'worker=--threads 1'``); ``flags``: more compare flags. The sparse parameter
    server's row is this function with the flags that turn it on. Bytes per step: the
    bytes of every push and pull, over the wire and through shared memory, over the
    server's updates (each one worker's step, or ``steps_per_update`` of them: a worker's
    --local-steps). Its checkpoints (the server's and each shard's, 1.3 GB a run at 10^7
    rows) are deleted once the row is read, unless ``keep_checkpoints``."""
    target = setting.target or load_task(setting.task, samples=setting.samples).default_target
    argv = [sys.executable, "-m", "asyncsgd", "compare", "--task", setting.task,
            "--samples", str(setting.samples), "--modes", mode, "--procs", str(TRAINERS),
            "--epochs", "1", "--budget", f"{timeout:g}", "--seed", str(setting.seed),
            "--batch-size", str(setting.batch), "--lr", f"{setting.lr:g}",
            "--target", f"{target:g}", "--progress", "off", "--out", str(out),
            *[a for m in mode_args for a in ("--mode-args", m)], *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with TreeMemory(proc.pid) as memory:
        try:
            stdout, stderr = proc.communicate(timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            raise RuntimeError(f"{label}: asyncsgd compare ran past {timeout + 120:g} s")
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: asyncsgd compare exited {proc.returncode}:\n"
                           f"{stdout[-2000:]}\n{stderr[-2000:]}")
    run_dir = next(p for p in sorted(out.iterdir()) if (p / "summary.json").is_file())
    run = Run.read(run_dir)
    summary, events = run.summary, run.events
    if not keep_checkpoints:  # ~1.3 GB a run at 10^7 rows: 15 runs left 19 GB here
        for checkpoint in out.rglob("*.pt"):
            checkpoint.unlink()
    moved = (summary.get("bytes") or 0) + (summary.get("shared_bytes") or 0)  # single: None
    # From the first to the last training report: start-up, the final evaluation and the
    # shutdown left out, as ddp_rpc's train time leaves them out (the final evaluation pulls
    # every row for the run's checkpoint: 3.4 s of a 14 s run at 10^7 rows). The server's
    # periodic evaluations run beside the workers and stay in (ddp_rpc's are taken out).
    # An epoch done within one report (--quick) has one: compare's figure, after start-up.
    between = train_throughput(events)
    steady = between or steady_throughput(events)
    samples_per_s = steady or summary["samples_per_second"]
    # Training began before its first report (a second of it, or a push of H local steps,
    # later): back from that report at the measured rate, so the time to target counts it
    first = first_progress(events)
    start = first["t"] - first["samples"] / samples_per_s
    evals = [{"train_s": max(0.0, e["t"] - start), "samples": e["samples"], "auc": e["auc"],
              "loss": e["loss"]} for e in events if e.get("event") == "eval"]
    return _row(label, setting, samples=summary["samples"],
                train_seconds=summary["samples"] / samples_per_s, evals=evals,
                bytes_per_step=moved / max(summary.get("updates") or 1, 1) / steps_per_update,
                bytes_detail={"wire": summary["bytes"], "shared": summary.get("shared_bytes", 0),
                              "updates": summary.get("updates")},
                bytes_measured=True, startup_s=start, default_target=target,
                rss=memory.peak, rss_all_processes=memory.peak_total, run_dir=str(run_dir),
                samples_per_second_from="between training reports" if between else
                "after start-up" if steady else "the whole run")


def train_throughput(events: list):
    """Samples/s between the first and the last ``train`` report of a run's events (None
    with fewer than two at distinct times)."""
    train = [e for e in events if e.get("event") == "train"]
    if len(train) < 2 or train[-1]["t"] <= train[0]["t"]:
        return None
    return (train[-1]["samples"] - train[0]["samples"]) / (train[-1]["t"] - train[0]["t"])


# ---------------------------------------------------------------------------- TorchRec

def run_torchrec(setting: Setting, python: str, workdir: Path) -> dict:
    """``torchrec_ctr.py`` on ``setting``'s data in TorchRec's own interpreter ``python``;
    a row that says what happened where it is missing or fails."""
    if not os.access(python, os.X_OK):
        return _skipped("torchrec", setting, f"no interpreter at {python}. {TORCHREC_INSTALL}")
    task = load_task(setting.task, samples=setting.samples)
    data = workdir / f"ctr-{setting.rows}-{setting.samples}.npz"
    order = torch.cat([partition_indices(len(task.train), TRAINERS, r, setting.seed)
                       for r in range(TRAINERS)])   # the rows the others train, in one pass
    np.savez(data, **{f"{name}_{field}": tensor.numpy() for name, split, idx in
                      (("train", task.train, order), ("test", task.test, None))
                      for field, tensor in zip(("dense", "categorical", "labels"),
                                               _columns(split, idx))})
    argv = [python, str(HERE / "torchrec_ctr.py"), str(data), "--rows", str(setting.rows),
            "--batch", str(setting.batch), "--lr", f"{setting.lr:g}",
            "--eval-every", str(setting.eval_every * TRAINERS), "--seed", str(setting.seed)]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return _skipped("torchrec", setting, f"ran past {TRAIN_TIMEOUT_S:g} s")
    if res.returncode != 0:
        return _skipped("torchrec", setting, f"exited {res.returncode}: "
                        + " ".join(res.stderr.strip().splitlines()[-1:]))
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return _row("torchrec", setting, samples=got["samples"],
                train_seconds=got["train_seconds"], evals=got["evals"],
                bytes_per_step=0, bytes_detail={"note": "one process: nothing sent"},
                bytes_measured=True, startup_s=None, default_target=task.default_target,
                rss={"trainer": got["max_rss"]}, versions=got["versions"],
                note="1 process, 1 thread; rowwise Adagrad lr 0.02 on the table")


def _columns(split, index) -> tuple:
    (dense, categorical), labels = split.rows(index) if index is not None else \
        (split.inputs, split.targets)
    return dense, categorical, labels


# ---------------------------------------------------------------------------- rows and table

def _row(baseline: str, setting: Setting, *, samples: int, train_seconds: float, evals: list,
         default_target: float, **extra) -> dict:
    target = setting.target or default_target
    hit = next((e for e in evals if e["auc"] >= target), None)
    return {"baseline": baseline, "task": setting.task, "rows": setting.rows,
            "table_rows": FEATURES * setting.rows,
            "table_bytes": FEATURES * setting.rows * DIM * 4, "setting": asdict(setting),
            "samples": samples, "train_seconds": train_seconds,
            "samples_per_second": samples / train_seconds,
            "final_auc": evals[-1]["auc"] if evals else None,
            "final_loss": evals[-1]["loss"] if evals else None,
            "target": target, "train_seconds_to_target": hit and hit["train_s"],
            "samples_to_target": hit and hit["samples"], "evals": evals, **extra}


def _skipped(baseline: str, setting: Setting, why: str) -> dict:
    return {"baseline": baseline, "task": setting.task, "rows": setting.rows,
            "table_rows": FEATURES * setting.rows, "setting": asdict(setting),
            "skipped": why}


def _mb(n) -> str:
    """Bytes in MiB, or in KiB (``K``) below one MiB."""
    if n is None or n == 0:
        return "—" if n is None else "0"
    return f"{n / 2 ** 20:,.1f}" if n >= 2 ** 20 else f"{n / 1024:,.1f} K"


def summarize(rows: list) -> list:
    """One row per (baseline, size) over its repeats: medians of samples/s, bytes per step,
    AUC and train seconds to target (over the repeats that reached it), the AUC's min and
    max, each process's peak RSS over every repeat, and every repeat's row in ``runs``.
    Where ddp_rpc ran at the same size: ``vs_ddp_rpc``, the ratio of the samples/s
    medians, and ``vs_ddp_rpc_each``, each repeat's against ddp_rpc's of the same seed."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["baseline"], r["rows"]), []).append(r)
    out = []
    for runs in groups.values():
        done = [r for r in runs if "skipped" not in r]
        if not done:
            out.append({**runs[0], "runs": runs})
            continue
        reached = [r["train_seconds_to_target"] for r in done
                   if r["train_seconds_to_target"] is not None]
        samples_to = [r["samples_to_target"] for r in done if r["samples_to_target"] is not None]
        aucs = [r["final_auc"] for r in done]
        rss: dict = {}
        for r in done:
            for name, value in r["rss"].items():
                rss[name] = max(rss.get(name, 0), value)
        first = {k: v for k, v in done[0].items() if k not in ("evals", "repeat", "wall_s")}
        rates = [r["samples_per_second"] for r in done]
        out.append({**first, "repeats": len(done),
                    "samples_per_second": statistics.median(rates),
                    "samples_per_second_min": min(rates), "samples_per_second_max": max(rates),
                    "bytes_per_step": statistics.median(r["bytes_per_step"] for r in done),
                    "final_auc": statistics.median(aucs), "auc_min": min(aucs),
                    "auc_max": max(aucs), "reached_target": len(reached),
                    "train_seconds_to_target": statistics.median(reached) if reached else None,
                    "samples_to_target": statistics.median(samples_to) if samples_to else None,
                    "rss": rss, "runs": runs})
    for row in out:  # against ddp_rpc, the pattern issue 41's speed target names
        rpc = next((r for r in out if r["baseline"] == "ddp_rpc" and r["rows"] == row["rows"]
                    and "skipped" not in r), None)
        if rpc is None or "skipped" in row or row is rpc:
            continue
        row["vs_ddp_rpc"] = row["samples_per_second"] / rpc["samples_per_second"]
        theirs = {r["setting"]["seed"]: r["samples_per_second"] for r in rpc["runs"]
                  if "skipped" not in r}
        row["vs_ddp_rpc_each"] = [r["samples_per_second"] / theirs[r["setting"]["seed"]]
                                  for r in row["runs"] if "skipped" not in r
                                  and r["setting"]["seed"] in theirs]
    return out


def table(summary: list) -> str:
    """The markdown table of ``summarize``'s rows."""
    lines = ["| baseline | table rows | samples/s | × ddp_rpc (each repeat) | bytes per step "
             "(MiB) | peak RSS per process (MiB) | AUC after 1 epoch | train s to target | "
             "samples to target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        if "skipped" in r:
            lines.append(f"| {r['baseline']} | {r['table_rows']:,} | skipped: {r['skipped']} "
                         "| | | | | | |")
            continue
        rss = ", ".join(f"{name} {_mb(v)}" for name, v in r["rss"].items())
        auc_ = f"{r['final_auc']:.4f}"
        if r["repeats"] > 1:
            auc_ += f" ({r['auc_min']:.4f}–{r['auc_max']:.4f})"
        to, samples_to = r["train_seconds_to_target"], r["samples_to_target"]
        reached = f", {r['reached_target']}/{r['repeats']} reached" if r["repeats"] > 1 else ""
        rate = f"{r['samples_per_second']:,.0f}"
        if r["repeats"] > 1:
            rate += f" ({r['samples_per_second_min']:,.0f}–{r['samples_per_second_max']:,.0f})"
        vs = "—"
        if "vs_ddp_rpc" in r:
            vs = f"{r['vs_ddp_rpc']:.2f}×"
            if len(r["vs_ddp_rpc_each"]) > 1:
                vs += " (" + ", ".join(f"{x:.2f}" for x in r["vs_ddp_rpc_each"]) + ")"
        lines.append(
            f"| {r['baseline']} | {r['table_rows']:,} | {rate} | {vs} | "
            f"{_mb(r['bytes_per_step'])}{'' if r['bytes_measured'] else ' (computed)'} | "
            f"{rss} | {auc_} | {'—' if to is None else f'{to:.1f}'} (AUC "
            f"{r['target']:g}{reached}) | {'—' if samples_to is None else f'{samples_to:,.0f}'} |")
    return "\n".join(lines)


SIZES = {  # rows per feature -> samples generated; the one table has 26 x rows rows
    10_000: 30_000,
    100_000: 30_000,
    384_616: 30_000,   # 10,000,016 rows x 16: the 640 MB table
}
# 100 ids per feature: a clear AUC in one short epoch (ddp_rpc 0.64; 200 ids, 3,000
# samples: 0.54 to 0.59 from run to run)
QUICK = {100: 6_000}
DENSE_UP_TO = 100_000   # asyncsgd-dense pushes 26 x rows x 16 floats a step: 166 MB here


def run_one(baseline: str, setting: Setting, args, runs: Path, tmp: Path, ctx) -> dict:
    """One baseline's row on one setting (skipped, with the reason, where it cannot run)."""
    t0 = time.monotonic()
    if baseline == "ddp_rpc":
        row = run_ddp_rpc(setting, ctx)
    elif baseline == "torchrec":
        row = run_torchrec(setting, args.torchrec_python, tmp)
    elif baseline == "asyncsgd-dense" and setting.rows > DENSE_UP_TO:
        push = _mb(FEATURES * setting.rows * DIM * 4)
        row = _skipped(baseline, setting, f"a dense push is {push} MiB: past "
                       f"{DENSE_UP_TO:,} rows per feature it does not fit")
    else:
        mode, mode_args = ASYNCSGD_RUNS[baseline]
        local = baseline == "asyncsgd-local"
        mode_args = tuple(a.format(H=args.local_steps) for a in mode_args)
        row = run_asyncsgd(baseline, setting, runs / f"{baseline}-{setting.rows}-s{setting.seed}",
                           mode=mode, mode_args=mode_args,
                           steps_per_update=args.local_steps if local else 1,
                           keep_checkpoints=args.keep_checkpoints)
    row["wall_s"] = time.monotonic() - t0
    print(f"{baseline} rows={setting.rows:,} seed {setting.seed}: " + (
        row["skipped"] if "skipped" in row else
        f"{row['samples_per_second']:,.0f} samples/s, AUC {row['final_auc']:.4f}"), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:5]))
    ap.add_argument("--quick", action="store_true",
                    help="ctr:rows=100, 6,000 samples: every baseline in < 60 s; saves nothing")
    ap.add_argument("--only", default=",".join(BASELINES),
                    help=f"comma-separated baselines of {', '.join(BASELINES)}")
    ap.add_argument("--rows", default=None,
                    help="comma-separated ids per feature (default: "
                         f"{', '.join(map(str, SIZES))}; --quick: 100)")
    ap.add_argument("--samples", type=int, default=None, help="generated samples per size")
    ap.add_argument("--batch", type=int, default=32,
                    help="samples per step of each worker/trainer (the task's: 32)")
    ap.add_argument("--local-steps", type=int, default=LOCAL_STEPS,
                    help=f"asyncsgd-local's H (default {LOCAL_STEPS})")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="steps of one worker between evaluations (default 100, --quick 20)")
    ap.add_argument("--torchrec-python", default=TORCHREC_PYTHON,
                    help="the interpreter of a venv with torchrec and fbgemm-gpu-cpu")
    ap.add_argument("--runs", default=None, help="where asyncsgd's run directories go")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep each asyncsgd run's checkpoints (deleted once read: a run on "
                         "the 10^7-row table leaves 1.3 GB)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of every row, seeds 0, 1, ...; medians reported (default 3, "
                         "--quick 1)")
    ap.add_argument("--json", default=None,
                    help="also write the rows (each with its repeats' rows) to this file")
    ap.add_argument("--no-save", action="store_true", help="leave experiments/results alone")
    args = ap.parse_args()
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(only) - set(BASELINES))
    if unknown:
        ap.error(f"--only {','.join(unknown)}: choose from {', '.join(BASELINES)}")
    sizes = QUICK if args.quick else SIZES
    if args.rows:
        sizes = {int(r): sizes.get(int(r), 30_000) for r in args.rows.split(",")}
    if args.samples:
        sizes = {r: args.samples for r in sizes}
    eval_every = args.eval_every or (20 if args.quick else 100)
    args.repeats = args.repeats or (1 if args.quick else 3)
    runs = Path(args.runs or f"runs/sparse-ps-{time.strftime('%Y%m%d-%H%M%S')}")
    ctx = start_context("forkserver", ["sparse_ps"]) if "ddp_rpc" in only else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparse-ps-") as tmp:
        for repeat in range(args.repeats):   # repeats outermost: drift hits every row alike
            for n_rows, samples in sizes.items():
                setting = Setting(n_rows, samples, batch=args.batch, eval_every=eval_every,
                                  seed=repeat)
                for baseline in only:
                    rows.append(run_one(baseline, setting, args, runs, Path(tmp), ctx))
                    rows[-1]["repeat"] = repeat
    summary = summarize(rows)
    md = table(summary)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    if not (args.quick or args.no_save):
        command = " ".join(["python experiments/sparse_ps.py", *sys.argv[1:]])
        save_results(NAME, f"# Sparse tables: the baselines\n\nRun by `{command}`, "
                     f"{time.strftime('%Y-%m-%d %H:%M')}.\n\n{md}", summary)
    return 0


if __name__ == "__main__":
    # Run under the module's own name, so that the PS and the trainers (which import
    # sparse_ps, not __main__) find CtrTable and _run_trainer.
    import sparse_ps
    sys.exit(sparse_ps.main())
