"""The parameter-server wire protocol: messages to frames and back (spec: PROTOCOL.md beside
this file).

A message is a msgpack header frame, then one raw frame per tensor segment, never pickled;
``decode`` checks everything a peer sends and fails only with ``ProtocolError``.
"""

from __future__ import annotations

import math
import operator
from functools import cached_property
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import msgpack
import torch

from ..errors import AsyncSGDError

VERSION = 3
MAX_HEADER_BYTES = 64 * 1024
MAX_SEGMENTS = 4096
MAX_META_ITEMS = 1024
MAX_TOKEN_CHARS = 64
FRAME_BYTES = 4 * 1024 * 1024  # tensors travel in frames of at most 4 MiB (see PROTOCOL.md)

HELLO, WELCOME, PULL, PARAMS, PUSH, ACK, ERROR, HEARTBEAT, STATS, BYE, ATTACH = (
    "hello", "welcome", "pull", "params", "push", "ack", "error", "heartbeat", "stats", "bye",
    "attach")
TYPES = frozenset({HELLO, WELCOME, PULL, PARAMS, PUSH, ACK, ERROR, HEARTBEAT, STATS, BYE,
                   ATTACH})


class Key:
    """Keys of a header's ``m`` map, grouped by the message that carries them."""

    # hello
    SIGNATURE, RANK, WORLD, HOST, REJOIN = "signature", "rank", "world", "host", "rejoin"
    DATA = "data"  # the data signature (core.signature)
    # welcome; SHARDS is a list of {PORT, START, END}
    SHARDS, PORT, START, END = "shards", "port", "start", "end"
    CONSISTENCY, HEARTBEAT_TIMEOUT, TOTAL, TASK, INSTANCE, TOKEN = (
        "consistency", "heartbeat_timeout", "total", "task", "instance", "token")
    EPOCHS = "epochs"  # the server's --epochs: a worker not given its own takes them
    ID_SPACE = "id_space"  # tables served by row: fixed or hashed, how a worker routes ids
    # pull (and a push that pulls): PULL_DTYPE, the dtype the parameters travel in
    OBSERVER, PULL_DTYPE = "observer", "pull_dtype"
    # params (and PART, PARTS of a message sent in parts)
    VERSION, UPDATES, ACK = "version", "updates", "ack"
    # params of shard 0 under --balance batch: [size, offset, global batch] of the next step
    BATCH = "batch"
    # params from shard 0 under --data-dispatch dynamic: [[epoch, start, stop], ...] to train
    # next, of the permutations seeded by CHUNK_SEED (core.dispatch.epoch_rows); ALL_TRAINED:
    # every row of every epoch handed out and trained
    CHUNKS, CHUNK_SEED, ALL_TRAINED = "chunks", "chunk_seed", "all_trained"
    PART, PARTS = "part", "parts"
    # push; TRAFFIC: [bytes sent, bytes received] by the worker since its previous push
    LOSS, SAMPLES, PULL, TRAFFIC = "loss", "samples", "pull", "traffic"
    # COMPUTE: seconds of computation behind this push; AUTO_STEPS: --local-steps auto's H,
    # LOCAL_STEPS: the steps behind it (in shard 0's ack: the H to run next; PROTOCOL.md, DyLU)
    COMPUTE, AUTO_STEPS, LOCAL_STEPS = "compute", "auto_steps", "local_steps"
    # ack
    APPLIED, STALENESS, DUPLICATE, STALE = "applied", "staleness", "duplicate", "stale"
    # error
    CODE, ERROR = "code", "error"
    # bye
    STOPPING = "stopping"
    # attach (the reply; PROTOCOL.md, Same host)
    PID, FD, LINK, ELEMENTS, TAG = "pid", "fd", "link", "elements", "tag"


class Code:
    """The ``code`` of an ``error`` reply (PROTOCOL.md, Errors)."""

    EMPTY, HEADER_TOO_LARGE, BAD_HEADER, BAD_VERSION = (
        "empty", "header-too-large", "bad-header", "bad-version")
    BAD_TYPE, BAD_FIELD, BAD_DESCRIPTOR, BAD_DTYPE = (
        "bad-type", "bad-field", "bad-descriptor", "bad-dtype")
    FRAME_COUNT, LENGTH_MISMATCH, OUT_OF_RANGE = "frame-count", "length-mismatch", "out-of-range"
    NON_FINITE, TOO_LARGE, SIGNATURE_MISMATCH = "non-finite", "too-large", "signature-mismatch"
    UNKNOWN_WORKER, UNEXPECTED = "unknown-worker", "unexpected"
    OLD_INCARNATION, OUT_OF_WINDOW, TOO_MANY_WORKERS = (
        "old-incarnation", "out-of-window", "too-many-workers")
    UNKNOWN_LINK, NO_LINKS = "unknown-link", "no-links"
    DATA_MISMATCH = "data-mismatch"

DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {dtype: torch.empty((), dtype=dtype).element_size() for dtype in DTYPES.values()}
WIRE_FLOATS = ("float32", "bfloat16", "float16")  # what parameters may travel in
# Packed segment formats (PROTOCOL.md, Compressed pushes): [offset, format, [n], parameter]
INT8, TOPK = "int8", "topk"
MAX_INT8_CHUNK = 1 << 20
# Row-sparse segments (PROTOCOL.md, Row-sparse tables): [table, "rows", [n, dim], dtype] (ids
# then rows) and a sparse pull's [table, "ids", [n], "int64"]; bounded per segment
ROWS, IDS = "rows", "ids"
MAX_TABLES = 1 << 10
MAX_SEGMENT_ROWS = 1 << 16
MAX_SEGMENT_VALUES = 1 << 20  # n x dim: a frame's values stay within FRAME_BYTES in float32
MAX_ROW_DIM = 1 << 16

