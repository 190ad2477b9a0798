"""The shard processes of a server: started, awaited, and restarted on their port from their
last checkpoint when they crash, so workers reconnect and re-send on their own.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Optional

import torch

from asyncsgd.config import ServerConfig
from asyncsgd.config.values import parse_evict
from asyncsgd.core.dispatch import CHUNK
from asyncsgd.errors import WorkerError
from asyncsgd.run.process_group import WorkerGroup, available_cores, context
from asyncsgd.wire.protocol import Key
from asyncsgd.wire.security import ServerKeys

from .shard import ShardConfig
from .shard_tables import table_rule
from .shard_process import STOP, STOP_ALL_LEFT, ShardProcessSettings, shard_main

log = logging.getLogger(__name__)

# A shard that is alive but not listening yet is still starting (importing torch): waited
# for, with a note every SHARD_NOTE_SECONDS, up to SHARD_READY_SECONDS; one that died fails
# at once. 60 s was once too little: a ray-job's shard beside 4 busy processes on 2 cores.
SHARD_READY_SECONDS = 600
SHARD_NOTE_SECONDS = 30
SHARD_EXIT_SECONDS = 10  # for a shard whose pipe closed to finish exiting (its exit code)


class ShardSupervisor:
    def __init__(self, settings: list, initial: list, restarts: int):
        """``settings`` and ``initial`` parameters of each shard process."""
        self.settings: list = list(settings)
        self.initial, self.restarts_left = initial, restarts
        self.stop = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.restarts = 0
        self.ready: list = [None] * len(settings)
        # A launcher's SIGTERM to the server's process group (torchrun restarting the job,
        # scancel) must not kill the shards before they drain and save: the server stops them.
        self.group = WorkerGroup(shard_main, len(settings), name="shard",
                                 args=[self._args(i) for i in range(len(settings))],
                                 ignore_sigterm=True)

    def _args(self, i: int) -> tuple:
        receive, send = context("spawn").Pipe(duplex=False)
        self.ready[i] = receive
        return (self.settings[i], self.initial[i], send, self.stop)

    @classmethod
    def for_server(cls, cfg: ServerConfig, flat: torch.Tensor, ranges: list, lr: float,
                   host: str, checkpoint_dir: str,
                   keys: Optional[ServerKeys], session_key: bytes,
                   beside: int = 0, train_rows: int = 0, tables: tuple = (),
                   weights: tuple = ()) -> "ShardSupervisor":
        """The shards of ``ps-server``: shard i owns ``flat[ranges[i]]`` and applies the
        configured rule to it, listening on ``host``, checkpointing into ``checkpoint_dir``;
        by default the host's cores are shared among the shards, the front and ``beside``
        other processes (workers a launcher placed here). --data-dispatch dynamic: shard 0
        hands out the ``train_rows`` training rows. ``tables``: the layout's tables served by
        row, whose ``weights`` (the model's) shard i starts from at ids i, i + shards, ...
        in a fixed id space; in a hashed one their std sets the scale of the seeded rows."""
        hyper = {"weight_decay": cfg.weight_decay}
        if cfg.optimizer in ("momentum", "nesterov", "delayed-nesterov"):
            hyper["momentum"] = cfg.momentum
        if cfg.optimizer == "delayed-nesterov":
            hyper["period"] = cfg.nesterov_period or cfg.workers
        dispatch = ((train_rows, cfg.epochs, cfg.seed, CHUNK)
                    if cfg.data_dispatch == "dynamic" else None)
        threads = max(1, cfg.threads or available_cores() // (len(ranges) + 1 + beside))
        settings = [ShardProcessSettings(
            config=ShardConfig(
                index=i, start=start, end=end, rule=cfg.optimizer, lr=lr, hyper=hyper,
                table_lr=cfg.table_lr,
                consistency=cfg.consistency, expected_workers=cfg.workers,
                heartbeat_timeout=cfg.heartbeat_timeout, staleness_lr=cfg.staleness_lr,
                dc_lambda=cfg.dc_asgd, sync_reduce=cfg.sync_reduce,
                backup_workers=cfg.backup_workers, balance=cfg.balance,
                balance_every=cfg.balance_every, min_batch=cfg.min_batch or 0,
                batch_size=cfg.batch_size or 0,
                reject_nonfinite=not cfg.allow_nonfinite, max_grad_norm=cfg.max_grad_norm,
                early_parts=cfg.early_parts == "on" or (cfg.early_parts == "auto"
                                                        and threads >= 2),
                dispatch=dispatch if i == 0 else None, lr_schedule=cfg.lr_schedule,
                warmup=cfg.warmup),
            bind_host=host, port=0, checkpoint_dir=checkpoint_dir,
            checkpoint_every=cfg.checkpoint_every, resume=bool(cfg.resume), threads=threads,
            curve=keys, session_key=session_key, busy_poll_us=cfg.busy_poll_us,
            record_digests=cfg.record_digests, audit_dir=cfg.audit_dir,
            tables=tuple(tables), shards=len(ranges), id_space=cfg.id_space,
            evict=parse_evict(cfg.evict), table_rule=table_rule(cfg.optimizer,
                                                                cfg.table_optimizer),
            table_seed=cfg.seed,
            # uniform in [-s, s) has std s / sqrt(3): the hashed rows spread as the model's
            table_scales=tuple(float(w.std()) * math.sqrt(3) if w.numel() > 1 else 0.01
                               for w in weights))
            for i, (start, end) in enumerate(ranges)]
        fixed = cfg.id_space == "fixed"
        initial = [(flat[start:end].clone(),
                    [w[i::len(ranges)].clone() for w in weights] if fixed else None)
                   for i, (start, end) in enumerate(ranges)]
        return cls(settings, initial, cfg.shard_restarts)

    def start(self) -> list:
        """Start every shard; once each listens, [{port, start, end}] as a welcome lists them."""
        self.group.start()
        return [{Key.PORT: self._await_port(i), Key.START: s.config.start, Key.END: s.config.end}
                for i, s in enumerate(self.settings)]

    def _await_port(self, i: int) -> int:
        waited = 0
        while not self.ready[i].poll(SHARD_NOTE_SECONDS):
            self.group.check()  # a shard that died: its error now
            waited += SHARD_NOTE_SECONDS
            if waited >= SHARD_READY_SECONDS:
                raise WorkerError(i, f"shard {i} did not start within {SHARD_READY_SECONDS} s")
            log.warning("shard %d is still starting after %d s (a busy machine?); waiting up "
                        "to %d s", i, waited, SHARD_READY_SECONDS)
        try:
            port = self.ready[i].recv()
        except EOFError:  # it exited before it listened: its error, not an EOFError
            self.group.processes[i].join(SHARD_EXIT_SECONDS)
            self.group.check()
            raise WorkerError(i, f"shard {i} exited before it listened, without an error "
                                 "of its own (was it killed? see the system log for the "
                                 "out-of-memory killer)") from None
        self.settings[i] = dataclasses.replace(self.settings[i], port=port)
        return port

    def check(self) -> None:
        """Restart crashed shards from their checkpoints; a WorkerError once out of restarts."""
        for i in self.group.failed():
            if self.restarts_left <= 0:
                self.group.check()
            self.restarts_left -= 1
            self.restarts += 1
            settings: ShardProcessSettings = self.settings[i]
            self.settings[i] = dataclasses.replace(settings, resume=True)
            how = self.group.restart(i, self._args(i))
            log.warning("shard %d %s; restarting it on port %d from its last checkpoint "
                        "(%d restart(s) left)", i, how, settings.port, self.restarts_left)
            self._await_port(i)

    def all_running(self) -> bool:
        """No shard has crashed (since ``check`` last restarted those that had)."""
        return not self.group.failed()

    def stop_all(self, grace: float, all_left: bool = False) -> None:
        """Stop every shard within ``grace`` seconds; ``all_left``: no worker is still to
        come (each one the front welcomed said goodbye), so the shards need not linger."""
        self.stop[0] = STOP_ALL_LEFT if all_left else STOP
        self.group.stop(grace=grace)
