"""``asyncsgd ps-server``: a sharded parameter server.

    asyncsgd ps-server --task mnist1d-cnn --shards 2 --bind tcp://0.0.0.0:5555
    asyncsgd worker --server tcp://HOST:5555 --task mnist1d-cnn --rank 0 --world 2

The parent process is the *front*: workers connect to ``--bind`` and get, in
the handshake, the ports of the shard processes and their slices of the flat
parameter vector (after the model signature was checked). Workers then push
and pull to every shard directly, in parallel. The front also answers
``stats``, watches who joined and left, evaluates the current parameters
every ``--eval-every`` seconds in a thread of its own (pulling like a worker,
but joining no barrier), and writes the same run directory as every mode.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Optional

import torch
import zmq

from asyncsgd.config import ServerConfig, available_cores
from asyncsgd.errors import ConfigError
from asyncsgd.layout import Layout, signature_mismatch
from asyncsgd.memory import keep_freed_memory
from asyncsgd.protocol import (BYE, HEARTBEAT, HELLO, PARAMS, PULL, STATS, WELCOME, Message,
                               ProtocolError, copy_into, decode, error_message, parts_of)
from asyncsgd.recorder import Outcome, Recorder, RunResult
from asyncsgd.security import ClientKeys, Gatekeeper, ServerKeys, exposed_warning
from asyncsgd.tasks import load_task
from asyncsgd.transport import dealer, frame_limit, recv, router, send

from .shard import ShardConfig, parse_consistency
from .shard_server import ShardProcessSettings
from .supervisor import ShardSupervisor

log = logging.getLogger(__name__)

POLL_MS = 100


def _host_of(bind: str) -> str:
    if not bind.startswith("tcp://") or ":" not in bind[6:]:
        raise ConfigError(f"--bind {bind!r}: use tcp://HOST:PORT, e.g. tcp://0.0.0.0:5555")
    return bind[6:].rsplit(":", 1)[0]


def merged_staleness(shard_stats: list) -> list:
    """The shards' staleness histograms added bucket by bucket."""
    return [sum(bucket) for bucket in zip(*[s["staleness"] for s in shard_stats])]


class ShardReader:
    """The evaluator's view of the shards: observer pulls, assembled into one flat vector."""

    def __init__(self, ctx: zmq.Context, host: str, shards: list, total: int,
                 curve: Optional[ClientKeys] = None):
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "*") else host
        self.socks = [dealer(ctx, f"tcp://{connect_host}:{s['port']}", curve=curve,
                             max_frame=frame_limit(s["end"] - s["start"])) for s in shards]
        self.shards = shards
        self.flat = torch.zeros(total)
        self.seq = 0

    def pull(self, timeout: float = 10.0) -> dict:
        """Fill ``flat`` from every shard; returns {shard: version}."""
        self.seq += 1
        for sock in self.socks:
            send(sock, Message(type=PULL, seq=self.seq, meta={"observer": True}))
        versions = {}
        for i in range(len(self.socks)):
            start = self.shards[i]["start"]
            received, parts = 0, 1
            while received < parts:  # a large reply comes as several parts
                msg = self._reply(i, PARAMS, timeout)
                parts = parts_of(msg)[1]
                copy_into(msg, self.flat, start)
                received += 1
            versions[i] = msg.meta.get("version", 0)
        return versions

    def stats(self, timeout: float = 5.0) -> list:
        self.seq += 1
        for sock in self.socks:
            send(sock, Message(type=STATS, seq=self.seq))
        return [self._reply(i, STATS, timeout).meta for i in range(len(self.socks))]

    def _reply(self, shard: int, kind: str, timeout: float) -> Message:
        """Shard ``shard``'s answer of type ``kind`` to the current request."""
        sock = self.socks[shard]
        deadline = time.monotonic() + timeout
        while True:
            if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise TimeoutError(f"shard {shard} did not answer {kind} within {timeout} s")
            msg = decode(recv(sock, router_side=False)[1])
            if msg.type == kind and msg.seq == self.seq:
                return msg

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)