# Decoded tensors view read-only zmq frames; torch warns about that on every
# frombuffer. We never write to them (the shard reads gradients, the worker
# copies parameters into its own buffer).
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class ProtocolError(AsyncSGDError):
    """A message that breaks the protocol; ``code`` is a short machine-readable reason."""

    def __init__(self, code: str, detail: str):
        self.code = code
        self.seq, self.worker = 0, ""  # the request's, when its header could be read
        super().__init__(f"{code}: {detail}")

    def echo(self, header: dict) -> "ProtocolError":
        """Remember the readable ``s`` and ``w`` of ``header``, for the error reply."""
        seq, worker = header.get("s"), header.get("w")
        if type(seq) is int and 0 <= seq < 2 ** 63:
            self.seq = seq
        if isinstance(worker, str) and len(worker) <= 256:
            self.worker = worker
        return self


@dataclass
class Segment:
    """A tensor at ``offset`` (in elements) of the receiver's flat parameter vector."""

    offset: int
    data: torch.Tensor
    transient: bool = False  # made for one message (a cast or packed copy): never cached
    # (descriptor, bytes) as ``encode`` sends them, kept on a segment sent again and again
    # (a worker's gradient views, a shard's parameter views): no torch calls to redo
    wire: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)


@dataclass
class Packed:
    """``numel`` values packed in ``payload`` (uint8): ``int8``, ``param`` values per
    float32 scale (the scales first, then one int8 per value), or ``topk``, ``param``
    int32 indices (strictly increasing, below ``numel``) then as many float32 values, every
    other value 0. ``wire.compression`` packs and expands them."""

    format: str
    numel: int
    param: int
    payload: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def packed_bytes(fmt: str, numel: int, param: int) -> int:
    """The payload size of a packed segment."""
    if fmt == INT8:
        return 4 * -(-numel // param) + numel
    return 8 * param


@dataclass
class Rows:
    """Rows of embedding table ``table`` (its index in the layout's tables) in ``payload``
    (uint8): n int64 ``ids``, then, unless ``dim`` is 0 (a sparse pull's ids alone), n x
    ``dim`` ``values`` of ``dtype`` in C order. ``wire.sparse`` makes and checks them."""

    table: int
    n: int
    dim: int
    dtype: str
    payload: torch.Tensor

    # views made once: a shard's check, apply and reply each read them (2-3 us a view, 52
    # segments a ctr push_pull)
    @cached_property
    def ids(self) -> torch.Tensor:
        return self.payload[:8 * self.n].view(torch.int64)

    @cached_property
    def values(self) -> torch.Tensor:
        return self.payload[8 * self.n:].view(DTYPES[self.dtype]).view(self.n, self.dim)

    @property
    def nbytes(self) -> int:
        return self.payload.numel()


def rows_bytes(n: int, dim: int, dtype: str) -> int:
    """The payload size of a row-sparse segment (``dim`` 0: ids alone)."""
    return 8 * n + n * dim * ITEMSIZE[DTYPES[dtype]]


@dataclass
class Message:
    type: str
    worker: str = ""
    incarnation: int = 0
    seq: int = 0
    clock: int = 0
    shard: int = -1
    meta: dict = field(default_factory=dict)
    segments: list = field(default_factory=list)
    token: str = ""  # the session a welcome handed out; shards serve no one without it
    nbytes: int = 0  # the frames' total size, once encoded or as decoded (traffic counts)


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor: a view when it is contiguous, else a contiguous copy."""
    return memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


class HeaderCache:
    """A message's header packed but for its seq, clock and meta, and its tensor frames,
    kept for the next message of the same form: one sender's messages carrying the same
    list of segments again and again (a worker's pushes of its gradient buffer, a shard's
    replies of its parameter views). ``encode(msg, cache=...)`` packs just the three
    fields that change (0.55 against 2.1 us a 20 KB push in a ``timeit`` loop;
    experiments/README.md, "Shard internals"); a message of another form fills it anew.

    Only segments whose bytes are kept on them (``Segment.wire``: contiguous, not made for
    one message) and no rows (joined frames) are cached; the list must not change while
    cached, as ``ParamStore.views`` and ``PSClient``'s gradient segments never do."""

    __slots__ = ("form", "segments", "head", "tensors", "_pack")

    def __init__(self):
        self.form: Optional[tuple] = None  # (type, worker, incarnation, shard, token)
        self.segments: Optional[list] = None  # the list cached (held: its id stays its own)
        self.head = b""  # the map's first byte and fields, up to the key of "s"
        self.tensors: list = []
        # a Packer reuses its buffer (0.17 against 0.42 us for packb; experiments/README.md,
        # "Shard internals"): one per cache, as a cache serves one sender, one thread at a time
        self._pack = msgpack.Packer(use_bin_type=True).pack

    def frames(self, msg: Message) -> Optional[list]:
        """``msg``'s frames, or None when its segments cannot be cached."""
        form = (msg.type, msg.worker, msg.incarnation, msg.shard, msg.token)
        if msg.segments is not self.segments or form != self.form:
            if not self._fill(msg, form):
                return None
        pack = self._pack
        return [b"".join((self.head, pack(msg.seq), _CLOCK_KEY, pack(msg.clock), _META_KEY,
                          pack(msg.meta))), *self.tensors]

    def _fill(self, msg: Message, form: tuple) -> bool:
        self.form = self.segments = None
        segments = msg.segments
        if any(seg.transient or type(seg.data) is Rows for seg in segments):
            return False
        wire = [seg.wire or wire_of(seg) for seg in segments]
        if any(seg.wire is None for seg in segments):  # its bytes a copy: not kept
            return False
        fixed = {"v": VERSION, "t": msg.type, "w": msg.worker, "i": msg.incarnation,
                 "sh": msg.shard, "d": [desc for desc, _ in wire]}
        if msg.token:
            fixed["k"] = msg.token
        # a fixmap (at most 15 pairs): its first byte counts them, the 3 packed per message too
        self.head = bytes((0x80 | len(fixed) + 3,)) + b"".join(
            msgpack.packb(key) + msgpack.packb(value, use_bin_type=True)
            for key, value in fixed.items()) + msgpack.packb("s")
        self.tensors = [raw for _, raw in wire]
        self.form, self.segments = form, segments
        return True


_CLOCK_KEY, _META_KEY = msgpack.packb("c"), msgpack.packb("m")


class PartsCache:
    """A ``HeaderCache`` per part of the messages a sender sends again and again with the
    same list of segments, whole (one segment) or in parts (``in_parts``): each part's
    one-segment list is made once per list, so that its part's cache knows it. A worker's
    pushes of its gradient buffer, a shard's replies of its parameter views (a 10 MB push
    is three parts each way). As for ``HeaderCache``, the list must not change while cached."""

    __slots__ = ("segments", "lists", "headers")

    def __init__(self):
        self.segments: Optional[list] = None  # the list the part lists were made for (held)
        self.lists: list = []
        self.headers: list = []  # one HeaderCache per part, kept as lists change

    def parts(self, msg: Message) -> list:
        """``[(message, HeaderCache)]``: ``msg`` itself when it has one segment, else its
        parts."""
        segments = msg.segments
        if segments is not self.segments:
            self.segments = segments
            self.lists = [[seg] for seg in segments] if len(segments) > 1 else [segments]
            self.headers += [HeaderCache() for _ in range(len(self.lists) - len(self.headers))]
        if len(segments) == 1:
            return [(msg, self.headers[0])]
        return list(zip(in_parts(msg, self.lists), self.headers))


def encode(msg: Message, local: Optional[tuple] = None,
           cache: Optional[HeaderCache] = None) -> list:
    """Frames for ``msg``: the header, then one buffer per segment (zero-copy views);
    their total size is left in ``msg.nbytes``.

    ``local``: ``(link, slot)`` of a same-host area (``shared.py``): the segments are
    written into ``slot`` at their offsets instead, and the header alone goes out.
    ``cache``: the sender's ``HeaderCache`` for messages of this form (frames only)."""
    if cache is not None and local is None:
        frames = cache.frames(msg)
        if frames is not None:
            msg.nbytes = sum(map(len, frames))
            return frames
    wire = [seg.wire or wire_of(seg) for seg in msg.segments]
    header = {
        "v": VERSION, "t": msg.type, "w": msg.worker, "i": msg.incarnation, "s": msg.seq,
        "c": msg.clock, "sh": msg.shard, "m": msg.meta, "d": [desc for desc, _ in wire],
    }
    if msg.token:
        header["k"] = msg.token
    if local is not None and msg.segments:  # nbytes: the header alone crosses a socket
        header["x"], slot = local
        for seg in msg.segments:
            if isinstance(seg.data, (Packed, Rows)) or seg.data.dtype != torch.float32:
                raise ValueError("a shared area holds float32 segments only")
            dest = slot[seg.offset:seg.offset + seg.data.shape[0]]
            if dest.data_ptr() != seg.data.data_ptr():  # written there already: no copy
                dest.copy_(seg.data)
        frames = [msgpack.packb(header, use_bin_type=True)]
    else:
        tensors, joins = _joined_frames(msg.segments, wire)
        if len(tensors) < len(wire):
            header["j"] = joins
        frames = [msgpack.packb(header, use_bin_type=True)] + tensors
    msg.nbytes = sum(map(len, frames))  # bytes, or uint8 views
    return frames


def _joined_frames(segments: list, wire: list) -> tuple:
    """``(frames, joins)``: one frame per segment, but each run of consecutive row-sparse
    segments in one frame, back to back (``joins[f]``: the segments frame f holds). A ctr
    step is 26 tables' rows and ids: 52 frames each way cost a worker and a shard more than
    the copy into one (PROTOCOL.md, Joined frames)."""
    frames: list = []
    joins: list = []
    run: list = []
    size = 0

    def close_run():
        frames.append(_raw(torch.cat(run)) if len(run) > 1 else _raw(run[0]))
        joins.append(len(run))
        run.clear()

    for seg, (_, raw) in zip(segments, wire):
        if type(seg.data) is Rows:
            if run and size + seg.data.nbytes > FRAME_BYTES:  # frames stay within 4 MiB
                close_run()
            size = (size if run else 0) + seg.data.nbytes
            run.append(seg.data.payload)
            continue
        if run:
            close_run()
        frames.append(raw)
        joins.append(1)
    if run:
        close_run()
    return frames, joins


def wire_of(seg: Segment) -> tuple:
    """``seg``'s descriptor and bytes. Getting a tensor's bytes takes five torch calls, and
    the same segments are sent step after step (a worker's gradient views, a shard's
    parameter views), so they are kept on the segment when they stay valid: its tensor
    is contiguous (its bytes are a view, not a copy) and it is not made for one message."""
    data = seg.data
    if isinstance(data, Packed):
        desc, tensor = [seg.offset, data.format, [data.numel], data.param], data.payload
    elif isinstance(data, Rows):
        shape = [data.n, data.dim] if data.dim else [data.n]
        desc, tensor = [data.table, ROWS if data.dim else IDS, shape, data.dtype], data.payload
    else:
        desc, tensor = [seg.offset, DTYPE_NAMES[data.dtype], list(data.shape)], data
    wire = desc, _raw(tensor)
    if not seg.transient and tensor.is_contiguous():
        seg.wire = wire
    return wire


def split(flat: torch.Tensor, offset: int = 0, frame_bytes: int = FRAME_BYTES) -> list:
    """Segments of at most ``frame_bytes`` covering the 1-D tensor ``flat``."""
    step = max(1, frame_bytes // flat.element_size())
    return [Segment(offset + i, flat[i:i + step]) for i in range(0, len(flat), step)]


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(Code.BAD_HEADER, f"msgpack extension type {code} is not allowed")


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    return buf if buf is not None else memoryview(frame)


_I63 = 2 ** 63 - 1


def _int(header: dict, key: str, lo: int = 0, hi: int = _I63) -> int:
    value = header.get(key, 0)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(Code.BAD_FIELD, f"field {key!r} must be an integer in [{lo}, {hi}]")
    return value


# (what it must be, the types it may have, a further check of the value or None)
_FLAG = ("a boolean", (bool,), None)
_COUNT = (f"an integer in [0, {_I63}]", (int,), lambda v: 0 <= v <= _I63)
_NUMBER = ("a number", (int, float), None)
_TEXT = ("a string", (str,), None)
_SECONDS = ("a finite number of seconds, at least 0", (int, float),
            lambda v: math.isfinite(v) and v >= 0)
_PAIR = (f"a list of two integers in [0, {_I63}]", (list,),
         lambda v: len(v) == 2 and type(v[0]) is int and type(v[1]) is int
         and 0 <= v[0] <= _I63 and 0 <= v[1] <= _I63)

# The type of every documented ``m`` field of a request a server serves (PROTOCOL.md, Types):
# one of another type is ``bad-field``. Keys not listed are ignored, so that a field added
# later (as ``data`` was) needs no new version; ``signature`` and ``data`` are the front's to
# check whole (``signature-mismatch``, ``data-mismatch``). A worker checks the reply fields
# it acts on itself, naming the shard that sent them (workers/client.py).
META_FIELDS = {
    HELLO: {Key.RANK: _COUNT, Key.WORLD: _COUNT, Key.REJOIN: _FLAG, Key.HOST: _TEXT},
    PULL: {Key.OBSERVER: _FLAG, Key.PULL_DTYPE: _TEXT},
    PUSH: {Key.LOSS: _NUMBER, Key.SAMPLES: _COUNT, Key.TRAFFIC: _PAIR, Key.PULL: _FLAG,
           Key.PULL_DTYPE: _TEXT, Key.PART: _COUNT, Key.PARTS: _COUNT, Key.COMPUTE: _SECONDS},
}


def _check_meta(kind: str, meta: dict) -> None:
    """Refuse (``bad-field``, naming it) a documented ``m`` field of the wrong type."""
    fields = META_FIELDS.get(kind)
    if not fields:
        return
    for key, value in meta.items():
        rule = fields.get(key)
        if rule is not None and (type(value) not in rule[1] or
                                 (rule[2] is not None and not rule[2](value))):
            raise ProtocolError(Code.BAD_FIELD, f"field 'm.{key}' of a {kind} must be "
                                                f"{rule[0]}, not {value!r:.40}")


_UNPACK_LIMITS = dict(raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True,
                      max_str_len=MAX_HEADER_BYTES, max_bin_len=0,
                      max_array_len=MAX_SEGMENTS * 3, max_map_len=MAX_META_ITEMS, max_ext_len=0)


def decode(frames: Sequence[Any], areas: Optional[Callable] = None,
           peer: Optional[bytes] = None) -> Message:
    """Parse and check a received message; every failure is a ``ProtocolError``.

    The header is bounded before it is unpacked, msgpack extension types are refused,
    every field's type is checked, only known dtypes pass and each frame's length must
    match its descriptor. Tensors returned are read-only views of the received frames;
    a packed segment (``Packed``) is checked for its layout and stays packed.

    ``areas(link, worker, incarnation)`` (``areas(link, worker, incarnation, peer)``
    when ``peer`` is given): the slot of a same-host area a header's ``x`` names
    (None when there is none for that sender); without it, ``x`` is refused."""
    if not frames:
        raise ProtocolError(Code.EMPTY, "no frames")
    head = _buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(Code.HEADER_TOO_LARGE,
                            f"header of {len(head)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, **_UNPACK_LIMITS)
    except ProtocolError as err:  # an extension type
        raise err.echo(_readable(head))
    except Exception as exc:  # msgpack raises several types (and ValueError on depth)
        raise ProtocolError(Code.BAD_HEADER, f"undecodable msgpack: {type(exc).__name__}"
                            ).echo(_readable(head)) from None
    if not isinstance(header, dict):
        raise ProtocolError(Code.BAD_HEADER, "header is not a map")
    try:
        msg = len(frames) == 2 and _one_segment(header, frames[1]) or \
            _message(header, frames, areas, peer)
    except ProtocolError as err:
        raise err.echo(header)
    msg.nbytes = sum(map(len, frames))  # zmq.Frame and bytes alike
    return msg


# Bytes, extension types and non-string keys read, only to find a refused header's s and w.
_LENIENT_LIMITS = {**_UNPACK_LIMITS, "max_bin_len": MAX_HEADER_BYTES, "strict_map_key": False,
                   "max_ext_len": MAX_HEADER_BYTES, "ext_hook": lambda code, data: None}


def _readable(head: memoryview) -> dict:
    """What can still be read of a header the decoder refused (bytes where a string was
    due, an extension type): its map, for the error reply to echo ``s`` and ``w``."""
    try:
        header = msgpack.unpackb(head, **_LENIENT_LIMITS)
    except Exception:  # truly undecodable: nothing to echo
        return {}
    return header if isinstance(header, dict) else {}


_ONE_SEGMENT_KEYS = frozenset(("v", "t", "w", "i", "s", "c", "sh", "m", "d", "k"))  # and no more
_ONE_SEGMENT_FIELDS = operator.itemgetter("v", "t", "w", "i", "s", "c", "sh", "m", "d")


def _one_segment(header: dict, frame: Any) -> Optional[Message]:
    """The common message, a header and one frame of one dense segment (a push, a reply's
    parameters), checked as ``_message`` checks it but in one pass: None for any other
    message, or for one that breaks a rule, which ``_message`` then names (so the error is
    the one it has always been). Decode took 4.1 us with ``_message``, 3.6 with this, in a
    ``timeit`` loop (experiments/README.md, "Shard internals")."""
    if not _ONE_SEGMENT_KEYS.issuperset(header):
        return None  # 'x', 'j' or a field added later: the general path's
    try:  # every field but the token, as every encoder writes them
        version, kind, worker, incarnation, seq, clock, shard, meta, descriptors = \
            _ONE_SEGMENT_FIELDS(header)
    except KeyError:
        return None
    token = header.get("k", "")
    if not (version == VERSION and type(version) is int and type(kind) is str
            and kind in TYPES and type(worker) is str and len(worker) <= 256
            and type(meta) is dict and type(descriptors) is list and len(descriptors) == 1
            and type(token) is str and len(token) <= MAX_TOKEN_CHARS
            and type(incarnation) is int and type(seq) is int and type(clock) is int
            and type(shard) is int and 0 <= incarnation <= _I63 and 0 <= seq <= _I63
            and 0 <= clock <= _I63 and -1 <= shard <= 1 << 20):
        return None
    if meta:
        _check_meta(kind, meta)  # as _message, after the same checks: the same error
    desc = descriptors[0]
    if not (type(desc) is list and len(desc) == 3):
        return None
    offset, dtype_name, shape = desc
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if not (type(offset) is int and 0 <= offset < 2 ** 62 and dtype is not None
            and type(shape) is list and len(shape) == 1 and type(shape[0]) is int
            and 0 < shape[0] < 2 ** 40):
        return None
    buf = _buffer(frame)
    if shape[0] * ITEMSIZE[dtype] != len(buf):
        return None
    return Message(kind, worker, incarnation, seq, clock, shard, meta,
                   [Segment(offset, torch.frombuffer(buf, dtype=dtype))], token)


def _message(header: dict, frames: Sequence[Any], areas: Optional[Callable],
             peer: Optional[bytes]) -> Message:
    """The message a decoded header map and its tensor frames describe, checked."""
    get = header.get
    version, kind, worker, meta = get("v"), get("t"), get("w", ""), get("m", {})
    descriptors, link, token = get("d", []), get("x"), get("k", "")
    if type(version) is not int or version != VERSION:
        raise ProtocolError(Code.BAD_VERSION, f"protocol version {version!r}; "
                                              f"this build speaks {VERSION}")
    if type(kind) is not str or kind not in TYPES:  # a list or map is unhashable
        raise ProtocolError(Code.BAD_TYPE, f"unknown message type {kind!r}")
    if type(worker) is not str or len(worker) > 256:
        raise ProtocolError(Code.BAD_FIELD, "field 'w' must be a string of at most 256 characters")
    if type(meta) is not dict:
        raise ProtocolError(Code.BAD_FIELD, "field 'm' must be a map")
    if type(descriptors) is not list or len(descriptors) > MAX_SEGMENTS:
        raise ProtocolError(Code.BAD_FIELD, f"field 'd' must be a list of at most {MAX_SEGMENTS}")
    if link is not None and len(frames) != 1:
        raise ProtocolError(Code.FRAME_COUNT, "a message whose tensors are in a shared area "
                                              f"('x') has no tensor frames, not {len(frames) - 1}")
    joins = get("j")
    if joins is not None:
        if not (type(joins) is list and len(joins) == len(frames) - 1 and
                all(type(k) is int and k >= 1 for k in joins)):
            raise ProtocolError(Code.BAD_FIELD, "field 'j' must be a list of integers >= 1, "
                                                "one per tensor frame")
        if link is not None or sum(joins) != len(descriptors):
            raise ProtocolError(Code.FRAME_COUNT, f"{len(descriptors)} descriptors but the "
                                                  f"frames hold {sum(joins)} ('j')")
    elif link is None and len(descriptors) != len(frames) - 1:
        raise ProtocolError(Code.FRAME_COUNT, f"{len(descriptors)} descriptors but "
                                              f"{len(frames) - 1} tensor frames")
    if type(token) is not str or len(token) > MAX_TOKEN_CHARS:
        raise ProtocolError(Code.BAD_FIELD, f"field 'k' must be a string of at most "
                                            f"{MAX_TOKEN_CHARS} characters")
    incarnation, seq, clock, shard = get("i", 0), get("s", 0), get("c", 0), get("sh", 0)
    if not (type(incarnation) is int and type(seq) is int and type(clock) is int
            and type(shard) is int and 0 <= incarnation <= _I63 and 0 <= seq <= _I63
            and 0 <= clock <= _I63 and -1 <= shard <= 1 << 20):
        # One check for the four in the common case; the slow path names the culprit.
        incarnation, seq, clock = _int(header, "i"), _int(header, "s"), _int(header, "c")
        shard = _int(header, "sh", -1, 1 << 20)
    if meta:
        _check_meta(kind, meta)
    if link is not None:
        msg = Message(kind, worker, incarnation, seq, clock, shard, meta, [], token)
        slot = _slot(link, areas, msg, peer)
        msg.segments.extend(_shared_segment(desc, slot) for desc in descriptors)
        return msg
    buffers = [_buffer(frame) for frame in frames[1:]] if joins is None else \
        _unjoined(descriptors, frames, joins)
    segments = []
    for desc, buf in zip(descriptors, buffers):
        seg = _segment(desc, buf)
        if kind != PUSH and type(seg.data) is Packed:
            raise ProtocolError(Code.BAD_DTYPE, "packed segments travel in pushes only")
        if type(seg.data) is Rows and kind not in _ROWS_IN[bool(seg.data.dim)] and not (
                kind == PUSH and meta.get(Key.PULL) is True):
            raise ProtocolError(Code.BAD_DTYPE, "rows travel in pushes and params, ids in "
                                                "pulls and pushes that pull, not "
                                                f"{desc[1]!r} in a {kind}")
        segments.append(seg)
    return Message(kind, worker, incarnation, seq, clock, shard, meta, segments, token)


def _unjoined(descriptors: list, frames: Sequence[Any], joins: list) -> list:
    """Each descriptor's bytes, where ``joins`` put several row-sparse segments in one
    frame: cut by their descriptors' sizes, which must fill the frame exactly."""
    out, d = [], 0
    for k, frame in zip(joins, frames[1:]):
        buf = _buffer(frame)
        if k == 1:
            out.append(buf)
            d += 1
            continue
        at = 0
        for desc in descriptors[d:d + k]:
            size = _rows_size(desc)
            out.append(buf[at:at + size])
            at += size
        if at != len(buf):
            raise ProtocolError(Code.LENGTH_MISMATCH, f"a frame joining {k} segments needs "
                                                      f"{at} bytes, it has {len(buf)}")
        d += k
    return out


def _rows_size(desc: Any) -> int:
    """The bytes of a row-sparse segment, from its checked descriptor: a joined frame holds
    these alone."""
    if not (type(desc) is list and len(desc) == 4 and desc[1] in (ROWS, IDS)):
        raise ProtocolError(Code.BAD_DESCRIPTOR, "a frame joining segments ('j') holds rows "
                                                 f"and ids segments only, not {desc!r:.60}")
    n, dim, dtype_name = _rows_form(desc)
    return rows_bytes(n, dim, dtype_name)


def _slot(link: Any, areas: Optional[Callable], msg: Message,
          peer: Optional[bytes]) -> torch.Tensor:
    """The area slot a header's ``x`` names, for this sender."""
    if type(link) is not int or not 0 < link < 2 ** 63:
        raise ProtocolError(Code.BAD_FIELD, "field 'x' must be a positive integer (a link)")
    if areas is None:
        raise ProtocolError(Code.NO_LINKS, "this peer takes no shared-area messages ('x'); "
                                           "send the tensors as frames")
    slot = areas(link, msg.worker, msg.incarnation) if peer is None else \
        areas(link, msg.worker, msg.incarnation, peer)
    if slot is None:
        raise ProtocolError(Code.UNKNOWN_LINK, f"no shared area {link} for worker "
                                               f"{msg.worker!r} incarnation {msg.incarnation} "
                                               "here; attach again or send frames")
    return slot


def _shared_segment(desc: Any, slot: torch.Tensor) -> Segment:
    """A float32 run of ``slot``, as a descriptor places it; checked against the slot."""
    if not (isinstance(desc, list) and len(desc) == 3):
        raise ProtocolError(Code.BAD_DESCRIPTOR, "a descriptor is [offset, dtype, shape]")
    offset, dtype_name, shape = desc
    if dtype_name != "float32":
        raise ProtocolError(Code.BAD_DTYPE, f"a shared area holds float32, not {dtype_name!r}")
    if not (isinstance(shape, list) and len(shape) == 1 and type(shape[0]) is int
            and type(offset) is int and 0 <= offset and 0 < shape[0]
            and offset + shape[0] <= len(slot)):
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"[{offset!r}, {shape!r}] is not a 1-D run "
                                                 f"inside the area's {len(slot)} elements")
    return Segment(offset, slot[offset:offset + shape[0]])


def _segment(desc: Any, buf: memoryview) -> Segment:
    if type(desc) is not list or len(desc) != 3:
        if type(desc) is list and len(desc) == 4 and desc[1] in (ROWS, IDS):
            return _rows_segment(desc, buf)
        if type(desc) is list and len(desc) == 4:
            return _packed_segment(desc, buf)
        raise ProtocolError(Code.BAD_DESCRIPTOR, "a descriptor is [offset, dtype, shape] or "
                                                 "[offset, format, [n], parameter]")
    offset, dtype_name, shape = desc
    if type(offset) is not int or offset < 0 or offset >= 2 ** 62:
        raise ProtocolError(Code.BAD_DESCRIPTOR,
                            f"offset {offset!r} is not a small non-negative int")
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise ProtocolError(Code.BAD_DTYPE, f"dtype {dtype_name!r} is not one of {sorted(DTYPES)}")
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int \
            and 0 <= shape[0] < 2 ** 40:
        numel = shape[0]  # the common 1-D case, without the general check's generator
    elif (type(shape) is list and len(shape) <= 8 and
            all(type(n) is int and 0 <= n < 2 ** 40 for n in shape)):
        numel = math.prod(shape)
    else:
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"shape {shape!r} is not a list of up to 8 sizes")
    if numel * ITEMSIZE[dtype] != len(buf):
        raise ProtocolError(Code.LENGTH_MISMATCH,
                            f"descriptor {shape} of {dtype_name} needs {numel * ITEMSIZE[dtype]} "
                            f"bytes, frame has {len(buf)}")
    if not numel:
        return Segment(offset, torch.empty(shape, dtype=dtype))
    data = torch.frombuffer(buf, dtype=dtype)  # 1-D already: view() costs as much again
    return Segment(offset, data if len(shape) == 1 else data.view(shape))


def _packed_segment(desc: list, buf: memoryview) -> Segment:
    """A packed segment's layout, checked against its frame; its values stay packed
    (``wire.compression.expand`` checks them once the receiver knows its slice)."""
    offset, fmt, shape, param = desc
    if type(offset) is not int or not 0 <= offset < 2 ** 62:
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"offset {offset!r} is not a small "
                                                 "non-negative int")
    if type(fmt) is not str or fmt not in (INT8, TOPK):
        raise ProtocolError(Code.BAD_DTYPE, f"packed format {fmt!r} is not {INT8} or {TOPK}")
    if not (type(shape) is list and len(shape) == 1 and type(shape[0]) is int
            and 0 < shape[0] < 2 ** 40):
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"a packed segment's shape is [n], n > 0, "
                                                 f"not {shape!r}")
    numel = shape[0]
    high = MAX_INT8_CHUNK if fmt == INT8 else numel
    if type(param) is not int or not 1 <= param <= high:
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"{fmt} parameter {param!r} is not an "
                                                 f"integer in [1, {high}]")
    need = packed_bytes(fmt, numel, param)
    if need != len(buf):
        raise ProtocolError(Code.LENGTH_MISMATCH, f"{fmt} segment of {numel} values "
                                                  f"({param}) needs {need} bytes, frame has "
                                                  f"{len(buf)}")
    return Segment(offset, Packed(fmt, numel, param, torch.frombuffer(buf, dtype=torch.uint8)))


