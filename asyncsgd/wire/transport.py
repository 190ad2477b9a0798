"""ZeroMQ sockets at the edge: configured once, they pack and unpack messages and never read
them; nothing above this module handles frames.

Every socket gets finite limits (LINGER 0, a maximum frame size, TCP keepalive, and
ROUTER_MANDATORY so a reply to a vanished peer is an error we count, not a silent drop).
"""

from __future__ import annotations

import logging
import socket
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy
import zmq

from ..errors import ConfigError
from .protocol import (FRAME_BYTES, INT8, ITEMSIZE, MAX_HEADER_BYTES, TOPK, HeaderCache,
                       Message, ProtocolError, decode, encode, packed_bytes, wire_of)

log = logging.getLogger(__name__)

MAX_FRAME = FRAME_BYTES + MAX_HEADER_BYTES
COPY_BELOW = 64 * 1024  # pyzmq: zero-copy costs more than a memcpy for small frames
# Flags as plain ints, frames sent and received one by one: pyzmq's send_multipart
# combines enum flags per frame and type-checks every part, and recv_multipart costs
# more than the loop (experiments/README.md, "Frames and sends").
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
# pyzmq's Socket.send is a Python wrapper (routing_id/group handling) around the Cython
# send: calling that directly saves a little on each of a round trip's frames.
_send_frame = zmq.backend.Socket.send


def largest_tensor_frame(elements: int) -> int:
    """The largest tensor frame PROTOCOL.md allows for a slice of ``elements`` values: at
    its widest encoding (an 8-byte dtype, or top-k with k = n; int8 with one scale a value
    takes 5 bytes a value), within FRAME_BYTES."""
    widest = max(max(ITEMSIZE.values()) * elements, packed_bytes(TOPK, elements, elements),
                 packed_bytes(INT8, elements, 1))
    return min(FRAME_BYTES, widest)


def frame_limit(elements: int) -> int:
    """The largest frame accepted from a peer exchanging a slice of ``elements`` values.

    A legitimate frame is a header or one tensor frame. Headers up to twice their
    bound still arrive, so a sender that overshoots gets a ``header-too-large``
    reply; a frame beyond this is no mistake, and libzmq drops its sender
    without buffering it.
    """
    return 2 * MAX_HEADER_BYTES + largest_tensor_frame(elements)


def _common(sock: zmq.Socket, curve: Any, max_frame: int) -> None:
    # High-water marks keep their defaults: a small HWM on a ROUTER silently dropped
    # replies under load.
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
    if curve is not None:
        curve.apply(sock)


def router(ctx: zmq.Context, bind: str, curve: Any = None, max_frame: int = MAX_FRAME) -> tuple:
    """A bound ROUTER and its actual endpoint (``tcp://host:0`` picks a free port)."""
    sock = ctx.socket(zmq.ROUTER)
    _common(sock, curve, max_frame)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        if bind.endswith(":0"):
            port = sock.bind_to_random_port(bind[:-2])
            endpoint = f"{bind[:-2]}:{port}"
        else:
            sock.bind(bind)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError:
        sock.close(0)  # an open socket would make ctx.term() wait forever
        raise
    return sock, endpoint


def dealer(ctx: zmq.Context, connect: str, identity: Optional[bytes] = None, curve: Any = None,
           max_frame: int = MAX_FRAME, connect_now: bool = True) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    _common(sock, curve, max_frame)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    if connect_now:
        sock.connect(connect)
    return sock


def _send_parts(sock: zmq.Socket, parts: Sequence, copy: bool) -> bool:
    """True when libzmq took the message; False if the peer is gone or not keeping up.

    ``copy=False`` sends the frames of COPY_BELOW bytes or more uncopied; smaller ones
    (a peer's id, a header) are copied all the same: an uncopied frame costs pyzmq a
    Frame object and, once libzmq lets go of it, a wake-up of pyzmq's garbage-collector
    thread (experiments/README.md, "Frames and sends")."""
    try:
        # libzmq takes a multipart message whole or not at all: the high-water mark and
        # ROUTER_MANDATORY refuse its first frame, never a later one.
        last = len(parts) - 1
        for j, part in enumerate(parts):
            if copy and type(part) is zmq.Frame:  # pyzmq shares a Frame even when told to copy
                part = part.buffer
            _send_frame(sock, part, _MORE if j < last else _LAST,
                        copy or len(part) < COPY_BELOW)
        return True
    except zmq.Again:
        log.warning("send queue full for a peer; reply dropped (the peer will retry)")
    except zmq.ZMQError as exc:
        if exc.errno != zmq.EHOSTUNREACH:
            raise
        log.info("peer disconnected before its reply could be sent")
    return False


