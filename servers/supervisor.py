"""The shard processes of a server: started, awaited, and restarted when they crash.

A shard that dies (SIGKILL, out of memory, a bug) is started again on the same
port with ``resume``: it reloads its last atomic checkpoint (shard-I.pt in the
run directory) and goes on serving. Workers notice the silence, say "server
unavailable, retrying", reconnect on their own and re-send what was
unacknowledged; the shard counts the updates the crash lost (see
``ShardState._count_lost``). After ``restarts`` restarts a crash ends the run.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from asyncsgd.errors import WorkerError
from asyncsgd.procs import WorkerGroup, context

from .shard_server import ShardProcessSettings, shard_main

log = logging.getLogger(__name__)

SHARD_READY_SECONDS = 60


class ShardSupervisor:
    def __init__(self, settings: list, initial: list, stop: torch.Tensor, restarts: int):
        self.settings: list = list(settings)
        self.initial, self.stop, self.restarts_left = initial, stop, restarts
        self.restarts = 0
        self.ready: list = [None] * len(settings)
        self.group = WorkerGroup(shard_main, len(settings), name="shard",
                                 args=[self._args(i) for i in range(len(settings))])

    def _args(self, i: int) -> tuple:
        receive, send = context("spawn").Pipe(duplex=False)
        self.ready[i] = receive
        return (self.settings[i], self.initial[i], send, self.stop)

    def start(self) -> list:
        """Start every shard; their ports once each listens."""
        self.group.start()
        return [self._await_port(i) for i in range(len(self.settings))]

    def _await_port(self, i: int) -> int:
        if not self.ready[i].poll(SHARD_READY_SECONDS):
            self.group.check()
            raise WorkerError(i, f"shard {i} did not start within {SHARD_READY_SECONDS} s")
        port = self.ready[i].recv()
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

    def stop_all(self, grace: float) -> None:
        self.stop[0] = 1
        self.group.stop(grace=grace)