# rows with values; ids alone (and in a push with m.pull true: the rows it asks back)
_ROWS_IN = {True: (PUSH, PARAMS), False: (PULL,)}


def _rows_segment(desc: list, buf: memoryview) -> Segment:
    """A row-sparse segment's form, checked against its frame (bounds first, so nothing
    is sized by a lie); its ids and values are ``wire.sparse``'s to check against a table."""
    n, dim, dtype_name = _rows_form(desc)
    table, fmt = desc[0], desc[1]
    need = rows_bytes(n, dim, dtype_name)
    if need != len(buf):
        raise ProtocolError(Code.LENGTH_MISMATCH, f"{fmt} segment of {n} ids"
                                                  f"{f' x {dim} {dtype_name}' if dim else ''} "
                                                  f"needs {need} bytes, frame has {len(buf)}")
    payload = torch.frombuffer(buf, dtype=torch.uint8)
    return Segment(table, Rows(table, n, dim, dtype_name, payload))


def _rows_form(desc: list) -> tuple:
    """``(n, dim, dtype)`` of a rows or ids descriptor ``[table, fmt, shape, dtype]``, each
    field checked and bounded."""
    table, fmt, shape, dtype_name = desc
    if type(table) is not int or not 0 <= table < MAX_TABLES:
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"table {table!r} is not an integer in "
                                                 f"[0, {MAX_TABLES})")
    allowed = WIRE_FLOATS if fmt == ROWS else ("int64",)
    if type(dtype_name) is not str or dtype_name not in allowed:
        raise ProtocolError(Code.BAD_DTYPE, f"{fmt} segment of {dtype_name!r}, not one of "
                                            f"{', '.join(allowed)}")
    sizes = 2 if fmt == ROWS else 1
    if not (type(shape) is list and len(shape) == sizes and
            all(type(k) is int and k > 0 for k in shape)):
        raise ProtocolError(Code.BAD_DESCRIPTOR, f"a {fmt} segment's shape is "
                                                 f"{'[n, dim]' if sizes == 2 else '[n]'}, "
                                                 f"sizes > 0, not {shape!r:.60}")
    n, dim = shape[0], (shape[1] if sizes == 2 else 0)
    if n > MAX_SEGMENT_ROWS or dim > MAX_ROW_DIM or n * dim > MAX_SEGMENT_VALUES:
        raise ProtocolError(Code.TOO_LARGE, f"a {fmt} segment of {n} x {dim} is above "
                                            f"{MAX_SEGMENT_ROWS} rows, {MAX_ROW_DIM} "
                                            f"columns or {MAX_SEGMENT_VALUES} values")
    return n, dim, dtype_name


