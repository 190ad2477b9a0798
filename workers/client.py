"""The parameter-server client: a worker's handshake, push, pull and goodbye.

One DEALER to the front and one per shard; ``push_pull`` asks every shard at once and waits
for all answers, so a step costs one round trip. Heartbeats, re-sends and rejoins follow
PROTOCOL.md (Liveness, Retries), timed by ``liveness.Liveness``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time
from typing import Optional

import torch
import zmq

from asyncsgd.errors import AsyncSGDError
from asyncsgd.run import kill_at
from asyncsgd.run.audit import worker_audit
from asyncsgd.wire.busy_poll import BUSY_POLL_US, BusyPoll, readable, wait_readable
from asyncsgd.wire.compression import WIRE_DTYPES, Compressor
from asyncsgd.wire.layout import TableSpec
from asyncsgd.wire.protocol import (ACK, ATTACH, BYE, DTYPE_NAMES, ERROR, HEARTBEAT, HELLO,
                                    FRAME_BYTES, MAX_HEADER_BYTES, MAX_SEGMENT_ROWS,
                                    MAX_SEGMENT_VALUES, PARAMS, PULL, PUSH, WELCOME, Code,
                                    HeaderCache, Key, Message, Packed, ParamsIntake,
                                    PartsCache, ProtocolError, Rows, copy_into, in_parts,
                                    split)
from asyncsgd.wire.security import ClientKeys, await_handshake
from asyncsgd.wire.sparse import MAX_MESSAGE_VALUES, apart, reply_mismatch, split_rows, widened
from asyncsgd.wire.transport import (dealer, frame_limit, is_local, parse_endpoint, recv, send,
                                     shared_frames)

from .liveness import RESEND_HEARTBEATS, Liveness, doubled
from .shared_areas import SharedAreas
from .tables import route

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shared", "tcp")
ID_SPACES = ("fixed", "hashed")
# The largest frame a reply of rows may hold (PROTOCOL.md, Row-sparse tables: 65536 ids and
# 2^20 float32 values, 4.5 MiB), with a header's bound twice as frame_limit allows
ROWS_FRAME = 2 * MAX_HEADER_BYTES + 8 * MAX_SEGMENT_ROWS + 4 * MAX_SEGMENT_VALUES
FAREWELL_LINGER_MS = 200  # the most close() waits for goodbyes to shards still queued


class ServerUnavailable(AsyncSGDError):
    """The server did not answer for longer than --server-timeout."""


class ServerChanged(AsyncSGDError):
    """The server came back with another shard layout than the one this worker joined."""

    exit_code = 2


class ServerFinished(Exception):
    """The server ended training (target reached, time up, stopped): not an error."""


class ServerRefused(AsyncSGDError):
    """The server answered with an error (signature mismatch, rejected push, ...)."""

    exit_code = 2


def _said(meta: dict, limit: int = 1000) -> str:
    """The error text a reply carries, as a line fit to print: a shard's own are at most
    1,000 characters; another peer's may be anything."""
    text = meta.get(Key.ERROR, "")
    text = text if isinstance(text, str) else repr(text)
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


# The fields of the common reply to a push (fused.py's): anything more is ``_handle``'s
_PLAIN_REPLY = frozenset((Key.VERSION, Key.UPDATES, Key.ACK))
_PLAIN_ACK = frozenset((Key.APPLIED, Key.STALENESS))


def _version(i: int, meta: dict, reply: Message) -> int:
    """The version shard ``i``'s PARAMS ``reply`` says its parameters are at: the next
    clock; a ProtocolError unless an integer in [0, 2**63)."""
    version = meta.get(Key.VERSION, reply.clock)
    if type(version) is not int or not 0 <= version < 2 ** 63:
        raise ProtocolError(Code.BAD_FIELD, f"shard {i} sent version {version!r:.40}, "
                                            "not an integer in [0, 2**63)")
    return version


def _batch(value) -> list:
    """Shard 0's ``batch``: [size, offset, global batch], the slice within the global batch."""
    if type(value) is not list or len(value) != 3 or any(type(v) is not int for v in value) \
            or not (1 <= value[0] and 0 <= value[1] and value[0] + value[1] <= value[2]):
        raise ProtocolError(Code.BAD_FIELD, f"shard 0 sent batch {value!r:.60}, not [size, "
                                            "offset, total] with 0 < size <= total - offset")
    return value


def _told_steps(value) -> int:
    """Shard 0's ``local_steps`` (DyLU), checked as any reply field the worker acts on."""
    if type(value) is not int or not 1 <= value <= 1 << 20:
        raise ProtocolError(Code.BAD_FIELD, f"shard 0 sent local_steps {value!r:.40}, not a "
                                            "whole number in [1, 2**20]")
    return value
def _plan(meta: dict) -> tuple:
    """Shard 0's ``chunks`` and ``chunk_seed``, checked (PROTOCOL.md, Dynamic dispatch)."""
    chunks, seed = meta[Key.CHUNKS], meta.get(Key.CHUNK_SEED)
    flag = meta.get(Key.ALL_TRAINED)
    if type(seed) is not int or type(flag) is not bool or type(chunks) is not list or not all(
            type(c) is list and len(c) == 3 and all(type(v) is int for v in c)
            and 0 <= c[0] and 0 <= c[1] <= c[2] for c in chunks):
        raise ProtocolError(Code.BAD_FIELD, f"shard 0 sent chunks {chunks!r:.60} with seed "
                                            f"{seed!r:.20}, not [[epoch, start, stop], ...] "
                                            "and an integer, or no all_trained flag")
    return seed, chunks, meta[Key.ALL_TRAINED]


def _id_space(welcome: dict) -> str:
    """The welcome's ``id_space``, checked."""
    value = welcome[Key.ID_SPACE]
    if value not in ID_SPACES:
        raise ProtocolError(Code.BAD_FIELD, f"the server's welcome names id space {value!r:.40}, "
                                            f"not one of {', '.join(ID_SPACES)}")
    return value