class Front:
    """Handshakes, stats and the roster of workers; runs in the server's main thread."""

    def __init__(self, cfg: ServerConfig, sock: zmq.Socket, layout: Layout, shards: list):
        self.cfg, self.sock, self.layout, self.shards = cfg, sock, layout, shards
        self.signature = layout.signature()
        self.joined: dict = {}  # worker id -> last seen (monotonic)
        self.left: set = set()
        self.refused = 0
        self.latest_stats: list = []
        self.gate: Optional[Gatekeeper] = None
        # Distinct for every start of the server: a worker that re-does its handshake
        # learns from it whether the server restarted (and its shards may have moved).
        self.instance = uuid.uuid4().hex

    def serve(self, timeout_ms: int) -> None:
        if not self.sock.poll(timeout_ms):
            return
        for _ in range(64):
            peer, frames = recv(self.sock, router_side=True)
            try:
                msg = decode(frames)
                reply = self._handle(msg)
            except ProtocolError as exc:
                reply = error_message(exc.code, str(exc))
            send(self.sock, reply, peer)
            if not self.sock.poll(0):
                return

    def _handle(self, msg: Message) -> Message:
        now = time.monotonic()
        if msg.type == HELLO:
            problem = signature_mismatch(self.signature, msg.meta.get("signature"))
            if problem:
                self.refused += 1
                log.warning("refused worker %s: %s", msg.worker or "?", problem)
                return error_message("signature-mismatch", f"this server trains task "
                                     f"{self.cfg.task}: {problem}", msg)
            self.joined[msg.worker] = now
            self.left.discard(msg.worker)
            log.info("worker %s %s (rank %s of %s)", msg.worker,
                     "rejoined" if msg.meta.get("rejoin") else "joined", msg.meta.get("rank"),
                     msg.meta.get("world"))
            return Message(type=WELCOME, seq=msg.seq, meta={
                "shards": self.shards, "consistency": self.cfg.consistency,
                "heartbeat_timeout": self.cfg.heartbeat_timeout, "total": self.layout.total,
                "task": self.cfg.task, "instance": self.instance})
        if msg.type == HEARTBEAT:
            if msg.worker in self.joined:
                self.joined[msg.worker] = now
            return Message(type=HEARTBEAT, seq=msg.seq)
        if msg.type == BYE:
            self.left.add(msg.worker)
            return Message(type=BYE, seq=msg.seq)
        if msg.type == STATS:
            return Message(type=STATS, seq=msg.seq, meta=self.stats())
        return error_message("bad-type", f"the front does not serve {msg.type!r}", msg)

    def stats(self) -> dict:
        now = time.monotonic()
        workers = {}
        for s in self.latest_stats:
            for name, w in s.get("workers", {}).items():
                workers[name] = w
        staleness = merged_staleness(self.latest_stats)
        transport = [self.gate.stats()] if self.gate else []
        transport += [s["transport"] for s in self.latest_stats if "transport" in s]
        return {"task": self.cfg.task, "consistency": self.cfg.consistency,
                "shards": len(self.shards), "shard_ports": [s["port"] for s in self.shards],
                "refused_handshakes": self.refused,
                "authenticated": self.cfg.curve_secret is not None,
                "refused_connections": sum(t["refused"] for t in transport),
                "transport": transport,
                "joined": sorted(self.joined), "left": sorted(self.left),
                "live": sorted(w for w, t in self.joined.items()
                               if w not in self.left and now - t < self.cfg.heartbeat_timeout * 3),
                "updates": sum(s.get("updates", 0) for s in self.latest_stats),
                "workers": workers, "staleness": staleness,
                "shard_stats": [{k: v for k, v in s.items() if k not in ("workers", "train")}
                                for s in self.latest_stats]}

    def all_left(self) -> bool:
        """Every worker that joined has left or went silent (and at least one joined)."""
        if len(self.joined) < self.cfg.workers:
            return False
        now = time.monotonic()
        live = [w for w, t in self.joined.items()
                if w not in self.left and now - t < self.cfg.heartbeat_timeout]
        shard_live = any(w.get("alive") for s in self.latest_stats
                         for name, w in s.get("workers", {}).items() if name not in self.left)
        return not live and not shard_live