def in_parts(msg: Message, lists: Optional[list] = None) -> list:
    """``msg`` as one message per segment, ``meta`` part j of ``parts`` on each (an
    ``ack`` in ``meta`` rides on part 0 only); ``lists``: each part's one-segment list,
    made once (``PartsCache``).

    Large PARAMS replies and pushes go out this way so that the receiver handles
    each part (a worker copies it, a shard checks it) while the next is still on
    the wire, instead of waiting for the whole.
    """
    parts = len(msg.segments)
    rest = {k: v for k, v in msg.meta.items() if k != Key.ACK}  # acknowledged once, by part 0
    return [Message(type=msg.type, worker=msg.worker, incarnation=msg.incarnation,
                    seq=msg.seq, clock=msg.clock, shard=msg.shard,
                    meta={**(msg.meta if j == 0 else rest), Key.PART: j, Key.PARTS: parts},
                    segments=[seg] if lists is None else lists[j], token=msg.token)
            for j, seg in enumerate(msg.segments)]


def parts_of(msg: Message) -> tuple:
    """``(part, parts)`` of a message sent in parts; ``(0, 1)`` for a whole one."""
    part, parts = msg.meta.get(Key.PART, 0), msg.meta.get(Key.PARTS, 1)
    if type(part) is not int or type(parts) is not int or not 0 <= part < parts <= MAX_SEGMENTS:
        raise ProtocolError(Code.BAD_FIELD, f"part {part!r} of {parts!r} is not a part number "
                                            f"below a count of at most {MAX_SEGMENTS}")
    return part, parts


