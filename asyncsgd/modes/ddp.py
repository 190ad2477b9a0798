"""``asyncsgd ddp``: synchronous data-parallel SGD with DistributedDataParallel.

Spawns ``--procs`` ranks here (this process supervises them), or is one rank under torchrun;
every rank runs the synchronous loop (``modes.syncloop``) with DDP's hooks (``modes.ddp_hooks``).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch

from .. import errors
from ..config import DDPConfig
from ..core.pacing import Pacing
from ..core.tasks import Task, task_of
from ..errors import AsyncSGDError, CallbackError, ConfigError, WorkerError
from ..run.child_reports import ChildReports, send_report, tail
from ..run.process_group import WorkerGroup, available_cores, threads_per_process
from ..run.recorder import Outcome, Recorder, RunResult, check_target
from ..run.rundir import METRICS, RunDir
from ..run.sendable import check_sendable
from ..run.sinks import EvalFollower, attached_sinks
from .balancing import check_balance
from .ddp_hooks import DDPComm, check_hooks
from .syncloop import check_settings, train_process

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25
STOP_GRACE = 30.0  # seconds rank 0 gets to stop every rank and save the run
OTHERS_GRACE = 5.0  # then the other ranks get this long before SIGTERM, SIGKILL
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Placement:
    """Where one rank stands: in the group, on its host, and how it joins the group."""

    rank: int
    world: int
    local_rank: int
    backend: str
    threads: int
    store_port: Optional[int] = None  # spawned here: the parent's store; else env://


def launched_by_torchrun(env: Optional[dict] = None) -> Optional[dict]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from a launcher, or None to spawn here."""
    env = os.environ if env is None else env
    present = [k for k in LAUNCHER_VARS if env.get(k, "").strip()]
    if not present:
        return None
    if len(present) < len(LAUNCHER_VARS):
        missing = [k for k in LAUNCHER_VARS if k not in present]
        raise ConfigError(f"${', $'.join(present)} set but ${', $'.join(missing)} not: run under "
                          f"torchrun (which sets all of {', '.join(LAUNCHER_VARS)}), or unset "
                          f"{', '.join(present)} to spawn the ranks here with --procs")
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = env.get(name, "").strip()
        if raw:
            try:
                values[name] = int(raw)
            except ValueError:
                raise ConfigError(f"${name}={raw!r} is not an integer") from None
    values.setdefault("LOCAL_RANK", values["RANK"])
    values.setdefault("LOCAL_WORLD_SIZE", values["WORLD_SIZE"])
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ConfigError(f"$RANK={values['RANK']} is outside 0..{values['WORLD_SIZE'] - 1} "
                          f"($WORLD_SIZE={values['WORLD_SIZE']})")
    return values


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(cfg: DDPConfig, local_procs: int) -> tuple:
    """(backend, why): nccl only with --device cuda and one GPU per process on this host."""
    import torch.distributed as dist
    gpus = _gpus()
    if cfg.backend == "nccl":
        if gpus == 0:
            raise ConfigError("--backend nccl: no CUDA GPU is visible to torch; use "
                              "--backend gloo (or auto) to train on CPU")
        if cfg.device != "cuda":
            raise ConfigError("--backend nccl all-reduces CUDA tensors: add --device cuda, "
                              "or use --backend gloo")
        if gpus < local_procs:
            raise ConfigError(f"--backend nccl needs one GPU per process: {local_procs} "
                              f"processes on this host but {gpus} GPU(s); use --procs {gpus} "
                              "or --backend gloo")
        if not dist.is_nccl_available():
            raise ConfigError("--backend nccl: this torch build has no NCCL; use --backend gloo")
        return "nccl", "--backend nccl"
    if cfg.backend == "gloo":
        return "gloo", "--backend gloo"
    if cfg.device != "cuda":
        return "gloo", "auto: --device cpu"
    if gpus >= local_procs and dist.is_nccl_available():
        return "nccl", f"auto: {gpus} GPU(s) for {local_procs} process(es)"
    return "gloo", (f"auto: {local_procs} processes share {gpus} GPU(s)" if gpus
                    else "auto: no NCCL in this torch build")


def _check_model(task: Task, cfg: DDPConfig, backend: str) -> None:
    check_hooks(cfg, backend)
    model = task.build_model(cfg.seed)
    if backend == "nccl" and any(getattr(m, "sparse", False) for m in model.modules()):
        raise ConfigError(f"task {task.name} has sparse gradients, which DDP all-reduces only "
                          "with gloo; use --backend gloo")


