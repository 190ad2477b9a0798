"""The shard process: a ROUTER socket around a ``ShardState``, which decides; this loop only
receives, sends the replies (parameters straight from the shard's buffer) and checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import zmq

from asyncsgd.run import kill_at
from asyncsgd.run.audit import shard_audit
from asyncsgd.run.checkpoint import load_checkpoint, save_checkpoint
from asyncsgd.run.digests import DigestLog, digests_name
from asyncsgd.core.sparse_ids import hash_id
from asyncsgd.wire.busy_poll import BUSY_POLL_US, BusyPoll
from asyncsgd.wire.memory import keep_freed_memory
from asyncsgd.wire.protocol import (ATTACH, BYE, MAX_HEADER_BYTES, MAX_SEGMENT_ROWS,
                                    MAX_SEGMENT_VALUES, PARAMS, STATS, Code, Key, Message,
                                    PartsCache, ProtocolError, Rows, error_message)
from asyncsgd.wire.security import Gatekeeper, ServerKeys
from asyncsgd.wire.shared import AreaUnavailable, Areas
from asyncsgd.wire.transport import frame_limit, recv_from, router, send, send_tracked

from .sessions import Sessions
from .shard import ShardConfig, ShardState
from .shard_tables import build_tables
from .zero_copy import ZeroCopyStore

log = logging.getLogger(__name__)

TICK_SECONDS = 0.1
DRAIN_SECONDS = 1.5  # after a stop, answer stragglers with 'bye' for at least this long
# ... and on, until every live worker was told, for at most this long (or the heartbeat
# timeout, if shorter): beside 4 busy processes on 2 cores a worker starved past the 1.5 s
# asked after the shard had gone, and waited out its --server-timeout; the server gives
# its shards SHARD_STOP_GRACE (15 s) to drain and save
DRAIN_MAX_SECONDS = 8.0
# What the supervisor writes into a shard's stop flag. STOP: a worker the front welcomed may
# still be on its way, so the drain lasts DRAIN_SECONDS at least. STOP_ALL_LEFT: every worker
# the front welcomed said goodbye, nobody is to come, and the drain ends once the shard's own
# live workers were told: Ctrl-C to exit of a ps-server took 1.71 s with a welcomed worker
# still to come, 0.34 s once every worker had left (tests/test_worker_liveness.py).
STOP, STOP_ALL_LEFT = 1, 2
MIN_AREAS = 8  # same-host areas a shard keeps at least (else 2 per expected worker)
# The largest rows frame (PROTOCOL.md, Row-sparse tables): 65536 ids and 2^20 float32s, 4.5 MiB
ROWS_FRAME = 8 * MAX_SEGMENT_ROWS + 4 * MAX_SEGMENT_VALUES


def max_frame(elements: int, tables: bool) -> int:
    """The largest frame a shard of ``elements`` dense values takes, or a peer takes from
    it: rows frames too when it serves tables by row."""
    dense = frame_limit(elements)
    return max(dense, 2 * MAX_HEADER_BYTES + ROWS_FRAME) if tables else dense


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
    session_key: bytes = b""  # checks the tokens the front hands out (sessions.py)
    busy_poll_us: float = BUSY_POLL_US  # polls for the next message this long (wire.busy_poll)
    record_digests: bool = False  # --record-digests: digests-shard-<i>.jsonl in checkpoint_dir
    audit_dir: Optional[str] = None  # --audit-dir: every push applied, a line each
    # Row-sparse tables (--embeddings sparse): the layout's TableSpecs, of ``shards`` shards
    tables: tuple = ()
    shards: int = 1
    id_space: str = "fixed"
    evict: tuple = ("none", 0)
    table_rule: str = "sgd"
    table_seed: int = 0
    table_scales: tuple = ()  # hashed: each table's initial rows are uniform within these


def checkpoint_path(directory: str, index: int) -> Path:
    return Path(directory) / f"shard-{index}.pt"


def shard_main(rank: int, settings: ShardProcessSettings, initial: tuple, ready,
               stop: torch.Tensor) -> None:
    """Process target: serve shard ``rank`` until ``stop[0]`` is set. ``initial``: its
    dense slice, and its rows of each table in a fixed id space (else None).

    Input never crashes it: a message that breaks the protocol, or anything the state
    raises, is answered as an error and changes nothing. It checkpoints its slice and
    optimizer state atomically as it starts serving, every ``checkpoint_every`` seconds
    and when it stops (before the drain that tells workers), with its port: a resumed
    shard listens there again when the port is free, so workers find it where it was."""
    torch.set_num_threads(settings.threads)
    keep_freed_memory()
    dense, rows = initial
    cfg = settings.config
    tables = build_tables(settings.tables, cfg.index, settings.shards, settings.id_space,
                          settings.evict, settings.table_rule, cfg.lr, settings.table_seed,
                          settings.table_scales, rows)
    del initial, rows  # the tables hold their copies
    state = ShardState(cfg, dense, store=ZeroCopyStore, settle_later=True, tables=tables,
                       table_specs=settings.tables, shards=settings.shards,
                       hash_ids=hash_id if settings.id_space == "hashed" else None)
    path = checkpoint_path(settings.checkpoint_dir, rank) if settings.checkpoint_dir else None
    saved: dict = {}
    if settings.resume and path is not None and path.exists():
        saved = load_checkpoint(path)
        state.load_state_dict(saved["shard"], now=time.monotonic())
        log.info("shard %d resumed at version %d", rank, state.version)
    audit = shard_audit(settings.audit_dir, rank,
                        state.restored["version"] if state.restored else None,
                        state.counters["lost_updates"])
    state.audit = audit.applied if audit is not None else None
    ctx = zmq.Context()
    gate = Gatekeeper(ctx, settings.curve)
    sock, endpoint = _listen(ctx, settings, max_frame(state.size, bool(settings.tables)),
                             saved.get("port"))
    gate.watch(sock)
    port = int(endpoint.rsplit(":", 1)[1])

    save = _Saver(state, port)

    sessions = Sessions(settings.session_key)
    areas = Areas(state.size, max(MIN_AREAS, 2 * settings.config.expected_workers))
    log.info("shard %d serving [%d, %d) on port %d, %s, %d thread(s)", rank,
             settings.config.start, settings.config.end, port, settings.config.consistency,
             settings.threads)
    if path is not None and saved.get("port") != port:
        # A checkpoint from the start: a shard (or server) killed before its first periodic
        # one restarts from it, and counts the acknowledged updates it lost, instead of
        # starting over from the initial parameters as if it had lost none.
        save(path)
    digests = (DigestLog(Path(settings.checkpoint_dir) / digests_name(rank), "version")
               if settings.record_digests and settings.checkpoint_dir else None)

    def note_digest() -> None:
        if digests is not None and digests.last != state.version:
            digests.note(state.version, [state.params])

    note_digest()
    ready.send(port)
    ready.close()
    next_checkpoint = time.monotonic() + (settings.checkpoint_every or float("inf"))
    next_tick = 0.0
    try:
        # The loop waits in recv itself (up to RCVTIMEO), not in zmq_poll: every zmq_poll,
        # and every "anything more?" check after a message, reads the socket's command
        # mailbox with a poll(2) of its own (experiments/README.md, "Frames and sends").
        # The clock and the stop flag (a numpy view, cheaper than a tensor's) are read
        # after every message.
        tick_ms = wait_ms = int(TICK_SECONDS * 1000)
        sock.setsockopt(zmq.RCVTIMEO, wait_ms)
        stopped = stop.numpy()
        busy = BusyPoll(settings.busy_poll_us / 1e6)
        headers = PartsCache()
        while not stopped[0]:
            with contextlib.suppress(zmq.Again):  # nothing came within the tick
                _serve_one(sock, state, gate, sessions, areas, busy, save, headers)
            note_digest()
            now = time.monotonic()
            wake = state.wake_at()  # a sync round's deadline (--backup-workers auto)
            if now >= next_tick or (wake is not None and now >= wake):
                if now >= next_tick:  # liveness needs no finer grain than this
                    next_tick = now + TICK_SECONDS
                for peer, reply in state.tick(now):
                    _reply(sock, state, peer, reply, areas, headers)
                note_digest()
                wake = state.wake_at()
            # A deadline a few ms away must not wait out the tick: recv waits until it.
            wanted = tick_ms if wake is None else \
                min(tick_ms, max(0, math.ceil((wake - now) * 1000)))
            if wanted != wait_ms:
                wait_ms = wanted
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
            if path is not None and now >= next_checkpoint:
                updated = state.version > 0  # a test's fault counts checkpoints of updates
                if updated:
                    kill_at.reached(kill_at.BEFORE_CHECKPOINT)
                save(path)
                if updated:
                    kill_at.reached(kill_at.AFTER_CHECKPOINT)
                next_checkpoint = now + settings.checkpoint_every
        if path is not None:  # before the drain, which changes nothing and may last 8 s: a
            # launcher's grace (torchrun's 30 s from SIGTERM to SIGKILL) may end during it
            saving, path = path, None  # one try: a failure here is reported, not repeated
            save(saving)
        all_left = stopped[0] == STOP_ALL_LEFT
        if all_left:
            log.info("shard %d: stopping; every worker the front welcomed has left, so no "
                     "worker is still to come", rank)
        _drain(sock, state, 0.0 if all_left else DRAIN_SECONDS)
    finally:
        try:
            if path is not None:  # stopped by an error: save what there is
                save(path)
        finally:
            if audit is not None:
                audit.close()
            areas.close()
            if digests is not None:
                digests.close()
            gate.close()
            sock.close(0)
            ctx.term()


class _Saver:
    """The shard's checkpoint, saved and timed: its stats report the last save's seconds,
    which the server sets aside before --max-seconds for the save as the shard stops (a
    2.6-million-row table's shard: about 1 s, 2.6 s beside 4 busy processes on its core)."""

    def __init__(self, state: ShardState, port: int):
        self.state, self.port = state, port
        self.seconds = 0.0

    def __call__(self, to: Path) -> None:
        began = time.monotonic()
        save_checkpoint(to, {"shard": self.state.state_dict(), "port": self.port})
        self.seconds = time.monotonic() - began


def _listen(ctx: zmq.Context, settings: ShardProcessSettings, frame: int,
            former: Optional[int]) -> tuple:
    """The shard's ROUTER and endpoint: on ``settings.port`` when set (a restart by the
    supervisor, whose workers know that port), else on the ``former`` port its checkpoint
    recorded when that is free, else on any free port."""
    def listen(port: int) -> tuple:
        return router(ctx, f"tcp://{settings.bind_host}:{port}", curve=settings.curve,
                      max_frame=frame)

    if not settings.port and former:
        try:
            return listen(former)
        except zmq.ZMQError as exc:
            log.warning("shard %d: its former port %d is taken (%s); listening on another, "
                        "which workers learn when they rejoin", settings.config.index, former,
                        exc.strerror)
    return listen(settings.port)


def _drain(sock: zmq.Socket, state: ShardState, linger: float) -> None:
    """Training is over: tell every worker that waits or asks, so it ends cleanly. A live
    worker asks within a heartbeat (it beats while it computes), so the drain lasts until
    each one was told, ``linger`` seconds at least and DRAIN_MAX_SECONDS at most."""
    def over(seq: int) -> Message:
        return Message(type=BYE, shard=state.cfg.index, seq=seq, meta={Key.STOPPING: True})

    untold = {w.worker for w in state.workers.values() if w.alive}
    for record in state.workers.values():
        if record.held_pull is not None:
            send(sock, over(record.held_pull.seq), record.peer)
            untold.discard(record.worker)
    now = time.monotonic()
    short = now + linger
    long = now + max(linger, min(DRAIN_MAX_SECONDS, state.cfg.heartbeat_timeout))
    while (now := time.monotonic()) < short or (untold and now < long):
        if not sock.poll(50):
            continue
        peer, msg = recv_from(sock)
        if isinstance(msg, ProtocolError):
            send(sock, error_message(msg.code, str(msg), msg), peer)
        else:
            send(sock, over(msg.seq), peer)
            untold.discard(msg.worker)
    if untold:
        log.info("shard %d: stopped without telling %s (silent for the drain)",
                 state.cfg.index, sorted(untold))


def _reply(sock: zmq.Socket, state: ShardState, peer: bytes, reply: Message,
           areas: Optional[Areas] = None, headers: Optional[PartsCache] = None) -> None:
    """Parameters go to a worker on this host through its shared area; to others without
    copying when the store allows it, a message per frame (so the worker copies one
    while the next is on the wire), each as soon as the update still pending on it is
    applied; the rest once the update is complete. ``headers``: the headers of PARAMS
    replies of the parameters' views, whole or in parts, kept from one reply to the next."""
    if reply.shard < 0:  # errors too name the shard: a worker can tell another shard's answer
        reply.shard = state.cfg.index
    store: ZeroCopyStore = state.store
    area = areas.for_peer(peer) if areas is not None and reply.segments else None
    if area is not None and any(type(s.data) is Rows for s in reply.segments):
        area = None  # rows travel as frames only (an area holds the dense slice)
    if area is not None:
        store.apply_pending()
        send(sock, reply, peer, local=(area.link, area.params))
        areas.sent(reply)
        return
    headers = headers if headers is not None else PartsCache()  # (a test's one reply)
    if reply.type == PARAMS and store.sends_in_place(reply):
        buffer = store.buffer
        for part, cache in headers.parts(reply):
            store.apply_pending(until=max(s.offset + s.data.shape[0] for s in part.segments))
            store.sending(buffer, send_tracked(sock, part, peer, cache))
        return
    store.apply_pending()
    one = reply.type == PARAMS and len(reply.segments) == 1 and not reply.segments[0].transient
    send(sock, reply, peer, cache=headers.parts(reply)[0][1] if one else None)


def _serve_one(sock: zmq.Socket, state: ShardState, gate: Gatekeeper,
               sessions: Sessions, areas: Areas, busy: BusyPoll, save: _Saver,
               headers: PartsCache) -> None:
    """Receive one message (polling first with ``busy`` while messages come that often,
    then waiting up to RCVTIMEO: zmq.Again when none came) and answer it; ``headers``:
    ``_reply``'s."""
    idle = time.perf_counter()
    busy.wait(sock)
    msg = None
    try:
        peer, msg = recv_from(sock, areas.grads_of)
        areas.received(msg)
    finally:
        busy.waited(time.perf_counter() - idle, msg.nbytes if isinstance(msg, Message) else 0)
    if isinstance(msg, ProtocolError):
        replies = state.refuse(peer, msg.code, str(msg), msg)
    elif not sessions.admits(msg):
        replies = state.refuse(peer, Code.UNKNOWN_WORKER, (
            f"no session for worker {msg.worker!r} incarnation {msg.incarnation}: say hello "
            "to the server's front first and send the token its welcome holds"), msg)
    elif msg.type == ATTACH:
        replies = [(peer, _attach(state, areas, peer, msg))]
    else:
        version = state.version
        try:
            replies = state.handle(peer, msg, time.monotonic())
        except Exception as exc:  # a bug must not take the shard down with every worker's work
            log.exception("shard %d: unexpected error handling %s", state.cfg.index, msg.type)
            replies = state.refuse(peer, Code.UNEXPECTED, f"{type(exc).__name__}: {exc}", msg)
        if state.version != version:  # a test's fault: the push applied, its ack unsent
            kill_at.reached(kill_at.APPLIED_UNACKED)
        if msg.type == BYE:
            areas.drop_worker(msg.worker)
    for to, reply in replies:
        if reply.type == STATS:
            reply.meta.update(transport=gate.stats(), pid=os.getpid(), **areas.stats(),
                              save_seconds=round(save.seconds, 4),
                              reply_copies=state.store.inflight.copies,
                              busy_polls=busy.polls, busy_poll_hits=busy.hits)
        _reply(sock, state, to, reply, areas, headers)
    try:
        state.settle()  # the push's bookkeeping, while its worker reads the reply
    except Exception:  # as in handle: a bug must not take the shard down
        log.exception("shard %d: unexpected error accounting a push", state.cfg.index)


def _attach(state: ShardState, areas: Areas, peer: bytes, msg: Message) -> Message:
    """A same-host area for an admitted worker (PROTOCOL.md, Same host), or why not."""
    try:
        area = areas.attach(msg.worker, msg.incarnation, peer)
    except AreaUnavailable as exc:
        return error_message(Code.NO_LINKS, str(exc), msg)
    return Message(type=ATTACH, seq=msg.seq, shard=state.cfg.index, meta={
        Key.PID: os.getpid(), Key.FD: area.fd, Key.LINK: area.link,
        Key.ELEMENTS: area.elements, Key.TAG: area.tag.hex()})