def copy_into(msg: Message, flat: torch.Tensor, start: int = 0,
              size: Optional[int] = None) -> None:
    """Copy ``msg``'s segments into ``flat``, each at ``start`` + its offset; a segment
    outside the ``size`` values from ``start`` (the sender's slice; by default the rest
    of ``flat``) is a ``ProtocolError`` and nothing of ``msg`` is copied."""
    limit = flat.shape[0] - start if size is None else size
    for seg in msg.segments:
        if len(seg.data.shape) != 1 or seg.offset + seg.data.shape[0] > limit:
            raise ProtocolError(Code.OUT_OF_RANGE, (
                f"a segment of {list(seg.data.shape)} values at {seg.offset} does not fit "
                f"the {limit} values of the slice it was sent for"))
    for seg in msg.segments:
        at, n = start + seg.offset, seg.data.shape[0]
        # the whole of ``flat`` (a one-shard model): no slice to make
        (flat if at == 0 and n == flat.shape[0] else flat[at:at + n]).copy_(seg.data)


class ParamsIntake:
    """Copies PARAMS replies, whole or in parts, into a flat vector as they arrive, and
    says when a reply is complete. Shared by a worker and the server's evaluator.

    Replies are told apart by a key the caller chooses (e.g. ``(shard, seq)``); parts
    of one reply arrive in order on one connection, so counting them is enough.
    """

    def __init__(self):
        self._left: dict = {}  # key -> parts still to come

    def take(self, key: Any, msg: Message, flat: torch.Tensor, start: int = 0,
             size: Optional[int] = None) -> bool:
        """Copy ``msg`` (a PARAMS reply or one part of it) into ``flat`` at ``start``
        (a slice of ``size`` values: ``copy_into``); True once every part of the reply
        ``key`` has been copied."""
        meta = msg.meta
        parts = parts_of(msg)[1] if Key.PARTS in meta or Key.PART in meta else 1
        copy_into(msg, flat, start, size)
        if parts == 1 and not self._left:  # a whole reply, nothing else unfinished
            return True
        left = self._left.pop(key, parts) - 1
        if left > 0:
            self._left[key] = left
        return left <= 0

    def forget(self, where=lambda key: True) -> None:
        """Drop the counts of unfinished replies whose key satisfies ``where`` (all by
        default): a reply cut off between its parts comes again whole."""
        if not self._left:  # as before every exchange: nothing unfinished
            return
        for key in [k for k in self._left if where(k)]:
            del self._left[key]


def error_message(code: str, detail: str, reply_to: Any = None) -> Message:
    """The ERROR reply: what was wrong, echoing the offending message's sequence number
    and worker id (``reply_to``: the Message, or the ProtocolError that remembers them)."""
    return Message(type=ERROR, seq=reply_to.seq if reply_to else 0,
                   worker=reply_to.worker if reply_to else "",
                   meta={Key.CODE: code, Key.ERROR: detail[:1000]})
