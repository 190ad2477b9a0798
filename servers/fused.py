"""An async shard's common message in one pass: an admitted worker's push+pull of float32.

``push_pull(state, peer, msg, now)`` answers it exactly as ``ShardState.handle`` would
through ``_on_push``, ``_push_then_pull``, ``_check``, ``_push``, ``_apply`` and
``_params_reply`` (same reply, counters, staleness, exactly-once and audit), without their
general matching, message objects and repeated look-ups: the ACK's fields go straight into
the PARAMS reply's meta. A push of one segment is applied at once; a push in parts (a
large model's) is taken part by part as ``streams.PushStreams`` takes it, checked as each
arrives, and applied at its last. It returns None, having changed nothing, for anything
else (first contact, a duplicate, any refusal, compression, tables, another consistency,
DC-ASGD, DyLU, a pull dtype, parts applied as they arrive, a part that replaces or ends
another push, a bound on the gradient's norm for a push in parts), which the general path
then handles; so every refusal is the general path's. Figures: experiments/README.md,
"Shard internals".
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from asyncsgd.wire.protocol import MAX_SEGMENTS, PARAMS, PUSH, Key, Message, ProtocolError

from .consistency import Async
from .dedupe import FRESH
from .dylu import read_compute
from .rules import staleness_scale
from .streams import Open

_FLOAT32 = torch.float32
_WIRE = ("float32", "float32")  # how a worker's push and pulls travel (ShardState._wire)
# Meta keys that take a push off the common path: parts (``_part``), a pull dtype, DyLU's steps
_UNCOMMON = frozenset((Key.PARTS, Key.PART, Key.PULL_DTYPE, Key.AUTO_STEPS))
_PART_KEYS = (Key.PART, Key.PARTS)


def serves(state) -> bool:
    """Whether ``state``'s configuration has a common path at all: async, no tables, no
    DC-ASGD copies, no batch balance, no dispatcher (each adds to a push or its reply)."""
    cfg = state.cfg
    return (type(state.policy) is Async and not len(state.tables) and cfg.dc_lambda is None
            and cfg.balance != "batch" and state.balancer is None and state.dispatcher is None)


def push_pull(state, peer: bytes, msg: Message, now: float) -> Optional[list]:
    """The replies to the common message (``[(peer, params)]``, or ``[]`` for a part
    before the last), or None, nothing changed, for any other. ``state``: a settled
    ``ShardState`` whose configuration ``serves``."""
    meta = msg.meta
    if msg.type != PUSH or meta.get(Key.PULL) is not True or len(msg.segments) != 1 \
            or msg.shard != state.cfg.index:
        return None
    if state.early is not None:
        return None  # a push in parts applied early: undone first, in general (early.py)
    record = state.workers.get(msg.worker)
    if record is None or record.incarnation != msg.incarnation or not record.alive \
            or not record.reported_clock or not msg.worker:
        return None  # first contact, a departed or replaced worker: admitted in general
    if Key.PARTS in meta:
        return _part(state, record, peer, msg, now)
    if not _UNCOMMON.isdisjoint(meta):
        return None
    seg = msg.segments[0]
    data = _slice_values(state, seg)
    if data is None:
        return None
    cfg = state.cfg
    seq = msg.seq
    if not _fresh(record, seq, meta):
        return None
    if cfg.reject_nonfinite and not finite(data):
        return None
    if cfg.max_grad_norm is not None and \
            math.sqrt(float(data.double().pow(2).sum())) > cfg.max_grad_norm:
        return None
    # Admitted, checked, fresh: from here on it is applied (ShardState._sender, _wire,
    # _push, _apply and _params_reply, in that order).
    record.peer, record.last_seen = peer, now
    state.policy.now = state.now = now
    return _applied(state, record, seq, msg.clock, meta, [(seg.offset, data)])


def _part(state, record, peer: bytes, msg: Message, now: float) -> Optional[list]:
    """Part j of a push in parts, taken as ``ShardState._on_push`` takes it through
    ``PushStreams.add`` and ``_check`` (no parts applied early): ``[]`` before the last,
    the push applied and answered at its last; None, nothing changed, for a part the
    general path must see (one that starts a push while another is open or evicts one,
    breaks the sequence, or fails a check: its refusal is the general path's)."""
    cfg, meta = state.cfg, msg.meta
    if state._early_ok or cfg.max_grad_norm is not None or Key.PULL_DTYPE in meta \
            or Key.AUTO_STEPS in meta:
        return None
    part, parts = meta.get(Key.PART), meta[Key.PARTS]
    if type(part) is not int or type(parts) is not int or not 0 <= part < parts <= MAX_SEGMENTS:
        return None
    seg = msg.segments[0]
    data = _slice_values(state, seg)
    if data is None:
        return None
    offset, n = seg.offset, data.shape[0]
    streams = state.streams
    stream = streams.open.get(msg.worker)
    if part == 0:
        if stream is not None or len(streams.open) >= streams.max_open:
            return None  # it replaces a push, or evicts one: logged in general
    elif stream is None or stream.failed or part != stream.received or \
            (stream.seq, stream.incarnation, stream.parts) != (msg.seq, msg.incarnation, parts):
        return None
    values = n + (stream.values if stream is not None else 0)
    if values > streams.max_values:
        return None
    if cfg.reject_nonfinite and not finite(data):
        return None
    last = part == parts - 1
    if last:  # the whole push, as ``_push`` checks it once joined
        first = stream.first if stream is not None else msg
        whole = {k: v for k, v in first.meta.items() if k not in _PART_KEYS}
        spans = sorted([(s.offset, s.offset + s.data.shape[0])
                        for s in (stream.segments if stream is not None else ())]
                       + [(offset, offset + n)])
        if whole.get(Key.PULL) is not True or not _UNCOMMON.isdisjoint(whole) \
                or any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:])) \
                or not _fresh(record, first.seq, whole):
            return None
    # Taken: from here on, as ``_sender``, ``_wire`` and ``PushStreams.add`` do.
    record.peer, record.last_seen = peer, now
    state.policy.now = state.now = now
    version = state.version
    if msg.clock > version:  # a version from a past life
        msg.clock = version
    record.wire = _WIRE
    if part == 0:
        stream = streams.open[msg.worker] = Open(msg.seq, msg.incarnation, parts, msg, now)
    stream.values = values
    stream.received += 1
    stream.segments.append(seg)
    state.fused_parts += 1
    if not last:
        return []
    del streams.open[msg.worker]
    return _applied(state, record, first.seq, first.clock, whole,
                    [(s.offset, s.data) for s in stream.segments])