def new_incarnation() -> int:
    """Larger at every start of a worker process: its start time in milliseconds, then
    its pid (distinct for two starts in one millisecond). Shards refuse an incarnation
    older than one they have seen for the same worker id (PROTOCOL.md, Exactly once)."""
    return (time.time_ns() // 1_000_000 << 22 | os.getpid() & (1 << 22) - 1) & (1 << 63) - 1


class PSClient:
    """``transport``: ``auto`` moves tensors through shared memory when the server runs
    on this host (``asyncsgd.wire.shared``) and over TCP otherwise; ``shared`` insists
    on shared memory (an error when it cannot be had); ``tcp`` always sends frames.
    ``data``: the worker's data signature (``asyncsgd.core.signature``), sent in the
    hello so that the server refuses a worker about to train on other data.
    ``busy_poll_us``: how long the shards' replies to a step are polled for before
    sleeping, while replies come that fast (0: always sleep; ``asyncsgd.wire.busy_poll``).
    ``audit_dir``: where this incarnation logs its pushes and their acknowledgements
    (``asyncsgd.run.audit``)."""

    def __init__(self, server: str, worker: str, signature: dict, *, rank: int, world: int,
                 heartbeat: float = 1.0, server_timeout: float = 60.0,
                 curve: Optional[ClientKeys] = None, transport: str = "auto",
                 data: Optional[dict] = None, compressor: Optional[Compressor] = None,
                 pull_dtype: str = "float32",
                 busy_poll_us: float = BUSY_POLL_US, audit_dir: Optional[str] = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r} is not one of {TRANSPORTS}")
        # Compressed pushes and pulls travel as frames: a same-host area holds float32
        self.compressor = compressor if compressor and not compressor.lossless else None
        self.pull_dtype = WIRE_DTYPES.get(pull_dtype, pull_dtype)
        if transport == "shared" and (self.compressor or self.pull_dtype != "float32"):
            raise ValueError("transport 'shared' moves float32 through memory: compressed "
                             "pushes or pulls need transport tcp (or auto)")
        if self.compressor or self.pull_dtype != "float32":
            transport = "tcp"
        # The embedding tables the signature names travel row by row (PROTOCOL.md, Row-sparse
        # tables), as frames: a same-host area has a slot for the dense slice only
        self.tables = [TableSpec(*t) for t in signature.get("tables", [])]
        if self.tables and transport == "shared":
            raise ValueError("transport 'shared' moves the dense slice through memory, but "
                             "this model's tables travel row by row in frames: use transport "
                             "tcp (or auto), or --embeddings dense")
        if self.tables:
            transport = "tcp"
        # rows are pushed as the dense part would be cast (int8 and top-k pack that alone)
        self.rows_dtype = DTYPE_NAMES[compressor.dtype] if compressor is not None else "float32"
        self.hashed = False  # the server's id space, as its welcome names it
        self._asked: dict = {}  # shard -> [(table, positions in the ids asked)], per ids segment
        self._rows_in: dict = {}  # (shard, seq) -> rows segments of a reply still in parts
        self._rows_got: dict = {}  # shard -> its reply's checked rows segments
        self.server, self.worker = server, worker
        self.host = parse_endpoint(server, "--server")[0]
        local = is_local(self.host)
        if transport == "shared" and not local:  # before the hello: nobody joins
            raise ServerUnavailable(self._no_shared(f"{self.host} is not an address of this "
                                                    "host (in this network namespace)"))
        self.incarnation = new_incarnation()
        self.heartbeat, self.server_timeout = heartbeat, server_timeout
        # A step's replies (one per shard, each on its own socket) are awaited by polling
        # for up to busy_poll_us first, while replies come that fast (busy_poll.py)
        self.busy_poll = BusyPoll(busy_poll_us / 1e6)
        self.curve = curve
        self.ctx = zmq.Context()
        self.seq = 0
        self.info: dict = {}  # the latest welcome: shards, instance, session token
        # --balance batch: [size, offset, global batch] of the next step, as shard 0 said
        self.batch: Optional[list] = None
        # --data-dispatch dynamic: (chunk seed, [[epoch, start, stop], ...], all trained)
        # shard 0 said to train next, from its latest params; None while it says nothing
        self.plan: Optional[tuple] = None
        self._readmitting = False  # a shard did not know our session: hello sent again
        self.local_steps: Optional[int] = None  # --local-steps auto: the H shard 0 last set
        self._linger = 0  # ms close() waits for goodbyes still queued
        self._left = False  # said goodbye (bye), or heard the run is over (_farewell)
        # bytes: every frame this worker's sockets sent and received (headers included;
        # what a same-host area carries crosses no socket and is not counted)
        self.stats = {"retries": 0, "duplicate_acks": 0, "reconnects": 0, "rejoins": 0,
                      "bytes_sent": 0, "bytes_received": 0}
        if self.tables:  # rows pushed (gradients) and pulled, all tables, every step
            self.stats.update(rows_pushed=0, rows_pulled=0)
        try:  # wrong or missing keys: one clear error now, not retries until the timeout
            if not await_handshake(self.ctx, server, curve, server_timeout):
                raise self._unavailable()
        except AsyncSGDError:
            self.ctx.term()
            raise
        self.front = self._front_socket()
        self.hello = {Key.SIGNATURE: signature, Key.RANK: rank, Key.WORLD: world,
                      Key.HOST: socket.gethostname()}
        if data is not None:  # the data signature: refused unless the server's data match
            self.hello[Key.DATA] = data
        try:
            welcome = self._request_front(Message(type=HELLO, meta=self.hello))
            self.info = welcome.meta
            self.shard_addrs, self.ranges = self._layout(welcome.meta)
            # how rows go to shards: id % shards, or hash_id(id) % shards when hashed
            if Key.ID_SPACE in welcome.meta:
                self.hashed = _id_space(welcome.meta) == "hashed"
            self.audit = worker_audit(audit_dir, worker, self.incarnation)
        except BaseException:  # refused, no answer, no audit: nothing of this client stays open
            self.front.close(0)
            self.ctx.term()
            raise
        self.shards = [self._shard_socket(i) for i in range(len(self.shard_addrs))]
        self.poller = zmq.Poller()
        for sock in [self.front, *self.shards]:
            self.poller.register(sock, zmq.POLLIN)
        self.version = 0  # the parameter version the local copy was pulled at (per shard min)
        self.versions = [0] * len(self.shards)
        self._intake = ParamsIntake()  # PARAMS replies by (shard, seq), part by part
        self._grads, self._grads_key, self._grad_segments = None, None, []
        # each shard's push header, packed but for its seq, clock and meta: a push of the
        # gradient buffer's own segments packs just those (protocol.HeaderCache)
        self._headers = [HeaderCache() for _ in self.shards]
        self._parts = [PartsCache() for _ in self.shards]  # the gradient buffer's, in parts
        self.transport = transport
        self.areas = SharedAreas(len(self.shards), insist=transport == "shared")
        # what lets a step take ``_push_pull_whole``, settled here; the rest is asked per step
        self._one_pass = (len(self.shards) == 1 and not self.tables and self.compressor is None
                          and self.audit is None and self.pull_dtype == "float32")
        # ZeroMQ sockets are not thread-safe: whoever uses them holds this lock.
        self._sockets = threading.Lock()
        self._closing = threading.Event()
        self._pulse = threading.Thread(target=self._beat_while_computing, daemon=True,
                                       name="ps-heartbeat")
        if transport != "tcp" and local:
            self.areas.want_all()
            self._attach_pending()
        self._pulse.start()

    def _beat_while_computing(self) -> None:
        """Every ``heartbeat`` s, a heartbeat to every shard unless an exchange is in flight
        (it heartbeats itself): the worker stays a live barrier member however long it
        computes. Replies wait in the sockets until the next exchange reads and skips them."""
        while not self._closing.wait(self.heartbeat):
            if not self._sockets.acquire(timeout=self.heartbeat / 10):
                continue
            try:
                if self._closing.is_set():  # said goodbye meanwhile: a heartbeat would revive us
                    return
                for i, sock in enumerate(self.shards):
                    self._out(sock, self._msg(HEARTBEAT, shard=i))
            except zmq.ZMQError as exc:  # sockets closing under us: nothing left to keep alive
                log.debug("heartbeat thread stops: %s", exc)
                return
            finally:
                self._sockets.release()

    def _no_shared(self, why: str) -> str:
        return (f"--transport shared: no shared memory with the server at {self.server}: "
                f"{why}; use --transport auto to fall back to TCP")

    def _refuse_shared(self, why: str) -> None:
        self.close()
        raise ServerUnavailable(self._no_shared(why))

    def _attach_pending(self) -> None:
        """Ask each shard still to attach to for a same-host area; frames where none comes."""
        why = self.areas.attach_pending(self._attach)
        if why is not None:
            self._refuse_shared(why)

    def _attach(self, i: int) -> Optional[str]:
        """Map shard ``i``'s area for this worker; None when done, else why not."""
        msg = self._msg(ATTACH, shard=i)
        self._out(self.shards[i], msg)
        deadline = time.monotonic() + RESEND_HEARTBEATS * self.heartbeat
        while (left := deadline - time.monotonic()) > 0:
            if not self.shards[i].poll(int(left * 1000) + 1):
                break
            reply = self._in(self.shards[i], self.areas.slots[i])
            if reply.seq != msg.seq:
                continue  # a heartbeat's answer, or a late one
            if reply.type != ATTACH:
                return f"the shard answered {reply.type}: {_said(reply.meta)}"
            return self.areas.map(i, reply.meta)
        return "no answer to attach"

    def _unavailable(self) -> ServerUnavailable:
        return ServerUnavailable(
            f"no answer from the server at {self.server} for {self.server_timeout:g} s; "
            "check the address and that 'asyncsgd ps-server' is running there")

    def _layout(self, welcome: dict) -> tuple:
        """(shard addresses, shard ranges) a WELCOME announces: ports, and contiguous
        slices that cover this worker's model from 0; a ProtocolError otherwise. With tables
        served by row a slice may be empty: a shard may hold rows alone."""
        shards, total = welcome.get(Key.SHARDS), self.hello[Key.SIGNATURE].get("total")
        empty_ok = bool(self.hello[Key.SIGNATURE].get("tables"))
        ranges, end = [], 0
        valid = type(shards) is list and len(shards) > 0
        for s in shards if valid else ():
            valid = (type(s) is dict and type(s.get(Key.PORT)) is int
                     and 0 < s[Key.PORT] < 65536 and s.get(Key.START) == end
                     and type(s.get(Key.END)) is int
                     and (s[Key.END] > end or empty_ok and s[Key.END] == end))
            if not valid:
                break
            ranges.append((end, s[Key.END]))
            end = s[Key.END]
        if valid and (total is None or end == total):
            return [f"tcp://{self.host}:{s[Key.PORT]}" for s in shards], ranges
        raise ProtocolError(Code.BAD_FIELD, f"the server at {self.server} announced shards "
                            "that are not ports and contiguous slices covering the model "
                            f"from 0 to {total}")

    def _front_socket(self) -> zmq.Socket:
        return dealer(self.ctx, self.server, curve=self.curve, max_frame=frame_limit(0))

    def _shard_socket(self, i: int) -> zmq.Socket:
        start, end = self.ranges[i]
        limit = frame_limit(end - start)
        sock = dealer(self.ctx, self.shard_addrs[i], curve=self.curve,
                      max_frame=max(limit, ROWS_FRAME) if self.tables else limit)
        # a blocking recv waits one heartbeat at most (``_answered_directly``); every other
        # recv on it follows a poll, or a check of its events, that found a message
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(self.heartbeat * 1000)))
        return sock

    def _out(self, sock: zmq.Socket, msg: Message, **kw) -> bool:
        sent = send(sock, msg, **kw)
        if sent:
            self.stats["bytes_sent"] += msg.nbytes
        return sent

    def _in(self, sock: zmq.Socket, areas=None) -> Message:
        reply = recv(sock, areas)
        self.stats["bytes_received"] += reply.nbytes
        return reply

    def _msg(self, kind: str, **kw) -> Message:
        self.seq += 1
        return Message(type=kind, worker=self.worker, incarnation=self.incarnation,
                       seq=self.seq, token=self.info.get(Key.TOKEN, ""), **kw)

    def _request_front(self, template: Message) -> Message:
        msg = self._msg(template.type, meta=template.meta)
        deadline = time.monotonic() + self.server_timeout
        backoff = self.heartbeat
        while True:
            self._out(self.front, msg)
            wait_until = min(deadline, time.monotonic() + max(backoff, 3 * self.heartbeat))
            while time.monotonic() < wait_until:
                if self.front.poll(int(max(0.0, wait_until - time.monotonic()) * 1000) + 1):
                    reply = self._in(self.front)
                    if reply.seq != msg.seq:
                        continue
                    if reply.type == ERROR:
                        raise ServerRefused(f"the server at {self.server} refused: "
                                            f"{_said(reply.meta)}")
                    return reply
            if time.monotonic() >= deadline:
                raise self._unavailable()
            log.warning("server %s unavailable, retrying in %.1f s", self.server, backoff)
            self.stats["retries"] += 1
            self.front.close(0)
            self.front = self._front_socket()
            backoff = doubled(backoff)

    def push_pull(self, grads: Optional[torch.Tensor], params: torch.Tensor,
                  meta: Optional[dict] = None, compute: float = 0.0,
                  rows: Optional[list] = None, want: Optional[list] = None) -> Optional[list]:
        """Push ``grads`` (flat, or None for a pull only) and pull into ``params`` (flat);
        ``compute``: the seconds of work ``grads`` took (for the audit).

        A model with tables also pushes ``rows``, per table ``(ids, values)`` (unique int64
        ids, float32 [n, dim] gradient rows), and pulls back the rows of ``want``, per
        table unique int64 ids: returned per table as float32 [len(ids), dim], in the
        order asked (None when nothing was asked)."""
        with self._sockets:
            return self._push_pull(grads, params, meta, compute, rows, want)

    def _push_pull(self, grads: Optional[torch.Tensor], params: torch.Tensor,
                   meta: Optional[dict], compute: float, rows: Optional[list] = None,
                   want: Optional[list] = None) -> Optional[list]:
        if self.areas.pending:
            self._attach_pending()
        if grads is not None and self._whole_exchange(rows, want):
            segments = self._segments_of(grads)[0]
            if len(segments) == 1:  # (a push in parts goes on below)
                return self._push_pull_whole(segments, params, meta)
        # One request per shard: a push that also asks for the parameters (or a pull).
        outstanding = {}  # (shard, seq) -> [message, replies still owed]; re-sent after reconnects
        pushing = grads is not None or rows is not None
        segments = self._segments_of(grads) if grads is not None else None
        sparse = self._sparse_segments(rows, want) if self.tables else None
        wire = {Key.PULL_DTYPE: self.pull_dtype} if self.pull_dtype != "float32" else {}
        for i in range(len(self.ranges)):
            extra = sparse[i] if sparse is not None else []
            if pushing:
                msg = self._msg(PUSH, clock=self.versions[i], shard=i,
                                meta={**(meta or {}), Key.PULL: True, **wire},
                                # the gradient buffer's own list when nothing joins it:
                                # _send's HeaderCache knows its segments by the list's identity
                                segments=[*segments[i], *extra] if segments and extra else
                                segments[i] if segments else extra)
                outstanding[(i, msg.seq)] = [msg, {ACK, PARAMS}]
            else:
                msg = self._msg(PULL, clock=self.versions[i], shard=i, meta=dict(wire),
                                segments=extra)
                outstanding[(i, msg.seq)] = [msg, {PARAMS}]
        if pushing and self.audit is not None:
            self.audit.sent([s for _, s in outstanding], [i for i, _ in outstanding], compute)
        faults = pushing and kill_at.planned()  # the test-only faults (asyncsgd/run/kill_at.py)
        if faults:
            kill_at.reached(kill_at.BEFORE_PUSH)
        for (i, _), (msg, _owed) in outstanding.items():
            self._send(i, msg, copy=not pushing)
        if faults:
            kill_at.reached(kill_at.AFTER_APPLY_BEFORE_ACK, self._replies_arrive, outstanding)
        self._await(outstanding, params)
        if faults:
            kill_at.reached(kill_at.AFTER_ACK)
        return self._rows_pulled(want) if sparse is not None else None

    def _whole_exchange(self, rows: Optional[list], want: Optional[list]) -> bool:
        """Whether a push may take ``_push_pull_whole`` (when its gradient is one segment):
        one shard, reached by frames, float32 both ways, nothing audited or faulted."""
        return (self._one_pass and rows is None and want is None and not self._readmitting
                and self.areas[0] is None and not kill_at.planned())

    def _push_pull_whole(self, segments: list, params: torch.Tensor,
                         meta: Optional[dict]) -> None:
        """The common step in one pass: a push of the gradient buffer (one segment) to the
        one shard, answered by a PARAMS reply that only acknowledges it. It sends and reads
        as ``_send`` and ``_answered_directly`` do, and copies the parameters as ``_handle``
        does, without their general matching. Any other answer (an error, a part, a late
        reply, a DyLU step, a duplicate's ack, none within a heartbeat) goes on through
        them. The worker's Python fell from ~15 to ~11 us of a 20 KB round trip's ~105
        (experiments/README.md, "The worker's common step")."""
        self.seq += 1
        seq = self.seq
        msg = Message(PUSH, self.worker, self.incarnation, seq, self.versions[0], 0,
                      {**meta, Key.PULL: True} if meta else {Key.PULL: True}, segments,
                      self.info.get(Key.TOKEN, ""))
        outstanding = {(0, seq): [msg, {ACK, PARAMS}]}
        sock = self.shards[0]
        self._out(sock, msg, copy=False, cache=self._headers[0])
        self._intake.forget()
        began, sent = time.monotonic(), time.perf_counter()
        until = began + self.heartbeat
        self.busy_poll.wait(sock)
        try:
            reply = self._in(sock, self.areas.slots[0])
        except zmq.Again:  # silent for a heartbeat: liveness decides what follows
            self.busy_poll.waited(time.perf_counter() - sent)
            self._await_live(outstanding, params, began)
            return
        rmeta = reply.meta
        ack = rmeta.get(Key.ACK)
        if reply.type == PARAMS and reply.seq == seq and reply.shard in (-1, 0) \
                and _PLAIN_REPLY.issuperset(rmeta) and type(ack) is dict \
                and _PLAIN_ACK.issuperset(ack):
            version = _version(0, rmeta, reply)
            start, end = self.ranges[0]
            copy_into(reply, params, start, end - start)
            self.versions[0] = version
            self.busy_poll.waited(time.perf_counter() - sent, reply.nbytes)
            return
        if reply.shard in (-1, 0):
            self._handle(0, reply, outstanding, params)
        if self._readmitting:
            self.busy_poll.waited(time.perf_counter() - sent, reply.nbytes)
        elif self._read_replies(outstanding, params, until, sent, reply.nbytes):
            return
        self._await_live(outstanding, params, began)

    def _sparse_segments(self, rows: Optional[list], want: Optional[list]) -> list:
        """Per shard, the row-sparse segments of one exchange: the gradient rows it holds
        (``rows``), then the ids of the rows to send back (``want``), each split to the
        per-segment bounds; where each asked id goes back is kept in ``_asked``."""
        shards = len(self.ranges)
        out: list = [[] for _ in range(shards)]
        self._asked = {i: [] for i in range(shards)}
        self._rows_got = {}
        values = 0
        # (the values of all shards' messages together: at least each one's)
        for t, (ids, grad) in enumerate(rows or ()):
            for i, at in self._routed(ids):
                out[i] += split_rows(t, ids, grad, self.rows_dtype) if at is None else \
                    split_rows(t, ids[at], grad[at], self.rows_dtype)
            self.stats["rows_pushed"] += len(ids)
            values += len(ids) * self.tables[t].dim
        for t, ids in enumerate(want or ()):
            for i, at in self._routed(ids):
                step = 0
                for seg in split_rows(t, ids if at is None else ids[at]):
                    out[i].append(seg)
                    n = seg.data.n
                    self._asked[i].append((t, slice(step, step + n) if at is None
                                           else at[step:step + n]))
                    step += n
            values += len(ids) * self.tables[t].dim
        if values > MAX_MESSAGE_VALUES:  # a shard refuses more (PROTOCOL.md): say why here
            raise ValueError(f"one step moves {values} row values, above the "
                             f"{MAX_MESSAGE_VALUES} a message may carry: use a smaller "
                             "--batch-size")
        return out

    def _routed(self, ids: torch.Tensor) -> list:
        """``[(shard, positions in ids)]`` of the shards holding some of ``ids``; positions
        None: all of them, in order (one shard: no routing to pay per table)."""
        if len(self.ranges) == 1:
            return [(0, None)] if len(ids) else []
        return [(i, at) for i, at in enumerate(route(ids, len(self.ranges), self.hashed))
                if len(at)]

    def _rows_pulled(self, want: Optional[list]) -> Optional[list]:
        """The rows the shards sent back, each put where its id was asked in ``want``: a
        table's rows that came back whole in one float32 segment are that segment's frame,
        not a copy (the step only reads them)."""
        if want is None:
            return None
        out: list = [None] * len(want)
        for i, asked in self._asked.items():
            for (t, at), seg in zip(asked, self._rows_got.get(i, [])):
                values = widened(seg)[2]
                if isinstance(at, slice) and at.start == 0 and at.stop == len(want[t]):
                    out[t] = values
                else:
                    if out[t] is None:
                        out[t] = torch.empty(len(want[t]), self.tables[t].dim)
                    out[t][at] = values
                self.stats["rows_pulled"] += len(values)
        self._rows_got = {}
        return [torch.empty(len(ids), self.tables[t].dim) if rows is None else rows
                for t, (ids, rows) in enumerate(zip(want, out))]

    def _replies_arrive(self, outstanding: dict) -> None:
        """Wait (for a test's fault) until every shard's reply to ``outstanding`` has
        arrived, reading nothing else of it: the pushes were applied, this worker never
        learns."""
        for i, seq in outstanding:
            deadline = time.monotonic() + self.server_timeout
            while time.monotonic() < deadline:
                if self.shards[i].poll(100) and \
                        self._in(self.shards[i], self.areas.slots[i]).seq == seq:
                    break

    def _send(self, i: int, msg: Message, copy: bool = True) -> None:
        """A push goes through the shard's shared area when there is one; else, of more
        than one frame, in parts, so the shard checks each on arrival; else whole, its
        header cached when it carries the gradient buffer's own segment."""
        area = self.areas[i]
        if msg.type == PUSH and area is not None:
            self._out(self.shards[i], msg, local=(area.link, area.grads))
        elif msg.type == PUSH and len(msg.segments) > 1 and not self._small_with_rows(msg):
            cached = msg.segments is self._grad_segments[i] if self._grad_segments else False
            parts = self._parts[i].parts(msg) if cached else [(p, None) for p in in_parts(msg)]
            for j, (part, cache) in enumerate(parts):
                if j:
                    kill_at.reached(kill_at.BETWEEN_PARTS)
                self._out(self.shards[i], part, copy=copy, cache=cache)
        elif msg.type == PUSH and self.compressor is None:
            self._out(self.shards[i], msg, copy=copy, cache=self._headers[i])
        else:
            self._out(self.shards[i], msg, copy=copy)

    def _small_with_rows(self, msg: Message) -> bool:
        """A push of rows within one frame's bytes goes whole: its many small segments (one
        per table, rows and ids) cost a shard more as parts (a ctr push of 53 segments:
        5.4-12 ms against 4.2-6.6 ms whole; experiments/README.md, "Sparse tables: the
        worker")."""
        if not self.tables:
            return False
        size = sum(seg.data.nbytes if isinstance(seg.data, (Rows, Packed)) else
                   seg.data.numel() * seg.data.element_size() for seg in msg.segments)
        return size <= FRAME_BYTES

    def _segments_of(self, grads: torch.Tensor) -> list:
        """Each shard's frames of ``grads``; made once for the buffer a worker pushes every
        step (compressed: encoded anew, once per push)."""
        if self.compressor is not None:
            return [self.compressor.segments(i, grads[start:end])
                    for i, (start, end) in enumerate(self.ranges)]
        key = (grads.data_ptr(), grads.shape, grads.stride())
        if self._grads_key != key or self._grads is not grads:
            self._grads, self._grads_key = grads, key
            self._grad_segments = [shared_frames(split(grads[start:end]))
                                   for start, end in self.ranges]
        return self._grad_segments

    def _await(self, outstanding: dict, params: torch.Tensor) -> None:
        self._intake.forget()  # what an earlier, abandoned call left behind
        self._rows_in = {}
        began = time.monotonic()
        if self._answered_directly(outstanding, params):  # one request per shard
            return
        self._await_live(outstanding, params, began)

    def _await_live(self, outstanding: dict, params: torch.Tensor, began: float) -> None:
        """Wait for the rest of ``outstanding`` (sent at ``began``), the direct wait over:
        every socket polled, heartbeats, re-sends, and a rejoin of a restarted server."""
        poller = self.poller
        live = Liveness(len(self.shards), self.heartbeat, self.server_timeout, began)
        wait = 0  # the direct wait took a heartbeat already: look at every socket at once
        while outstanding:
            events = dict(poller.poll(wait))
            wait = int(self.heartbeat * 1000)
            now = time.monotonic()
            if self.front in events and self._front_replies(outstanding):
                live.server_answered(now)  # a restarted server's shards listen
            for i, sock in enumerate(self.shards):
                if sock not in events:
                    continue
                while True:
                    reply = self._in(sock, self.areas.slots[i])
                    # Another shard of a restarted server may listen on this port now:
                    # its answers are no sign of life of shard i.
                    if reply.shard in (-1, i):
                        live.heard(i, now)
                        self._handle(i, reply, outstanding, params)
                    if not outstanding or not sock.poll(0):
                        break
            if not outstanding:
                return
            self._resend_unanswered(outstanding, live, now)
            waiting = sorted({i for i, _ in outstanding})
            if live.beat_due(now):
                for i in waiting:
                    self._out(self.shards[i], self._msg(HEARTBEAT, shard=i))
            dead = live.silent(waiting, now)
            if not dead:
                continue
            if live.lost(dead, now):
                raise ServerUnavailable(
                    f"shard(s) {dead} of {self.server} silent for {self.server_timeout:g} s; "
                    "giving up (raise --server-timeout to wait longer)")
            if not live.retry_due(now):
                continue
            log.warning("server unavailable (shard(s) %s silent), retrying in %.1f s",
                        dead, live.backoff)
            self._hello_again()
            if self._front_answers_within(live.rejoin_wait(dead, now), outstanding):
                live.server_answered(time.monotonic())
                continue
            for i in dead:
                self._reopen(i, outstanding)
            live.retried(time.monotonic())

    def _answered_directly(self, outstanding: dict, params: torch.Tensor) -> bool:
        """The common exchange, one request to each shard, settled by reading the shards'
        own sockets (``_read_replies``) for up to a heartbeat, after polling them while
        that pays (``busy_poll``). False when an answer is late or needs the general loop
        (a re-admission)."""
        sent = time.perf_counter()
        until = time.monotonic() + self.heartbeat  # stray replies do not extend the wait
        # 10 ms at most (--busy-poll-us), all shards
        self.busy_poll.wait(*(self.shards[i] for i, _ in outstanding))
        return self._read_replies(outstanding, params, until, sent, 0)

    def _read_replies(self, outstanding: dict, params: torch.Tensor, until: float,
                      sent: float, nbytes: int) -> bool:
        """Read the replies ``outstanding`` still owes until ``until``: whichever owed one
        has a message ready, else a wait in recv on the first still owed (up to a
        heartbeat, its RCVTIMEO), rather than in zmq_poll on every socket: each zmq_poll
        reads every socket's command mailbox with a poll(2) of its own
        (experiments/README.md, "Why the client waits as it does"). The replies are all
        awaited, so waiting on one while another lands costs nothing, and a reply in
        parts is read part by part beside the others. ``sent``: when the requests went
        (perf_counter), for ``busy_poll``; ``nbytes``: the largest message read so far in
        this exchange (0: none yet). False when an answer is late or needs the general
        loop (a re-admission)."""
        socks, slots = self.shards, self.areas.slots
        try:
            while outstanding and time.monotonic() < until:
                # Which has a message is asked only once one came (the first wait is in
                # recv anyway): each ask costs system calls. A 2-shard step of 20 KB made 42.7
                # in the worker (strace), 65.7 in zmq_poll (experiments/README.md, "Shards")
                if not nbytes:
                    i = next(iter(outstanding))[0]
                else:
                    owed = [i for i, _ in outstanding]
                    i = next((j for j in owed if readable(socks[j])), None)
                    if i is None:  # wait what is left of the heartbeat, not another
                        i = owed[0]
                        if not wait_readable(socks[i], until - time.monotonic()):
                            return False
                try:
                    reply = self._in(socks[i], slots[i])
                except zmq.Again:
                    return False
                nbytes = max(nbytes, reply.nbytes)
                if reply.shard in (-1, i):
                    self._handle(i, reply, outstanding, params)
                if self._readmitting:
                    break
            return not outstanding
        finally:  # (the replies' handling, their copies, count in: a little over the bare wait)
            self.busy_poll.waited(time.perf_counter() - sent, nbytes)

    def _reopen(self, i: int, outstanding: dict) -> None:
        """A fresh socket to shard ``i``'s current address; its outstanding requests re-sent."""
        self.poller.unregister(self.shards[i])
        self.shards[i].close(0)
        self.shards[i] = self._shard_socket(i)
        self.poller.register(self.shards[i], zmq.POLLIN)
        self.stats["reconnects"] += 1
        # A reply cut off between its parts comes again whole.
        self._intake.forget(lambda key: key[0] == i)
        self._rows_in = {key: got for key, got in self._rows_in.items() if key[0] != i}
        for (shard, _), (msg, _owed) in sorted(outstanding.items()):
            if shard == i:
                self._send(i, msg)
                self.stats["retries"] += 1

    def _hello_again(self) -> None:
        """Re-do the handshake on a fresh socket: a server restarted meanwhile answers with
        where its shards listen now. Same worker id and incarnation, so the shards'
        restored dedupe windows still recognise this worker's pushes."""
        self.poller.unregister(self.front)
        self.front.close(0)
        self.front = self._front_socket()
        self.poller.register(self.front, zmq.POLLIN)
        self._out(self.front, self._msg(HELLO, meta={**self.hello, Key.REJOIN: True}))

    def _front_answers_within(self, seconds: float, outstanding: dict) -> bool:
        """Wait ``seconds`` (the backoff); True as soon as a restarted server welcomed us."""
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            if self.front.poll(int(left * 1000) + 1) and self._front_replies(outstanding):
                return True
        return False

    def _front_replies(self, outstanding: dict) -> bool:
        """Read the front's answers to rejoin hellos; True when one came from a restarted
        server (a new ``instance``) and this client moved to its shards."""
        rejoined = False
        while self.front.poll(0):
            reply = self._in(self.front)
            if reply.type == ERROR:
                raise ServerRefused(f"the server at {self.server} refused this worker's rejoin: "
                                    f"{_said(reply.meta)}")
            if (reply.type == WELCOME
                    and reply.meta.get(Key.INSTANCE) != self.info.get(Key.INSTANCE)):
                self._rejoin(reply.meta, outstanding)
                rejoined = True
            elif reply.type == WELCOME and self._readmitting:
                raise ServerRefused(
                    f"a shard of {self.server} does not know this worker's session, yet the "
                    "server did not restart; start the worker again")
        return rejoined

    def _rejoin(self, welcome: dict, outstanding: dict) -> None:
        """Move to the shards a restarted server announces; re-send what is outstanding."""
        addrs, ranges = self._layout(welcome)
        if ranges != self.ranges:
            raise ServerChanged(
                f"the server at {self.server} restarted with shard ranges {ranges!s:.300}, but "
                f"this worker joined it with {self.ranges}: it now runs another --shards or model; "
                "start the worker again to join it afresh")
        ports = [s[Key.PORT] for s in welcome[Key.SHARDS]]
        before = [s[Key.PORT] for s in self.info[Key.SHARDS]]
        self.info, self.shard_addrs = welcome, addrs
        for i in range(len(self.shards)):  # new shard processes: their areas are new too
            if self.areas[i] is not None:
                self.areas.drop(i, "the server restarted")
        self._readmitting = False
        for msg, _owed in outstanding.values():  # the restarted server's session
            msg.token = self.info.get(Key.TOKEN, "")
        for i in range(len(self.shards)):  # even on an unchanged port: the old link is dead
            self._reopen(i, outstanding)
        self.stats["rejoins"] += 1
        log.warning("rejoined the restarted server at %s: shards on ports %s%s; re-sent %d "
                    "unanswered request(s)", self.server, ports,
                    "" if ports == before else f" (were {before})", len(outstanding))

    def _resend_unanswered(self, outstanding: dict, live: Liveness, now: float) -> None:
        """Re-send, with backoff, requests a live shard has not answered.

        The request or its answer was lost on the way (a dropped connection, a
        shard restarted between receiving and answering). The same sequence
        number makes a re-sent push a duplicate the shard acknowledges without
        applying it again; a re-sent held pull just stays held.
        """
        for key in live.resends_due(outstanding, now):
            self._send(key[0], outstanding[key][0])
            self.stats["retries"] += 1

    def _handle(self, i: int, reply: Message, outstanding: dict, params: torch.Tensor) -> None:
        key = (i, reply.seq)
        entry, kind, meta = outstanding.get(key), reply.type, reply.meta
        if entry is None or kind == HEARTBEAT:
            return  # a heartbeat, or a late answer to something already settled
        request, owed = entry
        if kind == ERROR:
            self._refused(i, reply, request)
            return
        if kind == BYE and meta.get(Key.STOPPING):
            self._farewell(but=i)
            raise ServerFinished()
        ack = meta if kind == ACK else meta.get(Key.ACK)
        if ack is not None:
            if type(ack) is not dict:
                raise ProtocolError(Code.BAD_FIELD, f"shard {i} acknowledged with a "
                                                    f"{type(ack).__name__}, not a map")
            if ACK in owed and self.audit is not None:
                self.audit.acked(reply.seq, i, ack)
            owed.discard(ACK)
            if i == 0 and Key.LOCAL_STEPS in ack:  # DyLU: shard 0 sized this worker's H
                self.local_steps = _told_steps(ack[Key.LOCAL_STEPS])
            if ack.get(Key.DUPLICATE):
                self.stats["duplicate_acks"] += 1
        if kind == PARAMS:
            version = _version(i, meta, reply)
            start, end = self.ranges[i]
            if self.tables:
                reply = self._took_rows(i, key, reply, request)
            if self._intake.take(key, reply, params, start, end - start):
                if key in self._rows_in:  # the last part of a reply in parts
                    self._check_rows(i, request, self._rows_in.pop(key))
                owed.discard(PARAMS)
            self.versions[i] = version
            if i == 0 and Key.BATCH in meta:
                self.batch = _batch(meta[Key.BATCH])
            if i == 0 and Key.CHUNKS in meta:
                self.plan = _plan(meta)
        if not owed:
            del outstanding[key]

    def _took_rows(self, i: int, key: tuple, reply: Message, request: Message) -> Message:
        """``reply`` (a PARAMS or a part of one) without its rows segments, kept until the
        reply is whole; a whole reply's are checked at once, so that nothing of a reply
        holding other rows than asked is copied."""
        dense, rows = apart(reply.segments)
        self._rows_in.setdefault(key, []).extend(rows)
        if Key.PARTS not in reply.meta and Key.PART not in reply.meta:
            self._check_rows(i, request, self._rows_in.pop(key))
        return dataclasses.replace(reply, segments=dense) if rows else reply

    def _check_rows(self, i: int, request: Message, got: list) -> None:
        """Keep shard ``i``'s rows for ``request`` when they are exactly those asked (its
        ids segments, in order); else stop: a shard that sends other rows is broken."""
        asked = [seg for seg in request.segments if type(seg.data) is Rows and not seg.data.dim]
        wrong = reply_mismatch(asked, got, self.tables)
        if wrong:
            raise ProtocolError(Code.BAD_FIELD, f"shard {i} answered with other rows than this "
                                                f"worker asked: {wrong}")
        self._rows_got[i] = got

    def _refused(self, i: int, reply: Message, request: Message) -> None:
        """Shard ``i`` answered ``request`` with an error: re-admission, frames instead of a
        lost area, or a refusal."""
        code = reply.meta.get(Key.CODE)
        if code == Code.UNKNOWN_WORKER:
            # A server started again has a new session key: hello again; its welcome
            # (a new instance) moves this client over and re-sends what is outstanding.
            if not self._readmitting:
                self._readmitting = True
                self._hello_again()
            return
        if code in (Code.UNKNOWN_LINK, Code.NO_LINKS):
            self.areas.drop(i, _said(reply.meta))
            self._send(i, request)  # as frames now; never applied, so not a duplicate
            return
        raise ServerRefused(f"shard {i} refused {request.type}: {_said(reply.meta)}")

    def bye(self, interrupted: bool = False) -> None:
        """Tell the shards and the front this worker is leaving (best effort, bounded), so
        barriers drop it at once rather than after the heartbeat timeout.

        ``interrupted``: a signal may have cut an exchange short, even between the
        frames of one message, so the goodbye goes on fresh sockets of its own."""
        self._closing.set()
        self._left = True
        with self._sockets:
            if interrupted:
                socks = [self._shard_socket(i) for i in range(len(self.shards))]
                socks.append(self._front_socket())
            else:
                socks = [*self.shards, self.front]
            try:
                for i, sock in enumerate(socks[:-1]):
                    self._out(sock, self._msg(BYE, shard=i))
                self._out(socks[-1], self._msg(BYE))
                deadline = time.monotonic() + min(2.0, self.server_timeout)
                pending = set(range(len(socks)))
                while pending and time.monotonic() < deadline:
                    for i in list(pending):
                        if socks[i].poll(10):
                            try:
                                if self._in(socks[i]).type == BYE:
                                    pending.discard(i)
                            except ProtocolError:
                                pending.discard(i)
            finally:
                if interrupted:
                    for sock in socks:
                        sock.close(0)

    def _farewell(self, but: int) -> None:
        """Shard ``but`` said training is over: tell the others this worker leaves, without
        waiting for their answers (``close`` gives the goodbyes FAREWELL_LINGER_MS to go
        out). A shard drains until every live worker was told or left: without this it
        waited for a worker that had heard from another shard (experiments/README.md, "Why the
        client waits as it does")."""
        for j, sock in enumerate(self.shards):
            if j != but:
                self._out(sock, self._msg(BYE, shard=j))
        self._linger = FAREWELL_LINGER_MS
        self._left = True

    def close(self) -> None:
        self._closing.set()
        if self._pulse.is_alive():
            self._pulse.join(timeout=self.heartbeat + 5)
        self.front.close(0)
        for sock in self.shards:
            sock.close(self._linger)
        self.areas.close()
        if self.audit is not None:
            self.audit.close()
        self.ctx.term()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, kind, *exc) -> None:
        """Leaving the block says goodbye, as ``bye`` (else a stopping server waits for a
        worker it still counts), unless said already or no one is left to tell (the
        server ended the run, or stopped answering); then closes."""
        try:
            if not self._left and not (kind and issubclass(kind, (ServerFinished,
                                                                   ServerUnavailable))):
                with contextlib.suppress(zmq.ZMQError):  # best effort: the block's error
                    self.bye(interrupted=kind is not None)  # is the one that counts
        finally:
            self.close()


