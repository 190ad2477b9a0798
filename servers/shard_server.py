"""A shard process: a ROUTER socket around a ``ShardState``.

The loop receives frames, decodes them (a malformed message gets an ERROR
reply and changes nothing), lets the state object decide, and sends its
replies. It never crashes on input: anything the state raises is logged and
answered as an error. It checkpoints its slice and optimizer state
atomically every ``checkpoint_every`` seconds and when it stops, with the
port it listens on: a shard of a resumed server listens there again when the
port is free, so running workers find it where it was.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import zmq

from asyncsgd.checkpoint import load_checkpoint, save_checkpoint
from asyncsgd.memory import keep_freed_memory
from asyncsgd.protocol import (BYE, PARAMS, STATS, Message, ProtocolError, decode,
                               error_message, in_parts)
from asyncsgd.security import Gatekeeper, ServerKeys
from asyncsgd.transport import COPY_BELOW, frame_limit, recv, router, send, send_tracked

from .inflight import InFlight
from .shard import ShardConfig, ShardState

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
DRAIN_SECONDS = 1.5  # after a stop, answer stragglers with 'bye' for this long
BATCH = 64  # messages handled per wake-up before checking the clock again


@dataclass
class ShardProcessSettings:
    config: ShardConfig
    bind_host: str
    port: int
    checkpoint_dir: Optional[str]
    checkpoint_every: float
    resume: bool
    threads: int
    curve: Optional[ServerKeys] = None


def checkpoint_path(directory: str, index: int) -> Path:
    return Path(directory) / f"shard-{index}.pt"


def shard_main(rank: int, settings: ShardProcessSettings, initial: torch.Tensor, ready,
               stop: torch.Tensor) -> None:
    """Process target: serve shard ``rank`` until ``stop[0]`` is set."""
    torch.set_num_threads(settings.threads)
    keep_freed_memory()
    state = ShardState(settings.config, initial)
    inflight = InFlight()
    state.before_write = inflight.writable
    state.defer_apply = True  # _reply applies each part of an update just before sending it
    path = checkpoint_path(settings.checkpoint_dir, rank) if settings.checkpoint_dir else None
    saved: dict = {}
    if settings.resume and path is not None and path.exists():
        saved = load_checkpoint(path)
        state.load_state_dict(saved["shard"])
        log.info("shard %d resumed at version %d", rank, state.version)
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, settings.curve)
    sock, endpoint = _listen(ctx, settings, state.size, saved.get("port"))
    gate.watch(sock)
    port = int(endpoint.rsplit(":", 1)[1])
    ready.send(port)
    ready.close()
    next_checkpoint = time.monotonic() + (settings.checkpoint_every or float("inf"))
    next_tick = 0.0
    try:
        while not stop[0]:
            if sock.poll(int(TICK_SECONDS * 1000)):
                for _ in range(BATCH):
                    _serve_one(sock, state, gate, inflight)
                    if not sock.poll(0):
                        break
            now = time.monotonic()
            if now >= next_tick:  # liveness needs no finer grain than this
                next_tick = now + TICK_SECONDS
                for peer, reply in state.tick(now):
                    _reply(sock, state, inflight, peer, reply)
            if path is not None and now >= next_checkpoint:
                save_checkpoint(path, {"shard": state.state_dict(), "port": port})
                next_checkpoint = now + settings.checkpoint_every
        _drain(sock, state)
    finally:
        if path is not None:
            save_checkpoint(path, {"shard": state.state_dict(), "port": port})
        gate.close()
        sock.close(0)
        ctx.term()


def _listen(ctx: zmq.Context, settings: ShardProcessSettings, size: int,
            former: Optional[int]) -> tuple:
    """The shard's ROUTER and endpoint: on ``settings.port`` when set (a restart by the
    supervisor, whose workers know that port), else on the ``former`` port its checkpoint
    recorded when that is free, else on any free port."""
    def listen(port: int) -> tuple:
        return router(ctx, f"tcp://{settings.bind_host}:{port}", curve=settings.curve,
                      max_frame=frame_limit(size))

    if not settings.port and former:
        try:
            return listen(former)
        except zmq.ZMQError as exc:
            log.warning("shard %d: its former port %d is taken (%s); listening on another, "
                        "which workers learn when they rejoin", settings.config.index, former,
                        exc.strerror)
    return listen(settings.port)


def _drain(sock: zmq.Socket, state: ShardState) -> None:
    """Training is over: tell every worker that waits or asks, so it ends cleanly."""
    def over(seq: int) -> Message:
        return Message(type=BYE, shard=state.cfg.index, seq=seq, meta={"stopping": True})

    for record in state.workers.values():
        if record.held_pull is not None:
            send(sock, over(record.held_pull.seq), record.peer)
    deadline = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < deadline:
        if not sock.poll(50):
            continue
        peer, frames = recv(sock, router_side=True)
        try:
            send(sock, over(decode(frames).seq), peer)
        except ProtocolError as exc:
            send(sock, error_message(exc.code, str(exc)), peer)


def _reply(sock: zmq.Socket, state: ShardState, inflight: InFlight, peer: bytes,
           reply: Message) -> None:
    """Parameters go out without copying when ``inflight`` allows it, a message per frame
    (so the worker copies one while the next is on the wire), each as soon as the
    update still pending on it is applied; the rest once the update is complete."""
    if reply.shard < 0:  # errors too name the shard: a worker can tell another shard's answer
        reply.shard = state.cfg.index
    params = state.params
    if (reply.type == PARAMS and state.size * 4 >= COPY_BELOW and reply.segments
            and inflight.zero_copy(params)
            and all(seg.data._base is params for seg in reply.segments)):
        for part in in_parts(reply) if len(reply.segments) > 1 else [reply]:
            state.apply_pending(until=max(s.offset + s.data.shape[0] for s in part.segments))
            tracker = send_tracked(sock, part, peer)
            if tracker is not None:
                inflight.sent(params, tracker)
        return
    state.apply_pending()
    send(sock, reply, peer)


def _serve_one(sock: zmq.Socket, state: ShardState, gate: Gatekeeper,
               inflight: InFlight) -> None:
    peer, frames = recv(sock, router_side=True)
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        state.counters["rejected"] += 1
        send(sock, error_message(exc.code, str(exc)), peer)
        return
    try:
        replies = state.handle(peer, msg, time.monotonic())
    except Exception as exc:  # a bug must not take the shard down with every worker's work
        log.exception("shard %d: unexpected error handling %s", state.cfg.index, msg.type)
        state.counters["rejected"] += 1
        replies = [(peer, error_message("unexpected", f"{type(exc).__name__}: {exc}", msg))]
    for to, reply in replies:
        if reply.type == STATS:
            reply.meta.update(transport=gate.stats(), pid=os.getpid())
        _reply(sock, state, inflight, to, reply)
