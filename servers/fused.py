"""An async shard's common message in one pass: an admitted worker's one-segment push+pull.

``push_pull(state, peer, msg, now)`` answers it exactly as ``ShardState.handle`` would
through ``_on_push``, ``_push_then_pull``, ``_check``, ``_push``, ``_apply`` and
``_params_reply`` (same reply, counters, staleness, exactly-once and audit), without their
general matching, message objects and repeated look-ups: the ACK's fields go straight into
the PARAMS reply's meta. It returns None, having changed nothing, for anything else (first
contact, a duplicate, any refusal, compression, tables, parts, another consistency,
DC-ASGD, DyLU, a pull dtype, a push in parts applied early and still open), which the
general path then handles; so every refusal is the general path's. Figures:
experiments/README.md, "Shard internals".
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from asyncsgd.wire.protocol import PARAMS, PUSH, Key, Message, ProtocolError

from .consistency import Async
from .dedupe import FRESH
from .dylu import read_compute
from .rules import staleness_scale

_FLOAT32 = torch.float32
_WIRE = ("float32", "float32")  # how a worker's push and pulls travel (ShardState._wire)
# Meta keys that take a push off the common path: parts, a pull dtype, DyLU's steps
_UNCOMMON = (Key.PARTS, Key.PART, Key.PULL_DTYPE, Key.AUTO_STEPS)


def serves(state) -> bool:
    """Whether ``state``'s configuration has a common path at all: async, no tables, no
    DC-ASGD copies, no batch balance, no dispatcher (each adds to a push or its reply)."""
    cfg = state.cfg
    return (type(state.policy) is Async and not len(state.tables) and cfg.dc_lambda is None
            and cfg.balance != "batch" and state.balancer is None and state.dispatcher is None)


def push_pull(state, peer: bytes, msg: Message, now: float) -> Optional[list]:
    """The replies to the common message (``[(peer, params)]``), or None, nothing changed,
    for any other. ``state``: a settled ``ShardState`` whose configuration ``serves``."""
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
    for key in _UNCOMMON:
        if key in meta:
            return None
    seg = msg.segments[0]
    data, offset = seg.data, seg.offset
    if type(data) is not torch.Tensor or data.dtype is not _FLOAT32 or data.dim() != 1 \
            or type(offset) is not int:
        return None  # packed, rows, a narrower float or a shape to flatten
    n = data.shape[0]
    cfg = state.cfg
    if not n or offset < 0 or offset + n > state.size:
        return None
    seq = msg.seq
    if seq in record.waiting or record.window.classify(seq) != FRESH:
        return None  # a duplicate, a stale one again or out of the window
    if cfg.reject_nonfinite and not finite(data):
        return None
    if cfg.max_grad_norm is not None and \
            math.sqrt(float(data.double().pow(2).sum())) > cfg.max_grad_norm:
        return None
    if Key.COMPUTE in meta:
        try:
            read_compute(meta)
        except ProtocolError:
            return None
    # Admitted, checked, fresh: from here on it is applied (ShardState._sender, _wire,
    # _push, _apply and _params_reply, in that order).
    record.peer, record.last_seen = peer, now
    state.policy.now = state.now = now
    version = state.version
    clock = msg.clock if msg.clock < version else version  # a version from a past life
    record.wire = _WIRE
    staleness = version - clock
    scale = staleness_scale(staleness) if cfg.staleness_lr else 1.0
    state.rule.lr = state.schedule(version)
    state.store.update([(offset, data)], scale, deferrable=True)
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
    return [(peer, Message(PARAMS, "", 0, seq, version, cfg.index,
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