def shared_frames(segments: list) -> list:
    """``segments``, returned; each that views its buffer's own bytes (``wire_of``) and is
    large enough to go uncopied will go out as one ``zmq.Frame``, made here once.

    Every send of such a Frame shares it with libzmq (a reference count) and reads the
    buffer as it is then; an uncopied send of the bytes themselves costs pyzmq a Frame
    object and a garbage-collector entry each time, and, once libzmq lets go, a wake-up
    of pyzmq's garbage-collector thread (experiments/README.md, "Frames and sends"). For
    a buffer its owner leaves unchanged until
    every send of it has been answered (a worker's gradients, until the ACK), as for
    ``copy=False``.
    """
    for seg in segments:
        desc, raw = wire_of(seg)
        if seg.wire is not None and len(raw) >= COPY_BELOW:  # kept: a view, never a copy
            seg.wire = desc, zmq.Frame(raw, copy=False)
    return segments


def send(sock: zmq.Socket, msg: Message, peer: Optional[bytes] = None, copy: bool = True,
         local: Optional[tuple] = None, cache: Optional[HeaderCache] = None) -> bool:
    """Send ``msg`` (to ``peer`` on a ROUTER). False if the peer is gone or not keeping up.

    ``copy=False`` sends tensor frames without copying: only for buffers that stay
    unchanged until the peer has answered (a worker's gradients until the ACK).
    ``local``: ``(link, slot)``: the tensors go into that same-host area slot instead.
    ``cache``: the sender's header for messages of this form (``protocol.HeaderCache``).
    """
    frames = encode(msg, local, cache)
    if peer is not None:
        frames.insert(0, peer)
    return _send_parts(sock, frames, copy)


class Reading:
    """Whether libzmq may still read the buffers of an uncopied send (``done``).

    Each large frame goes out as an object made for that send alone, and pyzmq
    holds it until libzmq lets go of the bytes (it must: they would be freed
    under libzmq otherwise), so once no such object is left alive, nothing
    reads them. pyzmq's own ``MessageTracker`` tells the same thing at the same
    moment, but its ``threading.Event`` per frame cost a 1 MB reply's shard more
    CPU (experiments/README.md, "Frames and sends").
    """

    __slots__ = ("_refs",)

    def __init__(self, refs: list):
        self._refs = refs

    @property
    def done(self) -> bool:
        return all(ref() is None for ref in self._refs)


def send_tracked(sock: zmq.Socket, msg: Message, peer: Optional[bytes] = None,
                 cache: Optional[HeaderCache] = None) -> Optional[Reading]:
    """Send ``msg`` with its large tensor frames uncopied; the ``Reading`` says when libzmq
    is done reading them (None: nothing is still being read, or the message was dropped).
    ``cache``: as for ``send``."""
    frames = encode(msg, cache=cache)
    parts = [peer, frames[0]] if peer is not None else [frames[0]]
    refs, frame = [], None
    for frame in frames[1:]:
        if len(frame) >= COPY_BELOW:
            frame = numpy.frombuffer(frame, numpy.uint8)  # this send's own: see Reading
            refs.append(weakref.ref(frame))
        parts.append(frame)
    del frame, frames  # no reference of ours may keep a sent frame's object alive
    if not _send_parts(sock, parts, copy=False) or not refs:
        return None
    return Reading(refs)


def _recv_frames(sock: zmq.Socket) -> list:
    """The frames of the next message, uncopied (``recv_multipart(copy=False)``, leaner).
    ``zmq.Again`` once the socket's RCVTIMEO has passed with no message (the later frames
    of a message are always there with its first)."""
    frames = [sock.recv(0, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(0, copy=False))
    return frames


def recv(sock: zmq.Socket, areas: Optional[Callable] = None) -> Message:
    """The next message on a DEALER, decoded; ``ProtocolError`` when it breaks the protocol.
    Tensors stay views of the received frames, or of the same-host area slot that
    ``areas(link, worker, incarnation)`` gives (no copy)."""
    return decode(_recv_frames(sock), areas)


def recv_from(sock: zmq.Socket, areas: Optional[Callable] = None) -> tuple:
    """``(peer, message)`` from a ROUTER; ``message`` is the ``ProtocolError`` instead when
    the bytes break the protocol, so the peer can still be answered. ``areas(link,
    worker, incarnation, peer)``: the slot of a same-host area, as for ``recv``."""
    peer = sock.recv(0)  # the identity, as bytes: cheaper than a Frame and .bytes
    frames = _recv_frames(sock)  # (a ROUTER always has a frame after the identity)
    try:
        return peer, decode(frames, areas, peer)
    except ProtocolError as exc:
        return peer, exc


def is_local(host: str) -> bool:
    """Whether ``host`` is an address of this machine *in this network namespace*: one a
    socket can bind. (A server across a veth pair in another namespace, whose traffic a
    shaped link must carry, is not.)"""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _name, addr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def parse_endpoint(address: str, flag: str) -> tuple:
    """``(host, port)`` of ``tcp://HOST:PORT``; a ``ConfigError`` naming ``flag`` otherwise."""
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not (address.startswith("tcp://") and sep and host and port.isdigit()
            and int(port) < 65536):
        raise ConfigError(f"{flag} {address!r}: use tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555")
    return host, int(port)