def _announce(cfg: DDPConfig, procs: int, threads: int, backend: str, why: str) -> None:
    """Say which backend was picked: it decides the speed, and auto may surprise."""
    line = (f"ddp: {procs} processes x {threads} thread(s), backend {backend} ({why}), "
            f"device {cfg.device}, amp {cfg.amp}")
    log.info("%s", line)
    if cfg.progress != "off":
        sys.stderr.write(f"[{line}]\n")
        sys.stderr.flush()


def train(cfg: DDPConfig, task: Optional[Task] = None,
          argv: Optional[list] = None) -> Optional[RunResult]:
    """Run DDP as configured. Spawned here, or as rank 0 under torchrun: the RunResult;
    as another rank under torchrun: None."""
    check_settings(cfg)
    launcher = launched_by_torchrun()
    if launcher is not None:
        return _train_as_launched_rank(cfg, launcher, task, argv)
    procs = cfg.procs or (_gpus() if cfg.device == "cuda" else available_cores())
    Pacing.parse(cfg.slowdown, cfg.delay).check_ranks(procs, "--procs")  # before any rank
    backend, why = choose_backend(cfg, procs)
    run = Recorder.open_run(cfg)
    with run.removed_on_error():
        task = task or task_of(cfg)
        check_sendable(task, "DDP ranks")
        _check_model(task, cfg, backend)
        check_balance(cfg, procs, cfg.batch_size or task.batch_size)
        check_target(cfg, task)  # before any rank starts
    threads = threads_per_process(procs, cfg.threads)
    task.share_memory_()  # every rank reads the same pages instead of a pickled copy
    from torch.distributed import TCPStore
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=cfg.dist_timeout))
    control = torch.zeros(1, dtype=torch.int64).share_memory_()
    user_errors = ChildReports(procs)  # pipes, not a queue: see run.child_reports
    started_at = time.monotonic()
    places = [Placement(rank, procs, rank, backend, threads, store.port)
              for rank in range(procs)]
    group = WorkerGroup(_spawned_rank, procs, name="rank", start_method=cfg.start_method,
                        args=[(cfg, task, places[r], str(run.path), started_at, control,
                               user_errors.writer(r), argv) for r in range(procs)])
    _announce(cfg, procs, threads, backend, why)
    try:
        return _supervise(group, control, user_errors, run)
    finally:
        user_errors.close()
        del store  # closes the rendezvous port, now that every rank has gone


def _train_as_launched_rank(cfg: DDPConfig, launcher: dict, task: Optional[Task],
                            argv: Optional[list]) -> Optional[RunResult]:
    rank, world = launcher["RANK"], launcher["WORLD_SIZE"]
    if cfg.procs is not None and cfg.procs != world:
        raise ConfigError(f"--procs {cfg.procs} contradicts the launcher's $WORLD_SIZE={world}; "
                          "under torchrun leave --procs out (--nproc-per-node decides)")
    Pacing.parse(cfg.slowdown, cfg.delay).check_ranks(world, "WORLD_SIZE")
    backend, why = choose_backend(cfg, launcher["LOCAL_WORLD_SIZE"])
    run = Recorder.open_run(cfg) if rank == 0 else None
    task = task or task_of(cfg)
    _check_model(task, cfg, backend)
    check_balance(cfg, world, cfg.batch_size or task.batch_size)
    check_target(cfg, task)  # every rank: each fails alike instead of waiting for rank 0
    threads = threads_per_process(launcher["LOCAL_WORLD_SIZE"], cfg.threads)
    if rank == 0:
        _announce(cfg, world, threads, backend, why)
    place = Placement(rank, world, launcher["LOCAL_RANK"], backend, threads)
    return run_rank(cfg, task, place, run, flag_signals=True, argv=argv)


