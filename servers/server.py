"""``asyncsgd ps-server``: a sharded parameter server.

    asyncsgd ps-server --task mnist1d-cnn --bind tcp://0.0.0.0:5555

The parent process is the front (``front.py``) and evaluator (``evaluator.py``); the shards
(``shard_process.py``) are processes of its own, which workers push to and pull from directly.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Callable, Optional

import torch
import zmq

from asyncsgd.config import ServerConfig
from asyncsgd.config.values import parse_evict
from asyncsgd.core.balance import global_counts
from asyncsgd.core.coverage import of_partitions, of_samples
from asyncsgd.core.schedule import schedule
from asyncsgd.core.signature import data_signature
from asyncsgd.core.tasks import task_of
from asyncsgd.errors import ConfigError
from asyncsgd.run.audit import make_audit_dir
from asyncsgd.run.process_group import available_cores
from asyncsgd.run.recorder import Outcome, Recorder, RunResult, check_target
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.memory import keep_freed_memory
from asyncsgd.wire.protocol import Key
from asyncsgd.wire.security import ServerKeys, exposed_warning
from asyncsgd.wire.transport import parse_endpoint

from .evaluator import Evaluator
from .front import Front
from .sessions import Sessions
from .sharding import shard_count
from .supervisor import ShardSupervisor

log = logging.getLogger(__name__)

POLL_MS = 100
SHARD_STOP_GRACE = 15.0  # a shard saves its checkpoint, then drains (1.5 to 8 s): slow under load


def serve(cfg: ServerConfig, argv: Optional[list] = None,
          on_listening: Optional[Callable[[str, str], None]] = None,
          beside: int = 0) -> RunResult:
    """Run the parameter server until a stop condition; returns its run directory and summary.

    ``on_listening(endpoint, run_dir)`` is called once the front and every shard listen
    (a launcher publishes the address there: ``asyncsgd.jobs``). ``beside``: worker
    processes a launcher placed on this host, which the default ``--threads`` leaves
    cores to.

    Start-up: check the settings, open the run and build the model, bind the
    front (before anything slow starts, so a taken port fails at once), start
    the shards. Serving: until a stop condition. Shutdown: stop the shards,
    close every socket, then conclude the run (final evaluation, checkpoint,
    summary.json), also after Ctrl-C or a failure.
    """
    if cfg.backup_workers and (cfg.consistency.kind != "sync" or (
            cfg.backup_workers != "auto" and cfg.backup_workers >= cfg.workers)):
        raise ConfigError(
            f"--backup-workers {cfg.backup_workers}: backup workers are those a sync round "
            f"does not wait for, so it needs --consistency sync (got {cfg.consistency}) and "
            f"fewer than --workers ({cfg.workers})")
    if cfg.balance == "batch" and (cfg.consistency.kind != "sync" or cfg.sync_reduce != "mean"):
        raise ConfigError(f"--balance batch sizes the batches of sync rounds: it needs "
                          f"--consistency sync and --sync-reduce mean (got {cfg.consistency}, "
                          f"{cfg.sync_reduce}); drop --balance for {cfg.consistency}")
    if cfg.balance == "batch" and cfg.data_dispatch == "dynamic":
        raise ConfigError("--balance batch already hands every worker its rows of one global "
                          "order (each row once an epoch): drop --data-dispatch dynamic")
    schedule(1.0, cfg.lr_schedule, cfg.warmup, counted="updates")  # refused before any work
    host, _ = parse_endpoint(cfg.bind, "--bind")
    keys = ServerKeys.load(cfg.curve_secret, cfg.allowed_clients)
    if cfg.audit_dir:  # each shard writes its own file there
        make_audit_dir(cfg.audit_dir)
    keep_freed_memory()
    run = Recorder.open_run(cfg)
    with run.removed_on_error():
        task = task_of(cfg)
        check_target(cfg, task)
        model = task.build_model(cfg.seed)
    recorder = Recorder(cfg, task, model, run, argv=argv)
    layout = Layout.of(model, task.served_tables(model, cfg.embeddings))
    _check_tables(cfg, layout)
    data = data_signature(task, cfg.task, cfg.seed)  # what a worker's data must match
    ranges = layout.shard_ranges(shard_count(cfg.shards, layout.total, cfg.workers,
                                             available_cores(),
                                             resumed=run.path if cfg.resume else None))
    lr = cfg.lr or task.lr
    torch.set_num_threads(max(1, cfg.threads or 1))
    warning = exposed_warning(host, keys)
    if warning:
        log.warning(warning)

    sessions = Sessions.new()  # a new key at every start: old tokens are refused
    ctx = zmq.Context()
    try:
        front = Front.listen(ctx, cfg, layout, data, keys, sessions)
    except BaseException:
        ctx.term()
        raise
    # --balance batch: the global batch is the per-worker batch (the task's by default) x workers
    sized = dataclasses.replace(cfg, batch_size=cfg.batch_size or task.batch_size)
    weights = tuple(model.get_parameter(t.name).detach() for t in layout.tables)
    supervisor = ShardSupervisor.for_server(sized, layout.flatten(model), ranges, lr, host,
                                            str(run.path), keys, sessions.key, beside,
                                            train_rows=len(task.train), tables=layout.tables,
                                            weights=weights)
    del weights
    evaluator = Evaluator(model, layout, recorder, task.test, cfg.id_space)
    outcome = Outcome("workers_done")
    summary: dict = {}
    try:
        with outcome.watch():
            shards = supervisor.start()
            evaluator.connect(ctx, host, shards, keys.as_client() if keys else None)
            if not cfg.resume:  # as each shard does: resumable from the start (ps-job
                # restarts a server killed before its first periodic checkpoint from here)
                recorder.checkpoint(evaluator.samples, 0)
            front.open(shards, shard_stats=lambda: evaluator.latest)
            log.info("serving %s on %s: %d shard(s) on ports %s, %s", task.name, front.endpoint,
                     len(shards), [s[Key.PORT] for s in shards], cfg.consistency)
            recorder.progress.label = f"ps {cfg.consistency}"
            if on_listening is not None:
                on_listening(front.endpoint, str(run.path))
            evaluator.evaluate_start()
            outcome.stopped_by = _serve_until_stopped(cfg, front, supervisor, evaluator,
                                                      recorder)
        with outcome.watch():  # also after Ctrl-C; a second one keeps what is known by then
            obs = _final_observation(evaluator, supervisor, recorder)
            if obs is not None:
                summary = _summary(cfg, lr, obs, front, supervisor, evaluator)
                summary.update(_coverage(cfg, evaluator.latest, len(task.train)))
    finally:
        supervisor.stop_all(grace=SHARD_STOP_GRACE, all_left=front.everyone_left())
        evaluator.close()
        front.close()
        ctx.term()
    return recorder.conclude(evaluator.samples, 0, outcome, **summary)


def _check_tables(cfg: ServerConfig, layout: Layout) -> None:
    """Settings of tables served by row that cannot work, refused before anything starts."""
    evict = parse_evict(cfg.evict)
    if evict[0] != "none" and cfg.id_space != "hashed":
        raise ConfigError(f"--evict {cfg.evict} bounds the rows of a hashed table: it needs "
                          "--id-space hashed (a fixed id space holds every row from the start)")
    if not layout.tables and (cfg.id_space != "fixed" or evict[0] != "none"):
        raise ConfigError(f"--id-space {cfg.id_space} --evict {cfg.evict}: task {cfg.task} "
                          f"serves no table by row (--embeddings {cfg.embeddings}); drop them")


def _serve_until_stopped(cfg: ServerConfig, front: Front, supervisor: ShardSupervisor,
                         evaluator: Evaluator, recorder: Recorder) -> str:
    """Answer workers, restart crashed shards, evaluate when due; what stopped it."""
    while True:
        front.serve(POLL_MS)
        supervisor.check()
        if recorder.eval_due() and not recorder.out_of_time(then=recorder.eval_seconds):
            try:
                evaluator.evaluate()
            except TimeoutError as exc:  # a shard died meanwhile: restart, evaluate later
                log.warning("evaluation skipped: %s", exc)
                continue
            if recorder.target_reached():
                return "target"
        if recorder.out_of_time():
            log.info("stopping at %.2f s of --max-seconds %g: %.2f s set aside for the final "
                     "evaluation, checkpoint, pull of every row and the shards' saves",
                     recorder.elapsed(), cfg.max_seconds, recorder.reserve())
            return "max_seconds"
        if cfg.exit_when_done and front.joined and front.all_left():
            return "workers_done"
        recorder.checkpoint_if_due(evaluator.samples, 0)


def _final_observation(evaluator: Evaluator, supervisor: ShardSupervisor,
                       recorder: Recorder) -> Optional[dict]:
    """The shards' parameters and counters as the run stops, into the evaluator's model for
    the final evaluation and checkpoint.pt (a Ctrl-C may come long after the last
    evaluation); where a shard is down, what the last evaluation saw; None before any.
    Every row of the tables is pulled for the saved model: a progress line says so first
    (its time, as reckoned, was set aside before --max-seconds)."""
    if not evaluator.latest:
        return None  # stopped before the shards first answered
    why = "a shard is down"
    if supervisor.all_running():
        rows = evaluator.every_row_count()
        if rows:
            note = (f"saving: pulling the tables' {rows:,} rows for checkpoint.pt (about "
                    f"{evaluator.every_row_seconds():.1f} s)")
            log.info("%s", note)
            recorder.show(evaluator.samples, evaluator.rate, force=True, note=note)
        try:
            began = recorder.elapsed()
            obs = evaluator.observe(every_row=True)  # the saved model: its whole tables
            if rows:
                log.info("pulled the tables' %d rows in %.2f s", rows,
                         recorder.elapsed() - began)
            return obs
        except TimeoutError as exc:
            why = str(exc)
    log.warning("%s: the run is saved as the last evaluation saw it", why)
    return evaluator.last_observation()


def _summary(cfg: ServerConfig, lr: float, obs: dict, front: Front, supervisor: ShardSupervisor,
             evaluator: Evaluator) -> dict:
    """What summary.json adds for a parameter server."""
    dc = {} if cfg.dc_asgd is None else {  # pushes whose worker's copy was given up
        "dc_uncompensated": sum(s.get("dc_uncompensated", 0) for s in evaluator.latest)}
    # sync: pushes that came after their round was applied (a backup worker's, or one that
    # missed a round), acknowledged and not applied; summed over shards, as updates are
    stale = {} if cfg.consistency.kind != "sync" else {
        "stale_pushes": sum(s.get("stale", 0) for s in evaluator.latest)}
    # --local-steps auto: each worker's H as shard 0 last set it (DyLU)
    dylu = {"local_steps": evaluator.latest[0]["local_steps"]} \
        if evaluator.latest and evaluator.latest[0].get("local_steps") else {}
    # --early-parts: pushes in parts applied as their parts came, and those undone (a part
    # failed, or another write came first); summed over shards, nothing when none went early
    early = {key: sum(s.get(f"early_{key}", 0) for s in evaluator.latest)
             for key in ("pushes", "undone")}
    early = {"early_parts": early} if early["pushes"] else {}
    return {**dc, **stale, **dylu, **early, **_tables(evaluator.latest),
            "updates": obs["updates"], "staleness_p50": obs["staleness_p50"],
            "staleness_p99": obs["staleness_p99"], "staleness_hist": obs["staleness_hist"],
            "shards": len(supervisor.settings), "consistency": cfg.consistency,
            "optimizer": cfg.optimizer, "lr": lr, "workers_joined": sorted(front.joined),
            "refused_handshakes": front.refused,
            "refused_connections": front.stats()["refused_connections"],
            "shard_restarts": supervisor.restarts,
            **({"balance": evaluator.latest[0]["balance"]}
               if evaluator.latest and "balance" in evaluator.latest[0] else {}),
            "lost_updates": sum(s.get("lost_updates", 0) for s in evaluator.latest),
            "wire": _wire_formats(evaluator.latest),
            "worker_bytes": {name: {"sent": sent, "received": received} for name, (sent, received)
                             in sorted(evaluator.latest[0].get("traffic", {}).items())}
            if evaluator.latest else {}}


def _tables(shards: list) -> dict:
    """Tables served by row, over every shard: per table rows held, created, evicted and
    bytes, and the rows pulled and pushed; nothing for a model without them."""
    tables: dict = {}
    for stats in shards:
        for name, counts in stats.get("tables", {}).items():
            into = tables.setdefault(name, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                into[key] = into.get(key, 0) + value
    if not tables:
        return {}
    return {"tables": tables, **{key: sum(s.get(key, 0) for s in shards)
                                 for key in ("rows_pulled", "rows_pushed")}}


def _coverage(cfg: ServerConfig, shards: list, rows: int) -> dict:
    """summary.json's coverage: shard 0's per-row counts under dynamic dispatch, the rounds'
    rows of the global order under --balance batch; under static
    each worker's samples over its partition's rows (a worker named HOST-rRANK, as workers
    name themselves, trains partition RANK of --workers: tensor_split's sizes)."""
    if not shards:
        return {}
    if "dispatch" in shards[0]:
        dispatch = shards[0]["dispatch"]
        return {"coverage": dispatch["coverage"], "rehanded": dispatch["rehanded"],
                "unattributed": dispatch["unattributed"]}
    if "balance" in shards[0]:  # whole global batches of one order: its rounds say which rows
        if cfg.backup_workers:  # a round closed without a push lost that push's rows: unknown
            return {}
        balance = shards[0]["balance"]
        return {"coverage": of_samples(global_counts(rows, balance["global_batch"],
                                                     balance["rounds"]))}
    samples, sizes = [], []
    for name, (_, _, trained) in sorted(shards[0].get("train", {}).items()):
        found = re.fullmatch(r".*-r(\d+)", name)
        if found and int(found.group(1)) < cfg.workers:
            rank = int(found.group(1))
            samples.append(trained)
            sizes.append(rows // cfg.workers + (rank < rows % cfg.workers))
    return {"coverage": of_partitions(samples, sizes), "rehanded": 0} if samples else {}


def _wire_formats(shards: list) -> dict:
    """How each worker's latest push and pulls travelled (the shards' stats name the 32
    most recently seen): {worker: {"push": float32|bfloat16|float16|int8|topk, "pull":
    float32|bfloat16|float16}}."""
    seen: dict = {}
    for stats in shards:
        for name, w in stats.get("workers", {}).items():
            if "push_format" in w:
                seen[name] = {"push": w["push_format"], "pull": w["pull_dtype"]}
    return dict(sorted(seen.items()))