def _slice_values(state, seg) -> Optional[torch.Tensor]:
    """``seg``'s values when they are float32, flat and within the shard's slice; None for
    packed values, rows, a narrower float, a shape to flatten or a span outside it."""
    data, offset = seg.data, seg.offset
    if type(data) is not torch.Tensor or data.dtype is not _FLOAT32 or data.dim() != 1 \
            or type(offset) is not int:
        return None
    n = data.shape[0]
    return data if n and 0 <= offset and offset + n <= state.size else None


def _fresh(record, seq: int, meta: dict) -> bool:
    """Whether push ``seq`` is new to its worker's dedupe window, and what it reports of
    its compute readable (a duplicate or a refusal: the general path's)."""
    if seq in record.waiting or record.window.classify(seq) != FRESH:
        return False  # a duplicate, a stale one again or out of the window
    if Key.COMPUTE in meta:
        try:
            read_compute(meta)
        except ProtocolError:
            return False
    return True


def _applied(state, record, seq: int, clock: int, meta: dict, segments: list) -> list:
    """Apply an admitted, checked, fresh push of float32 ``segments`` [(offset, values)]
    and answer it, as ``_push``, ``_apply`` and ``_params_reply`` do."""
    cfg = state.cfg
    version = state.version
    if clock > version:  # a version from a past life
        clock = version
    record.wire = _WIRE
    staleness = version - clock
    scale = staleness_scale(staleness) if cfg.staleness_lr else 1.0
    state.rule.lr = state.schedule(version)
    state.store.update(segments, scale, deferrable=True)
    state.version = version = version + 1
    counters = state.counters
    counters["updates"] += 1
    if state.audit is not None:
        state.audit(record.worker, record.incarnation, seq, version)
    ack = {Key.APPLIED: True, Key.STALENESS: staleness, **state._told(record)}
    state._unsettled = (record, seq, meta, staleness)
    if not state.settle_later:
        state.settle()
    counters["pulls"] += 1
    state.fused_pushes += 1
    return [(record.peer, Message(PARAMS, "", 0, seq, version, cfg.index,
                                  {Key.VERSION: version, Key.UPDATES: counters["updates"],
                                   Key.ACK: ack}, state.store.views()))]


def finite(data: torch.Tensor) -> bool:
    """True when no element is NaN or Inf.

    A finite sum proves it (any NaN or Inf makes the sum NaN or Inf) and costs far
    less than ``isfinite(data).all()`` (experiments/README.md, "Shard internals");
    only a non-finite sum, which an overflow of finite values could also cause,
    needs the exact scan.
    """
    return math.isfinite(float(data.sum())) or bool(torch.isfinite(data).all())