def _rule_hyper(cfg: ServerConfig) -> dict:
    hyper = {"weight_decay": cfg.weight_decay}
    if cfg.optimizer == "momentum":
        hyper["momentum"] = cfg.momentum
    return hyper


def _percentile(hist: list, q: float) -> Optional[int]:
    total = sum(hist)
    if not total:
        return None
    seen = 0
    for value, count in enumerate(hist):
        seen += count
        if seen >= q * total:
            return value
    return len(hist) - 1


class _TrainFeed:
    """Per-worker train events from the cumulative counters shard 0 keeps."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self.seen: dict = {}
        self.samples = recorder.samples_offset

    def update(self, shard0: dict) -> None:
        train = shard0.get("train", {})
        self.samples = self.recorder.samples_offset + sum(v[2] for v in train.values())
        for worker, (loss_sum, steps, samples) in sorted(train.items()):
            prev = self.seen.get(worker, (0.0, 0, 0))
            if steps > prev[1]:
                self.recorder.train(self.samples, worker, (loss_sum - prev[0]) / (steps - prev[1]),
                                    steps - prev[1], -1)
            self.seen[worker] = (loss_sum, steps, samples)


def serve(cfg: ServerConfig, argv: Optional[list] = None) -> RunResult:
    """Run the parameter server until stopped; returns its run directory and summary."""
    parse_consistency(cfg.consistency)
    host = _host_of(cfg.bind)
    keys = ServerKeys.load(cfg.curve_secret, cfg.allowed_clients)
    keep_freed_memory()
    run = Recorder.open_run(cfg)
    task = load_task(cfg.task, samples=cfg.samples, data_dir=cfg.data_dir,
                     cache_dir=cfg.cache_dir, seed=cfg.seed)
    model = task.build_model(cfg.seed)
    recorder = Recorder(cfg, task, model, run, argv=argv)
    layout = Layout.of(model)
    flat = layout.flatten(model)
    ranges = layout.shard_ranges(cfg.shards)
    lr = cfg.lr or task.lr
    torch.set_num_threads(max(1, cfg.threads or 1))
    warning = exposed_warning(host, keys)
    if warning:
        log.warning(warning)

    ctx = zmq.Context()
    gate = Gatekeeper(ctx, keys)
    try:
        front_sock, endpoint = router(ctx, cfg.bind, curve=keys, max_frame=frame_limit(0))
    except zmq.ZMQError as exc:
        gate.close()
        ctx.term()
        raise ConfigError(f"cannot listen on --bind {cfg.bind}: {exc}; choose another "
                          "port or stop the process using it") from exc
    gate.watch(front_sock)
    stop = torch.zeros(1, dtype=torch.int64).share_memory_()
    supervisor = ShardSupervisor([
        ShardProcessSettings(
            config=ShardConfig(
                index=i, start=start, end=end, rule=cfg.optimizer, lr=lr,
                hyper=_rule_hyper(cfg), consistency=cfg.consistency,
                expected_workers=cfg.workers, heartbeat_timeout=cfg.heartbeat_timeout,
                staleness_lr=cfg.staleness_lr, dc_lambda=cfg.dc_asgd,
                sync_reduce=cfg.sync_reduce, reject_nonfinite=not cfg.allow_nonfinite,
                max_grad_norm=cfg.max_grad_norm),
            bind_host=host, port=0, checkpoint_dir=str(run.path),
            checkpoint_every=cfg.checkpoint_every, resume=bool(cfg.resume),
            threads=max(1, cfg.threads or available_cores() // (cfg.shards + 1)), curve=keys)
        for i, (start, end) in enumerate(ranges)],
        [flat[start:end].clone() for start, end in ranges], stop, cfg.shard_restarts)
    outcome = Outcome("workers_done")
    reader: Optional[ShardReader] = None
    feed = _TrainFeed(recorder)
    updates0, t_updates0 = 0, recorder.elapsed()
    samples0, t0 = feed.samples, recorder.elapsed()
    summary_extra: dict = {}
    try:
        with outcome.watch():
            shards = [{"port": port, "start": start, "end": end}
                      for port, (start, end) in zip(supervisor.start(), ranges)]
            reader = ShardReader(ctx, host, shards, layout.total,
                                 keys.as_client() if keys else None)
            front = Front(cfg, front_sock, layout, shards)
            front.gate = gate
            log.info("serving %s on %s: %d shard(s) on ports %s, %s", task.name, endpoint,
                     len(shards), [s["port"] for s in shards], cfg.consistency)
            recorder.progress.label = f"ps {cfg.consistency}"

            def observe() -> dict:
                reader.pull()
                model.load_state_dict(layout.state_dict(reader.flat))
                front.latest_stats = reader.stats()
                feed.update(front.latest_stats[0])
                updates = sum(s.get("updates", 0) for s in front.latest_stats)
                hist = merged_staleness(front.latest_stats)
                return {"updates": updates, "staleness_p50": _percentile(hist, 0.5),
                        "staleness_p99": _percentile(hist, 0.99), "staleness_hist": hist}

            obs = observe()
            recorder.evaluate(feed.samples, updates=obs["updates"])
            while True:
                front.serve(POLL_MS)
                supervisor.check()
                if recorder.eval_due():
                    try:
                        obs = observe()
                    except TimeoutError as exc:  # a shard died meanwhile: restart, evaluate later
                        log.warning("evaluation skipped: %s", exc)
                        continue
                    now = recorder.elapsed()
                    rate = (obs["updates"] - updates0) / max(1e-9, now - t_updates0)
                    updates0, t_updates0 = obs["updates"], now
                    recorder.evaluate(feed.samples, updates=obs["updates"],
                                      updates_per_second=round(rate, 1),
                                      staleness_p50=obs["staleness_p50"],
                                      staleness_p99=obs["staleness_p99"])
                    recorder.show(feed.samples, (feed.samples - samples0) / max(1e-9, now - t0))
                    samples0, t0 = feed.samples, now
                    if recorder.target_reached():
                        outcome.stopped_by = "target_accuracy"
                        break
                if cfg.max_seconds and recorder.elapsed() >= cfg.max_seconds:
                    outcome.stopped_by = "max_seconds"
                    break
                if cfg.exit_when_done and front.joined and front.all_left():
                    break
                recorder.checkpoint_if_due(feed.samples, 0)
            obs = observe()
            summary_extra = {
                "updates": obs["updates"], "staleness_p50": obs["staleness_p50"],
                "staleness_p99": obs["staleness_p99"], "staleness_hist": obs["staleness_hist"],
                "shards": cfg.shards, "consistency": cfg.consistency, "optimizer": cfg.optimizer,
                "lr": lr, "workers_joined": sorted(front.joined),
                "refused_handshakes": front.refused,
                "refused_connections": front.stats()["refused_connections"],
                "shard_restarts": supervisor.restarts,
                "lost_updates": sum(s.get("lost_updates", 0) for s in front.latest_stats)}
    finally:
        supervisor.stop_all(grace=5.0)
        if reader is not None:
            reader.close()
        gate.close()
        front_sock.close(0)
        ctx.term()
    return recorder.conclude(feed.samples, 0, outcome, **summary_extra)