def run_rank(cfg: DDPConfig, task: Task, place: Placement, run: Optional[RunDir], *,
             flag_signals: bool, stop_requested=lambda: False, started_at: Optional[float] = None,
             argv: Optional[list] = None) -> Optional[RunResult]:
    """One rank: join the process group (finite timeout), train, leave the group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(place.threads)
    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", place.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.dist_timeout)
    if place.store_port is not None:
        store = dist.TCPStore("127.0.0.1", place.store_port, is_master=False, timeout=timeout)
        dist.init_process_group(place.backend, store=store, rank=place.rank,
                                world_size=place.world, timeout=timeout)
    else:
        dist.init_process_group(place.backend, init_method="env://", rank=place.rank,
                                world_size=place.world, timeout=timeout)
    log.info("rank %d of %d joined the process group (%s, %s, %d thread(s))", place.rank,
             place.world, place.backend, device, place.threads)

    def agree(vector: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(vector)
        return vector

    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        return DistributedDataParallel(model, device_ids=[device.index] if device.index is not
                                       None else None)

    try:
        return train_process(cfg, task, device=device, rank=place.rank, world=place.world,
                             run=run, wrap=wrap, agree=agree, flag_signals=flag_signals,
                             stop_requested=stop_requested, started_at=started_at, argv=argv,
                             name=f"rank {place.rank}",
                             comm=DDPComm(cfg.comm_hook, cfg.local_steps, cfg.local_warmup,
                                          place.world),
                             extra={"backend": place.backend, "threads": place.threads,
                                    "device": cfg.device, "comm_hook": cfg.comm_hook,
                                    "local_steps": cfg.local_steps})
    finally:
        dist.destroy_process_group()
        # DDP's wrapper and its reducer sit in reference cycles with the group's work
        # objects; left to the interpreter's shutdown, their C++ side can abort the process
        # (SIGABRT) after a run that trained and saved (experiments/README.md, "The
        # synchronous modes"). Freed now, while the interpreter is whole.
        gc.collect()


def _spawned_rank(rank: int, cfg: DDPConfig, task: Task, place: Placement, run_path: str,
                  started_at: float, control: torch.Tensor, user_errors, argv) -> None:
    """A rank spawned by ``train``: errors a user can fix go back to the parent as such."""
    try:
        run_rank(cfg, task, place, RunDir(run_path) if rank == 0 else None, flag_signals=False,
                 stop_requested=lambda: bool(control[0]), started_at=started_at, argv=argv)
    except WorkerError as exc:
        if exc.__cause__ is not None:  # rank 0 saved the run; the parent wants the cause
            raise exc.__cause__ from None
        raise
    except AsyncSGDError as exc:  # e.g. --resume of a run that does not fit
        send_report(user_errors, (type(exc).__name__, tail(str(exc), 4000)))
        raise


def _wait_for_rank_0(group: WorkerGroup) -> None:
    """Give rank 0 time to stop the others and save the run; once it has, a rank still
    running has nothing to save (it may hang in a collective with a dead peer)."""
    rank_0 = group.processes[0]
    deadline = time.monotonic() + STOP_GRACE
    while rank_0.pid is not None and rank_0.exitcode is None and time.monotonic() < deadline:
        group.wait(POLL_SECONDS)


def _supervise(group: WorkerGroup, control: torch.Tensor, user_errors: ChildReports,
               run: RunDir) -> RunResult:
    """Wait for the ranks; on Ctrl-C/SIGTERM or a failure have rank 0 stop them and save."""
    outcome = Outcome("epochs")
    # the API's on_eval callbacks live in this process; rank 0 writes the records
    follow = EvalFollower(run.path / METRICS, attached_sinks())
    try:
        with outcome.watch():
            group.start()
            user_errors.handed_over()
            while not group.wait(POLL_SECONDS):
                group.check()
                if follow.poll():
                    break  # a callback failed: rank 0 stops every rank and saves
            group.check()
    finally:
        control[0] = 1  # rank 0 stops every rank at its next check (a no-op once done)
        _wait_for_rank_0(group)
        group.stop(grace=OTHERS_GRACE)
    if outcome.error is None:
        try:
            group.check()
        except WorkerError as exc:  # failed while the others were stopping
            outcome.failed(exc)
    user_errors.drain()
    first = user_errors.first(range(len(group.processes)))
    if first is not None:
        name, message = user_errors.get(first)
        raise getattr(errors, name, AsyncSGDError)(message)
    summary = run.read_summary() if (run.path / "summary.json").exists() else None
    if outcome.error is not None:
        if summary is not None:  # rank 0 may have seen only a lost peer: record the cause
            run.write_summary({**summary, "status": "failed", "stopped_by": "error",
                               "error": str(outcome.error)})
        raise outcome.error
    if summary is None:
        raise WorkerError(0, f"rank 0 ended without writing {run.path / 'summary.json'}")
    try:
        follow.end(summary)
    except CallbackError as exc:
        run.write_summary({**summary, "status": "failed", "stopped_by": "error",
                           "error": str(exc)})
        raise
    return RunResult(str(run.path), summary)
