"""The front: the address workers connect to first. It checks a worker's model and data
signatures, welcomes it with the shards' addresses, slices and session token, and answers
heartbeats, ``bye`` and ``stats``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable, Optional

import zmq

from asyncsgd.config import ServerConfig
from asyncsgd.core.signature import data_mismatch
from asyncsgd.errors import ConfigError
from asyncsgd.run import kill_at
from asyncsgd.wire.layout import Layout, signature_mismatch
from asyncsgd.wire.protocol import (BYE, HEARTBEAT, HELLO, STATS, WELCOME, Code, Key, Message,
                                    ProtocolError, error_message)
from asyncsgd.wire.security import Gatekeeper, ServerKeys
from asyncsgd.wire.transport import frame_limit, recv_from, router, send

from .evaluator import merged_staleness
from .sessions import Sessions

log = logging.getLogger(__name__)

BATCH = 64  # requests answered per call before the caller gets its turn again
ROSTER = 256  # worker names the front remembers (stats lists at most STATS_NAMES of each)
STATS_NAMES = 32


class Front:
    """Handshakes, stats and the roster of workers."""

    def __init__(self, cfg: ServerConfig, layout: Layout, data: dict, sock: zmq.Socket,
                 endpoint: str, gate: Gatekeeper, sessions: Sessions):
        self.cfg, self.layout, self.sock, self.gate = cfg, layout, sock, gate
        self.sessions = sessions
        self.endpoint = endpoint
        self.signature = layout.signature()
        self.data = data  # the data signature of the server's task (core.signature)
        self.shards: list = []  # [{port, start, end}], once the shards listen
        self.shard_stats: Callable[[], list] = list
        self.joined: dict = {}  # worker id -> last seen (monotonic), at most ROSTER of them
        self.left: set = set()  # of the joined
        self.arrivals = 0  # names that entered the roster, forgotten ones included
        self.forgot_live = False  # the roster forgot a worker that had not said goodbye
        self.refused = 0
        # Distinct for every start of the server: a worker that re-does its handshake
        # learns from it whether the server restarted (and its shards may have moved).
        self.instance = uuid.uuid4().hex

    @classmethod
    def listen(cls, ctx: zmq.Context, cfg: ServerConfig, layout: Layout, data: dict,
               keys: Optional[ServerKeys], sessions: Sessions) -> "Front":
        """Bind ``--bind`` (a taken port is a ConfigError saying so), with its gatekeeper."""
        gate = Gatekeeper(ctx, keys)
        try:
            sock, endpoint = router(ctx, cfg.bind, curve=keys, max_frame=frame_limit(0))
        except zmq.ZMQError as exc:
            gate.close()
            raise ConfigError(f"cannot listen on --bind {cfg.bind}: {exc}; choose another "
                              "port or stop the process using it") from exc
        gate.watch(sock)
        return cls(cfg, layout, data, sock, endpoint, gate, sessions)

    def open(self, shards: list, shard_stats: Callable[[], list]) -> None:
        """Welcome workers to ``shards``; ``shard_stats()`` gives the shards' latest counters."""
        self.shards, self.shard_stats = shards, shard_stats

    def serve(self, timeout_ms: int) -> None:
        """Answer what arrives within ``timeout_ms`` (a batch at most)."""
        if not self.sock.poll(timeout_ms):
            return
        for _ in range(BATCH):
            peer, msg = recv_from(self.sock)
            if isinstance(msg, ProtocolError):
                send(self.sock, error_message(msg.code, str(msg), msg), peer)
                continue
            try:
                reply = self._handle(msg, time.monotonic())
            except Exception as exc:  # a bug must not let one peer's message stop the server
                log.exception("front: failed on a %s from %r", msg.type, msg.worker)
                reply = error_message(Code.UNEXPECTED, f"the front failed on this {msg.type}: "
                                      f"{type(exc).__name__}; nothing was changed", msg)
            send(self.sock, reply, peer)
            if not self.sock.poll(0):
                return

    def _handle(self, msg: Message, now: float) -> Message:
        """The reply to ``msg`` at ``now`` (monotonic seconds)."""
        if msg.type == HELLO:
            problem = signature_mismatch(self.signature, msg.meta.get(Key.SIGNATURE))
            if problem:
                self.refused += 1
                log.warning("refused worker %s: %s", msg.worker or "?", problem)
                return error_message(Code.SIGNATURE_MISMATCH, f"this server trains task "
                                     f"{self.cfg.task}: {problem}", msg)
            problem = self._data_problem(msg.meta)
            if problem:
                self.refused += 1
                log.warning("refused worker %s: %s", msg.worker or "?", problem)
                return error_message(Code.DATA_MISMATCH, "this worker would train on other data "
                                     f"than the server's: {problem}", msg)
            if not msg.worker:
                return error_message(Code.BAD_FIELD, "a hello needs a worker id ('w')", msg)
            if msg.worker not in self.joined:
                self._forget_gone(now)
                self.arrivals += 1
            self.joined[msg.worker] = now
            self.left.discard(msg.worker)
            log.info("worker %s %s (rank %s of %s)", msg.worker,
                     "rejoined" if msg.meta.get(Key.REJOIN) else "joined",
                     msg.meta.get(Key.RANK), msg.meta.get(Key.WORLD))
            token = self.sessions.token(msg.worker, msg.incarnation)
            kill_at.reached(kill_at.WHILE_WELCOMING)
            return Message(type=WELCOME, seq=msg.seq, meta={
                Key.SHARDS: self.shards, Key.CONSISTENCY: self.cfg.consistency,
                Key.HEARTBEAT_TIMEOUT: self.cfg.heartbeat_timeout, Key.TOTAL: self.layout.total,
                Key.TASK: self.cfg.task, Key.INSTANCE: self.instance,
                Key.TOKEN: token, Key.EPOCHS: self.cfg.epochs,
                **({Key.ID_SPACE: self.cfg.id_space} if self.layout.tables else {})})
        if msg.type == HEARTBEAT:
            if msg.worker in self.joined:
                self.joined[msg.worker] = now
            return Message(type=HEARTBEAT, seq=msg.seq)
        if msg.type == BYE:
            if msg.worker in self.joined:
                self.left.add(msg.worker)
            return Message(type=BYE, seq=msg.seq)
        if msg.type == STATS:
            return Message(type=STATS, seq=msg.seq, meta=self.stats())
        return error_message(Code.BAD_TYPE, f"the front does not serve {msg.type!r}", msg)

    def _data_problem(self, meta: dict) -> str:
        """Why a hello's data signature differs from the server's, with the fix; '' when it
        agrees. A hello without one (a worker of an older asyncsgd, a tool speaking the
        protocol by hand) claims nothing about data and is not checked."""
        if Key.DATA not in meta:
            return ""
        cfg = self.cfg
        settings = ", ".join([f"--task {cfg.task}",
                             f"--samples {cfg.samples}" if cfg.samples else "no --samples",
                             *([f"--data-dir {cfg.data_dir}"] if cfg.data_dir else []),
                             *([f"--seed {cfg.seed}"] if self.data["seed"] is not None else [])])
        return data_mismatch(self.data, meta[Key.DATA], settings)

    def _forget_gone(self, now: float) -> None:
        """Make room for one new name within ``ROSTER``: forget the ones that left or went
        silent longest ago, and when none has, the least recently seen live one (a peer
        saying hello under ever new ids grows nothing; ``everyone_left`` then no longer
        holds, as a forgotten live worker may still come to a shard)."""
        excess = len(self.joined) - ROSTER + 1
        if excess <= 0:
            return
        timeout = self.cfg.heartbeat_timeout
        order = sorted(self.joined.items(), key=lambda wt: (
            wt[0] not in self.left and now - wt[1] <= timeout, wt[1]))
        for worker, _ in order[:excess]:
            self.forgot_live |= worker not in self.left
            del self.joined[worker]
            self.left.discard(worker)

    def stats(self) -> dict:
        now = time.monotonic()
        latest = self.shard_stats()
        workers = {}
        for s in latest:
            for name, w in s.get("workers", {}).items():
                workers[name] = w
        workers = dict(sorted(workers.items())[:STATS_NAMES])
        transport = [self.gate.stats()] + [s["transport"] for s in latest if "transport" in s]
        return {"task": self.cfg.task, "consistency": self.cfg.consistency,
                "shards": len(self.shards), "shard_ports": [s[Key.PORT] for s in self.shards],
                "refused_handshakes": self.refused,
                "authenticated": self.cfg.curve_secret is not None,
                "refused_connections": sum(t["refused"] for t in transport),
                "transport": transport,
                "joined": sorted(self.joined)[:STATS_NAMES],
                "left": sorted(self.left)[:STATS_NAMES],
                "live": sorted(w for w, t in self.joined.items() if w not in self.left and
                               now - t < self.cfg.heartbeat_timeout * 3)[:STATS_NAMES],
                "roster": len(self.joined),
                "updates": sum(s.get("updates", 0) for s in latest),
                "workers": workers, "staleness": merged_staleness(latest),
                "shard_stats": [{k: v for k, v in s.items() if k not in ("workers", "train")}
                                for s in latest]}

    def all_left(self) -> bool:
        """Every worker that joined has left or went silent (and at least one joined)."""
        if self.arrivals < self.cfg.workers:
            return False
        now = time.monotonic()
        live = [w for w, t in self.joined.items()
                if w not in self.left and now - t < self.cfg.heartbeat_timeout]
        shard_live = any(w.get("alive") for s in self.shard_stats()
                         for name, w in s.get("workers", {}).items() if name not in self.left)
        return not live and not shard_live

    def everyone_left(self) -> bool:
        """Every worker the front welcomed has said goodbye: none may still come to a shard
        (a worker that went silent may; so may one the roster forgot)."""
        return not self.forgot_live and self.left.issuperset(self.joined)

    def close(self) -> None:
        self.gate.close()
        self.sock.close(0)
