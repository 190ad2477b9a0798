"""One parameter-server shard's rules, as a plain object: no sockets, no processes.

``ShardState.handle(peer, message, now)`` returns the replies to a decoded request, each
addressed to a peer, and ``tick(now)`` drops silent workers. When a push is applied and a pull
answered is the consistency policy's (``consistency.py``); the parameters are the store's
(``store.py``), and ``shard_process.py`` moves the messages.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from asyncsgd.config import Consistency
from asyncsgd.core.coverage import of_samples
from asyncsgd.core.dispatch import Dispatcher
from asyncsgd.core.schedule import schedule
from asyncsgd.errors import ConfigError
from asyncsgd.wire.compression import expand, segment_values, wire_dtype
from asyncsgd.wire.protocol import (ACK, BYE, DTYPE_NAMES, ERROR, HEARTBEAT, PARAMS, PULL, PUSH,
                                    STATS, Code, Key, Message, ProtocolError,
                                    Segment, error_message)
from asyncsgd.wire.sparse import apart
from asyncsgd.wire.stats import STALENESS_BUCKETS

from .balance import Balancer
from .consistency import APPLY, STALE, live_workers, make_policy, min_live_clock
from .dedupe import DUPLICATE, FRESH, OUT_OF_WINDOW, STALE_AGAIN, Forgotten, SeqWindow
from .dylu import DyLU, read as read_dylu
from .early import EarlyPush
from .fused import finite as _finite, push_pull as fused_push_pull, serves as fused_serves
from .rules import dc_asgd, make_rule, staleness_scale
from .shard_tables import ShardTables, ids_of, rows_of
from .store import ParamStore
from .streams import PushStreams

log = logging.getLogger(__name__)

STATS_WORKERS = 32  # workers listed by name in a stats reply (the most recently seen)
FORGOTTEN_PER_RECORD = 16  # forgotten ids kept by name per worker record (a few ints each)


def params_digest(params: torch.Tensor) -> str:
    """SHA-256 of the parameters' bytes: proves a restored state equals its checkpoint."""
    return hashlib.sha256(params.detach().contiguous().view(torch.uint8).numpy()).hexdigest()


@dataclass
class ShardConfig:
    index: int
    start: int
    end: int
    rule: str = "sgd"
    lr: float = 0.1
    hyper: dict = field(default_factory=dict)
    consistency: Consistency = Consistency("async")  # text is parsed on construction
    expected_workers: int = 1
    heartbeat_timeout: float = 10.0
    staleness_lr: bool = False
    dc_lambda: Optional[float] = None
    sync_reduce: str = "mean"
    reject_nonfinite: bool = True
    max_grad_norm: Optional[float] = None
    # --early-parts: a push in parts applied as its parts arrive, where it can be (early.py)
    early_parts: bool = True
    dedupe_window: int = 1024
    # Worker records kept (each holds a dedupe window, and a copy of the slice under
    # DC-ASGD). Departed and silent workers are forgotten first; past the cap a new id
    # is refused. 0: 256 or 4 x the expected workers, whichever is larger.
    max_workers: int = 0
    # DC-ASGD copies of the slice (one per worker, refreshed on each pull). Past the cap
    # the least recently pulled copy is given up, and that worker's next push is applied
    # uncompensated (counted). 0: 2 x the expected workers, at least 8.
    max_dc_copies: int = 0
    # sync: a round is applied once all live workers but this many have pushed (Chen et
    # al. 2016's backup workers); the pushes that come after it are stale, never applied.
    # "auto": at an adaptive deadline (deadline.py).
    backup_workers: Union[int, str] = 0
    # --balance batch: rounds weighted by samples; shard 0 sizes each worker's batch (of
    # ``batch_size``, per worker, before the first re-sizing) every ``balance_every`` rounds
    balance: str = "none"
    balance_every: int = 20
    min_batch: int = 0
    batch_size: int = 0
    # --data-dispatch dynamic, on shard 0: (rows, epochs, seed, chunk) of its Dispatcher
    dispatch: Optional[tuple] = None
    # --lr-schedule and --warmup: the lr of update k (the version before it), core.schedule's
    lr_schedule: str = "constant"
    warmup: str = "0"
    # --table-lr: the lr of the tables' rule, scheduled as ``lr`` is; None: ``lr``
    table_lr: Optional[float] = None

    def __post_init__(self) -> None:
        if not isinstance(self.consistency, Consistency):
            self.consistency = Consistency(self.consistency)


@dataclass
class WorkerRecord:
    worker: str
    incarnation: int
    peer: bytes
    last_seen: float
    pushes: int = 0
    alive: bool = True
    window: Optional[SeqWindow] = None  # the pushes of this incarnation concluded
    waiting: set = field(default_factory=set)  # sync: seqs summed into the open round
    reported_clock: bool = False  # its first push/pull in this shard process was seen
    round_pushed: Optional[int] = None
    held_pull: Optional[Message] = None
    backup: Optional[torch.Tensor] = None
    backup_at: int = 0  # the shard's pull count when ``backup`` was taken
    wire: tuple = ("float32", "float32")  # how its latest push and pulls travelled
    # sync: the seqs of pushes waiting in the open round whose rows were applied on arrival
    # (rows are asynchronous): a re-sent one, to a shard restored meanwhile, applies no rows
    rows_applied: set = field(default_factory=set)


class ShardState:
    def __init__(self, cfg: ShardConfig, params: torch.Tensor, store: type = ParamStore,
                 settle_later: bool = False, tables: Sequence = (), table_specs: Sequence = (),
                 shards: int = 1, hash_ids: Optional[Callable] = None, fused: bool = True):
        """``store``: the ``ParamStore`` class holding the parameters (the shard process
        passes one that sends replies without copying). ``settle_later``: an async push
        is accounted by ``settle()``, which the caller calls once the reply is sent
        (the shard process does); by default at once. ``tables``: this shard's part
        (``SparseTable``) of each of the layout's row-sparse tables (``table_specs``),
        of ``shards`` shards in all; ``hash_ids``: core.sparse_ids.hash_id in a hashed
        id space. ``fused``: the common message (an admitted worker's async push+pull of
        float32, whole or in parts) takes ``fused.py``'s one pass, which answers exactly as
        the general path does; False: every message takes the general path (tests
        compare)."""
        if params.dim() != 1 or len(params) != cfg.end - cfg.start:
            raise ConfigError(f"shard {cfg.index}: {len(params)} initial values for range "
                              f"[{cfg.start}, {cfg.end})")
        self.cfg = cfg
        self.policy = make_policy(cfg.consistency.kind, cfg.consistency.bound, size=len(params),
                                  expected_workers=cfg.expected_workers,
                                  reduce=cfg.sync_reduce, backup_workers=cfg.backup_workers,
                                  weighted=cfg.balance == "batch")
        self.balancer = None  # shard 0's under --balance batch: what it tells each worker
        if cfg.balance == "batch" and cfg.index == 0:
            if cfg.batch_size < 1:
                raise ConfigError("--balance batch needs each worker's --batch-size")
            self.balancer = Balancer(cfg.batch_size, cfg.expected_workers, cfg.balance_every,
                                     cfg.min_batch)
        self.size = len(params)
        self.tables = ShardTables(tables, table_specs, cfg.index, shards, hash_ids,
                                  lr_ratio=cfg.table_lr / cfg.lr if cfg.table_lr else 1.0)
        self.now = 0.0  # the clock of the message handled (or tick): rows' ages use it
        self.max_workers = cfg.max_workers or max(256, 4 * cfg.expected_workers)
        self.max_dc_copies = cfg.max_dc_copies or max(8, 2 * cfg.expected_workers)
        self.store = store(params.detach().clone().float(),
                           make_rule(cfg.rule, self.size, cfg.lr, **cfg.hyper))
        self.version = 0
        self.schedule = schedule(cfg.lr, cfg.lr_schedule, cfg.warmup, counted="updates")
        self.workers: dict = {}
        self.forgotten = Forgotten(FORGOTTEN_PER_RECORD * self.max_workers)
        self.counters = {"updates": 0, "pushes": 0, "duplicates": 0, "rejected": 0,
                         "nonfinite": 0, "too_large": 0, "pulls": 0, "held_pulls": 0,
                         "dropped_workers": 0, "max_pull_lead": 0, "stale": 0,
                         "lost_updates": 0, "refused_workers": 0, "forgotten_workers": 0,
                         "dc_uncompensated": 0,
                         # pushes in parts applied as their parts came (early.py), and those
                         # undone before their commit (applied whole later, or never)
                         "early_pushes": 0, "early_undone": 0}
        self.staleness = [0] * STALENESS_BUCKETS
        self.restored: Optional[dict] = None  # version and digest of the checkpoint loaded
        self.lost_before = 0  # updates lost by earlier lives of this shard
        self.train = {}  # worker -> [loss sum, steps, samples] reported with pushes
        self.train_forgotten = [0.0, 0, 0]  # the same, summed over forgotten workers
        self.traffic = {}  # worker -> [bytes sent, bytes received] it reported with pushes
        self.traffic_forgotten = [0, 0]
        # Pushes in parts: each part is checked (ranges, ids, NaN/Inf, not the norm) on arrival.
        self.streams = PushStreams(lambda part: self._check(part, norm=False), self.size,
                                   max_open=max(16, 2 * cfg.expected_workers),
                                   row_width=self._row_width)
        # A push in parts applied as its parts arrive, not yet committed (``_early_part``)
        self.early: Optional[EarlyPush] = None
        self._early_ok = (cfg.early_parts and cfg.consistency.kind in ("async", "ssp")
                          and cfg.dc_lambda is None
                          and cfg.max_grad_norm is None and not len(self.tables))
        # (record, seq, meta, staleness) of the latest async push, applied and answered but
        # not yet accounted: see ``settle``.
        self.settle_later = settle_later
        self._unsettled: Optional[tuple] = None
        # --audit-dir: called (worker, incarnation, seq, version after) per push applied
        self.audit: Optional[Callable[[str, int, int, int], None]] = None
        self.dylu = DyLU()  # --local-steps auto: each worker's H, shard 0's to decide
        self.dispatcher = Dispatcher(*cfg.dispatch) if cfg.dispatch else None
        self._handlers = {HEARTBEAT: self._on_heartbeat, BYE: self._on_bye,
                          PULL: self._on_pull, PUSH: self._on_push}
        self.fused = fused and fused_serves(self)
        self.fused_pushes = 0  # pushes answered by the fused path
        self.fused_parts = 0  # parts of pushes in parts it took

    @property
    def params(self) -> torch.Tensor:
        """The shard's parameters, every update applied."""
        return self.store.params

    @property
    def rule(self):
        """The update rule (optimizer) applied to the parameters."""
        return self.store.rule

    # ---- requests -------------------------------------------------------------------

    def handle(self, peer: bytes, msg: Message, now: float) -> list:
        """The replies to ``msg`` from ``peer`` at ``now`` (monotonic seconds): [(peer, reply)]."""
        if self._unsettled is not None:
            self.settle()
        if self.fused:
            replies = fused_push_pull(self, peer, msg, now)
            if replies is not None:
                return replies
        self.policy.now = self.now = now  # a sync round's deadline times its pushes on it
        if msg.type == STATS:  # anyone may ask: no worker, no checks
            return [(peer, Message(type=STATS, shard=self.cfg.index, seq=msg.seq,
                                   meta=self.stats(now)))]
        if Key.PULL_DTYPE in msg.meta:  # the dtype a pull asks its parameters in
            try:
                wire_dtype(msg.meta[Key.PULL_DTYPE])
            except ProtocolError as exc:
                return self.refuse(peer, exc.code, str(exc), msg)
        if msg.type == PUSH and msg.shard != self.cfg.index:  # before its sender is recorded
            return self.refuse(peer, Code.BAD_FIELD, f"a push for shard {msg.shard} reached "
                               f"shard {self.cfg.index}; a push names the shard it is for", msg)
        if msg.type == PULL and msg.meta.get(Key.OBSERVER) is True:
            # The server's evaluator reads parameters; it is no worker and joins no barrier.
            problem = self.tables.check(apart(msg.segments)[1], creates=False)
            if problem:
                return self.refuse(peer, *problem, msg)
            return [(peer, self._params_reply(None, msg))]
        record = self._sender(peer, msg, now)
        if isinstance(record, list):  # refused
            return record
        return self._handlers.get(msg.type, self._on_other)(record, msg, now)

    def _on_heartbeat(self, record: WorkerRecord, msg: Message, now: float) -> list:
        return [(record.peer, Message(type=HEARTBEAT, shard=self.cfg.index, seq=msg.seq))]

    def _on_bye(self, record: WorkerRecord, msg: Message, now: float) -> list:
        record.alive = False
        record.backup = None  # a DC-ASGD copy of the slice is kept for live workers only
        self._give_back(record.worker)
        return [(record.peer, Message(type=BYE, shard=self.cfg.index, seq=msg.seq))] + \
            self._release()

    def _on_pull(self, record: WorkerRecord, msg: Message, now: float) -> list:
        self._wire(record, msg)
        problem = self._check_ids(msg)
        if problem:
            return self.refuse(record.peer, *problem, msg)
        return self._pull(record, msg)

    def _on_push(self, record: WorkerRecord, msg: Message, now: float) -> list:
        self._wire(record, msg)
        checked = False  # whether the gradient is known to be finite (checked part by part)
        if Key.PARTS in msg.meta:
            before = self.streams.open.get(msg.worker)
            try:
                whole, problem = self.streams.add(msg, now)
            except ProtocolError as exc:
                whole, problem = None, (exc.code, str(exc))
            self._early_part(record, msg, before, whole, problem)
            if problem:
                return self.refuse(record.peer, *problem, msg)
            if whole is None:
                return []
            msg, checked = whole, self.cfg.reject_nonfinite
        replies = (self._push_then_pull(record, msg, checked) if msg.meta.get(Key.PULL) is True
                   else self._push(record, msg, checked))
        if self.early is not None and self.early.whole is msg:  # not applied after all
            self._undo_early()
        return replies

    # ---- pushes applied as their parts arrive (early.py) -----------------------------

    def _early_part(self, record: WorkerRecord, msg: Message, before, whole, problem) -> None:
        """Apply a part just taken by ``streams`` (``before``: its worker's open push
        before it) to the early push it belongs to, start one at a part 0, or undo the
        early push that the part ended (refused, replaced, dropped).

        Only one push is early at a time, and only where the whole push would be applied
        on arrival of its last part with nothing but its own segments: async and ssp,
        without DC-ASGD (its compensation reads what the worker pulled), --max-grad-norm
        (a bound on the whole gradient) or tables (rows have their own state); sync rounds
        and backup workers sum whole pushes. Elsewhere, and for a push that arrives while
        another is early, the whole push is applied at its last part, as before."""
        early = self.early
        if early is not None:
            if whole is not None and before is early.stream and not problem:
                early.whole = whole  # its last part: applied now, committed by ``_apply``
                self._take_early(whole.segments[-1])
                return
            stream = self.streams.open.get(early.stream.first.worker)
            if stream is early.stream and not stream.failed:
                if msg.worker == stream.first.worker and whole is None and not problem:
                    self._take_early(stream.segments[-1])
                return
            self._undo_early()  # then this part may start the next
        stream = self.streams.open.get(msg.worker)
        # Another worker's push open: its parts would likely end this one's early (when it
        # is applied first, which undoes this), so the work done early would be wasted
        if (not self._early_ok or problem or whole is not None or stream is None
                or stream.received != 1 or stream is before or len(self.streams.open) > 1
                or record.window.classify(msg.seq) != FRESH):
            return
        self.rule.lr = self.schedule(self.version)
        scale = staleness_scale(self.version - msg.clock) if self.cfg.staleness_lr else 1.0
        self.early = EarlyPush(self.store, stream, self.rule.lr, scale)
        self._take_early(stream.segments[0])

    def _take_early(self, seg) -> None:
        """Apply one checked part to the early push; a part overlapping one taken before
        undoes it (the whole push is then refused, as a whole one would be)."""
        if not self.early.take(seg.offset, seg.data):
            self._undo_early()

    def _undo_early(self) -> None:
        """Undo the early push: before anything else writes the parameters or reads the
        rule's state, and when its push will not be applied after all."""
        if self.early is not None:
            self.early.undo()
            self.early = None
            self.counters["early_undone"] += 1

    def _on_other(self, record: WorkerRecord, msg: Message, now: float) -> list:
        return [(record.peer, error_message(Code.BAD_TYPE,
                                            f"a shard does not serve {msg.type!r}", msg))]

    def _wire(self, record: WorkerRecord, msg: Message) -> None:
        """Note how a worker's push and pulls travel (``stats``): a push's first segment's
        format (its values are checked and widened by ``_check``), and the ``pull_dtype``
        of a pull or of a push that pulls (one that does not says nothing of its pulls)."""
        push, pull = record.wire
        dense, rows = apart(msg.segments) if msg.type == PUSH else ((), ())
        if dense:
            first = dense[0].data
            push = getattr(first, "format", None) or DTYPE_NAMES.get(first.dtype, "?")
        elif rows:  # a push of rows alone: how its rows travel
            push = rows[0].data.dtype
        if msg.type == PULL or msg.meta.get(Key.PULL) is True:
            pull = msg.meta.get(Key.PULL_DTYPE) or "float32"
        record.wire = (push, pull)

    def refuse(self, peer: bytes, code: str, detail: str, msg=None) -> list:
        """The reply to a request that is refused (malformed, or one the shard failed on):
        an error, counted; nothing of it is applied. ``msg``: the request, or the
        ProtocolError that remembers its readable ``s`` and ``w``."""
        self.counters["rejected"] += 1
        return [(peer, error_message(code, detail, msg))]

    # ---- who sent it -----------------------------------------------------------------

    def _sender(self, peer: bytes, msg: Message, now: float):
        """The record of ``msg``'s worker, admitted and touched, or the replies refusing it."""
        if not msg.worker:
            return [(peer, error_message(Code.UNKNOWN_WORKER, "requests need a worker id", msg))]
        record = self.workers.get(msg.worker)
        if record is not None and record.incarnation == msg.incarnation and record.alive:
            record.peer, record.last_seen = peer, now  # the common case: a known live worker
        else:
            refusal = self._admit(msg)
            if refusal:
                self.counters["refused_workers"] += 1
                return self.refuse(peer, *refusal, msg)
            record = self._touch(peer, msg, now)
        if msg.type in (PUSH, PULL) and not record.reported_clock:
            record.reported_clock = True
            self._count_lost(record, msg.clock)
        if not self.policy.stale_if_ahead:
            msg.clock = min(msg.clock, self.version)  # a version from a past life: now is freshest
        return record

    def _admit(self, msg: Message) -> Optional[tuple]:
        """(code, detail) when ``msg``'s sender may not be served; None when it may.

        An incarnation older than the newest one its worker id has shown is a
        process that was replaced: it must not touch the new one's records.
        Past ``max_workers`` records a silent or departed worker's is forgotten to
        make room for a new id; when every one is live, the new id is refused. What a
        forgotten record leaves behind (``Forgotten``) refuses an id without a record whose
        incarnation is older than the one it bounds it by.
        """
        record = self.workers.get(msg.worker)
        if record is not None:
            if msg.incarnation < record.incarnation:
                return Code.OLD_INCARNATION, (
                    f"worker {msg.worker!r} incarnation {msg.incarnation} was replaced by "
                    f"incarnation {record.incarnation}; a restarted worker takes a new, "
                    "larger incarnation")
            return None
        if len(self.workers) >= self.max_workers:
            gone = [w for w in self.workers.values() if not w.alive and w.held_pull is None
                    and not w.waiting]
            if not gone:
                return Code.TOO_MANY_WORKERS, (
                    f"shard {self.cfg.index} already serves {len(self.workers)} live workers "
                    f"(its cap); a new worker id is refused until one leaves")
            self._forget(min(gone, key=lambda w: w.last_seen))
        bound = self.forgotten.bound(msg.worker)
        if bound is not None and msg.incarnation < bound[0]:
            return Code.OLD_INCARNATION, (
                f"worker {msg.worker!r} incarnation {msg.incarnation} is older than "
                f"incarnation {bound[0]}, which shard {self.cfg.index} forgot: it cannot tell "
                "what this one applied; a restarted worker takes a new, larger incarnation")
        return None

    def _forget(self, record: WorkerRecord) -> None:
        """Drop a departed worker's record, keeping what refuses its old pushes."""
        del self.workers[record.worker]
        self._give_back(record.worker)
        self.dylu.forget(record.worker)
        if self.balancer is not None:
            self.balancer.forget(record.worker)
        self.forgotten.remember(record.worker, record.incarnation, record.window)
        for i, value in enumerate(self.train.pop(record.worker, ())):
            self.train_forgotten[i] += value
        for i, value in enumerate(self.traffic.pop(record.worker, ())):
            self.traffic_forgotten[i] += value
        self.counters["forgotten_workers"] += 1

    def _touch(self, peer: bytes, msg: Message, now: float) -> WorkerRecord:
        record = self.workers.get(msg.worker)
        if record is None or record.incarnation != msg.incarnation:
            clock = min_live_clock(self.workers)
            if record is not None:  # a restarted worker: new incarnation, fresh dedupe window
                self._give_back(record.worker)
                log.info("shard %d: worker %s restarted (incarnation %d)", self.cfg.index,
                         msg.worker, msg.incarnation)
                clock = max(record.pushes, clock or 0)
                floor = -1
            else:  # new, or forgotten: pushes at or below what it may have concluded are refused
                bound = self.forgotten.bound(msg.worker)
                floor = bound[1] if bound is not None and bound[0] == msg.incarnation else -1
                self.forgotten.readmit(msg.worker)
            record = WorkerRecord(msg.worker, msg.incarnation, peer, now, pushes=clock or 0,
                                  window=SeqWindow(self.cfg.dedupe_window, floor))
            self.workers[msg.worker] = record
        elif not record.alive:
            record.pushes = max(record.pushes, min_live_clock(self.workers) or 0)
        record.alive = True
        record.peer = peer
        record.last_seen = now
        return record

    def _count_lost(self, record: WorkerRecord, clock: int) -> None:
        """The first version a worker reports to a restored shard process is one it saw
        before.

        Beyond the version restored from the checkpoint, it proves the shard had
        applied updates that a crash has since lost; the largest such gap over all
        workers is their number. A shard that was never restored lost nothing,
        whatever a worker's first ``c`` says (a new worker may carry any).
        """
        if self.restored is None:
            return
        start = self.restored["version"]
        lost = self.lost_before + clock - start
        if lost > self.counters["lost_updates"]:
            log.warning("shard %d: worker %s saw version %d but this shard restarted at %d: "
                        "%d acknowledged update(s) lost", self.cfg.index, record.worker, clock,
                        start, clock - start)
            self.counters["lost_updates"] = lost

    # ---- pulls ----------------------------------------------------------------------

    def _check_ids(self, msg: Message) -> Optional[tuple]:
        """(code, detail) when the ids a pull (or a push that pulls) asks back must be
        refused; checked before the pull is answered or held."""
        asked = ids_of(apart(msg.segments)[1])
        return self.tables.check(asked) if asked else None

    def _row_width(self, table: int) -> int:
        """The dim of table ``table``, 0 when there is no such table (a part's check refuses
        it): what one row of it holds, for the bound on a push's parts."""
        specs = self.tables.specs
        return specs[table].dim if 0 <= table < len(specs) else 0

    def _pull(self, record: WorkerRecord, msg: Message) -> list:
        if self.policy.may_answer(record, self.workers, self.version):
            return [(record.peer, self._params_reply(record, msg))] + self._release()
        record.held_pull = msg
        self.counters["held_pulls"] += 1
        return self._release()  # a newly joined worker may complete the expected set

    def _params_reply(self, record: Optional[WorkerRecord], msg: Message) -> Message:
        self.counters["pulls"] += 1
        lead = None if record is None else self.policy.lead(record, self.workers)
        if lead is not None:
            self.counters["max_pull_lead"] = max(self.counters["max_pull_lead"], lead)
        if record is not None and self.cfg.dc_lambda is not None:
            self._keep_copy(record)
        segments = self.store.views()
        dtype = wire_dtype(msg.meta[Key.PULL_DTYPE]) if Key.PULL_DTYPE in msg.meta else None
        if dtype is not None:  # cast copies: what is pending on the views is applied first
            self.store.apply_pending()
            segments = [Segment(s.offset, s.data.to(dtype), transient=True) for s in segments]
        asked = ids_of(apart(msg.segments)[1])
        if asked:  # after the dense slice, one rows segment per ids segment, in order
            segments = list(segments) + self.tables.gather(asked, self.now, dtype,
                                                           observer=record is None)
        meta = {Key.VERSION: self.version, Key.UPDATES: self.counters["updates"]}
        if self.balancer is not None and record is not None:
            meta[Key.BATCH] = self.balancer.batch_of(
                record.worker, [w.worker for w in live_workers(self.workers)])
        if record is not None and self.dispatcher is not None:  # the rows it trains next
            meta[Key.CHUNKS] = [[c.epoch, c.start, c.stop]
                                for c in self.dispatcher.top_up(record.worker)]
            meta[Key.CHUNK_SEED] = self.dispatcher.seed
            meta[Key.ALL_TRAINED] = self.dispatcher.finished
        return Message(type=PARAMS, shard=self.cfg.index, seq=msg.seq, clock=self.version,
                       meta=meta, segments=segments)

    def _keep_copy(self, record: WorkerRecord) -> None:
        """DC-ASGD compensates a push against the parameters its worker pulled: a copy of
        the slice per worker, so at most ``max_dc_copies`` of them, the least recently
        pulled given up first (what unbounded copies cost: experiments/README.md,
        "Shard internals")."""
        if record.backup is None:
            holders = [r for r in self.workers.values() if r.backup is not None]
            if len(holders) >= self.max_dc_copies:
                oldest = min(holders, key=lambda r: r.backup_at)
                record.backup, oldest.backup = oldest.backup, None
            else:
                record.backup = torch.empty_like(self.params)
        record.backup.copy_(self.params)
        record.backup_at = self.counters["pulls"]

    def _release(self) -> list:
        """Answer every held pull that is now allowed, then apply a round now complete."""
        out = []
        for record in self.policy.releasable(self.workers, self.version):
            out.append((record.peer, self._params_reply(record, record.held_pull)))
            record.held_pull = None
        return out + self._finish_round()

    # ---- pushes ---------------------------------------------------------------------

    def _check(self, msg: Message, finite: bool = True, norm: bool = True,
               ids: bool = True) -> Optional[tuple]:
        """(code, detail) when the push must be refused, checked before anything is applied.

        ``finite`` False skips the NaN/Inf scan of a push whose parts passed it on
        arrival; ``norm`` False skips the gradient-norm bound (a part alone has none);
        ``ids`` False skips the ids it asks back, which ``_check_ids`` just checked.
        """
        # Checked here, before anything is applied: the rule's apply() trusts these. The
        # spans first, from the descriptors: a packed segment is expanded (allocated) only
        # once every one of them is known to fit, apart, in this slice. Rows (and the ids
        # of a push that pulls) are the tables' to check, before any value is read.
        dense, rows = apart(msg.segments)
        spans = []
        for seg in dense:
            numel = segment_values(seg)
            if numel is None and seg.data.dtype not in (torch.float32, torch.bfloat16,
                                                        torch.float16):
                return Code.BAD_DTYPE, (f"a gradient is float32 (bfloat16 or float16, widened) "
                                        f"or packed, not {seg.data.dtype}")
            if numel is None:
                return Code.BAD_DESCRIPTOR, "a gradient segment holds at least one value"
            end = seg.offset + numel
            if end > self.size:
                return Code.OUT_OF_RANGE, (f"segment [{seg.offset}, {end}) "
                                           f"outside shard {self.cfg.index} of size {self.size}")
            spans.append((seg.offset, end))
        if len(spans) > 1:
            spans.sort()
            if any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:])):
                return Code.BAD_DESCRIPTOR, "segments must not overlap"
        # Row values are always scanned: a table applies no NaN, whatever --reject-nonfinite
        problem = self.tables.check(rows if ids else rows_of(rows), finite=finite)
        if problem:
            if problem[0] == Code.NON_FINITE:
                self.counters["nonfinite"] += 1
            return problem
        try:
            dense = [expand(seg, self.size) for seg in dense]
        except ProtocolError as exc:
            return exc.code, str(exc)
        msg.segments = dense + rows
        if finite and self.cfg.reject_nonfinite:
            for seg in dense:
                if not _finite(seg.data):
                    self.counters["nonfinite"] += 1
                    return Code.NON_FINITE, ("the gradient holds NaN or Inf values; nothing was "
                                             "applied")
        if norm and self.cfg.max_grad_norm is not None:  # rows count: one gradient
            norm = math.sqrt(sum(float(s.data.double().pow(2).sum()) for s in dense) +
                             self.tables.squares(rows))
            if norm > self.cfg.max_grad_norm:
                self.counters["too_large"] += 1
                return Code.TOO_LARGE, (f"gradient norm {norm:.4g} on shard {self.cfg.index} "
                                        f"exceeds --max-grad-norm {self.cfg.max_grad_norm}")
        return None

    def _push(self, record: WorkerRecord, msg: Message, checked: bool = False,
              ids_checked: bool = False) -> list:
        """Apply (or hold, or refuse) a push; ``checked``: its parts passed the NaN/Inf scan
        on arrival; ``ids_checked``: the ids it asks back passed ``_check_ids``."""
        peer = record.peer
        if msg.seq in record.waiting:  # a retry of a push waiting for its round: answered then
            self.counters["duplicates"] += 1
            return []
        verdict = record.window.classify(msg.seq)
        if verdict == DUPLICATE:
            self.counters["duplicates"] += 1
            return [(peer, Message(type=ACK, shard=self.cfg.index, seq=msg.seq,
                                   meta={Key.APPLIED: False, Key.DUPLICATE: True}))]
        if verdict == STALE_AGAIN:  # its stale ack was lost: it was never applied
            self.counters["duplicates"] += 1
            return [(peer, Message(type=ACK, shard=self.cfg.index, seq=msg.seq,
                                   meta={Key.APPLIED: False, Key.STALE: True}))]
        if verdict == OUT_OF_WINDOW:
            return self.refuse(peer, Code.OUT_OF_WINDOW, (
                f"push {msg.seq} is at or below {record.window.floor}, the oldest sequence "
                f"number shard {self.cfg.index} has forgotten: it cannot tell whether it was "
                "applied, so it applies nothing"), msg)
        problem = self._check(msg, finite=not checked, ids=not ids_checked) or \
            self._note_speed(record, msg.meta)
        if problem:
            return self.refuse(peer, *problem, msg)
        weight = 1.0
        if self.cfg.balance == "batch":  # the round weighs each push by its samples
            weight = msg.meta.get(Key.SAMPLES)
            if type(weight) is not int or weight < 1:
                return self.refuse(peer, Code.BAD_FIELD, "under --balance batch a push names "
                                   "its samples ('m.samples', at least 1)", msg)
            if self.balancer is not None:
                self.balancer.observe(record.worker, weight, msg.meta.get(Key.COMPUTE))
        staleness = self.version - msg.clock
        dense, rows = apart(msg.segments)
        verdict = self.policy.push(record, dense, msg.seq, staleness, self.version,
                                   weight=weight)
        if self.dispatcher is not None and verdict != STALE:  # a stale push's rows: again
            self.dispatcher.done(record.worker, msg.meta.get(Key.SAMPLES, 0))
        if verdict == APPLY:
            return self._apply(record, msg, staleness)
        self._account(record, msg.meta, max(0, staleness))  # ahead: from a version since lost
        if verdict == STALE:
            self.counters["stale"] += 1
            record.window.add(msg.seq, stale=True)
            return [(peer, Message(type=ACK, shard=self.cfg.index, seq=msg.seq,
                                   meta={Key.APPLIED: False, Key.STALE: True}))]
        record.pushes += 1
        # Concluded only when its round is applied: a round cut short by a crash is not in
        # the checkpoint, so its pushes must count as fresh when re-sent to the restored shard.
        record.waiting.add(msg.seq)
        # Its rows are applied now, not with the round: tables stay asynchronous under sync
        # (Persia's hybrid), and are in a checkpoint taken before the round closes.
        if rows and msg.seq not in record.rows_applied:
            self.tables.apply(rows, self.now, self.schedule(self.version))
            record.rows_applied.add(msg.seq)
        return self._finish_round()

    def _apply(self, record: WorkerRecord, msg: Message, staleness: int) -> list:
        dense, rows = apart(msg.segments)
        segments = self._compensated(record, dense)
        scale = staleness_scale(staleness) if self.cfg.staleness_lr else 1.0
        # The reply to this push is the next reader of the parameters only when nothing is
        # held and without DC-ASGD: DC-ASGD copies what is pulled, and a held pull may be
        # answered at once.
        at_once = self.policy.answers_at_once
        self.rule.lr = self.schedule(self.version)
        if rows:  # same lr, same staleness scale; DC-ASGD compensates the dense slice only
            self.tables.apply(rows, self.now, self.rule.lr, scale)
        early = self.early
        if early is not None and early.whole is msg and (early.lr, early.scale) == (
                self.rule.lr, scale):
            self.early = None
            early.commit()  # its parts are applied: the scratch becomes the parameters
            self.counters["early_pushes"] += 1
        elif segments:  # a push of rows alone is no step of the dense rule (Adam's count)
            self._undo_early()
            self.store.update(segments, scale, deferrable=(
                at_once and self.cfg.dc_lambda is None and msg.meta.get(Key.PULL) is True))
        self.version += 1
        self.counters["updates"] += 1
        if self.audit is not None:
            self.audit(record.worker, record.incarnation, msg.seq, self.version)
        ack = Message(type=ACK, shard=self.cfg.index, seq=msg.seq, clock=self.version,
                      meta={Key.APPLIED: True, Key.STALENESS: staleness, **self._told(record)})
        self._unsettled = (record, msg.seq, msg.meta, staleness)
        if at_once and self.settle_later:
            return [(record.peer, ack)]
        self.settle()  # it counts towards releasing held pulls at once
        return [(record.peer, ack)] + self._release()

    def settle(self) -> None:
        """Account the latest applied push: its sequence number into the worker's dedupe
        window, its clock, staleness, reported loss and traffic.

        With ``settle_later``, under a policy that answers at once, this waits until the
        push's reply has gone out: the shard process calls it right after sending, while
        the worker reads the reply, instead of before (experiments/README.md, "Shard
        internals"). ``handle``, ``tick``, ``stats`` and ``state_dict`` settle first, so
        none of them sees the push unaccounted.
        """
        if self._unsettled is None:
            return
        record, seq, meta, staleness = self._unsettled
        self._unsettled = None
        record.window.add(seq)
        record.pushes += 1
        self._account(record, meta, staleness)

    def _account(self, record: WorkerRecord, meta: dict, staleness: int) -> None:
        """Count a push the shard takes (applied now, or summed into a sync round)."""
        self.staleness[min(staleness, STALENESS_BUCKETS - 1)] += 1
        self._note_train(record.worker, meta)
        self.counters["pushes"] += 1

    def _push_then_pull(self, record: WorkerRecord, msg: Message, checked: bool = False) -> list:
        """A push that also asks for the parameters: one request, and one reply when it can.

        When the acknowledgement and the parameters go out together, the ACK's
        fields ride in the PARAMS reply (``meta["ack"]``), halving the messages of
        a step. Under sync both wait for the round, and go out as two replies.
        """
        # The rows it asks back first: even a duplicate's reply gathers them.
        problem = self._check_ids(msg)
        if problem:
            return self.refuse(record.peer, *problem, msg)
        replies = self._push(record, msg, checked, ids_checked=True)
        if self.policy.answers_at_once and len(replies) == 1 and replies[0][1].type == ACK:
            # The common case, without the general matching below: nothing is held, so
            # the push's one ACK and the parameters always go out together.
            params = self._params_reply(record, msg)
            params.meta[Key.ACK] = replies[0][1].meta
            return [(record.peer, params)]
        if any(r.type == ERROR for _, r in replies):
            return replies
        pulled = self._pull(record, msg)
        own = [(i, r) for i, (p, r) in enumerate(replies) if p == record.peer and r.type == ACK
               and r.seq == msg.seq]
        params = [r for p, r in pulled if p == record.peer and r.type == PARAMS
                  and r.seq == msg.seq]
        if own and params and self.cfg.consistency.kind != "sync":  # sync: an ack, then params
            params[0].meta[Key.ACK] = own[0][1].meta
            del replies[own[0][0]]
        return replies + pulled

    def _compensated(self, record: WorkerRecord, dense: list) -> list:
        """A push's dense segments as (offset, gradient), DC-ASGD-compensated when on. Rows
        are not: that would keep a copy of every row a worker pulled, per worker."""
        if self.cfg.dc_lambda is None or record.backup is None:
            if self.cfg.dc_lambda is not None:
                self.counters["dc_uncompensated"] += 1  # it never pulled, or its copy was given up
            return [(s.offset, s.data) for s in dense]
        return [(s.offset, dc_asgd(s.data, self.params[s.offset:s.offset + len(s.data)],
                                   record.backup[s.offset:s.offset + len(s.data)],
                                   self.cfg.dc_lambda)) for s in dense]

    # ---- sync rounds ------------------------------------------------------------------

    def _finish_round(self) -> list:
        """Apply the policy's round once it is complete, acknowledge its pushes, release."""
        update = self.policy.round_update(self.workers, self.version)
        if update is None:
            return []
        self._undo_early()
        self.rule.lr = self.schedule(self.version)
        self.store.update([(0, update)])
        members = self.policy.next_round()
        self.version += 1
        self.counters["updates"] += 1
        if self.balancer is not None:  # before the pulls of the next round are answered
            self.balancer.round_closed([w.worker for w in live_workers(self.workers)])
        acks = []
        for record, seq in members:
            if self.audit is not None:
                self.audit(record.worker, record.incarnation, seq, self.version)
            record.window.add(seq)
            record.waiting.discard(seq)
            record.rows_applied.discard(seq)
            # To the peer it spoke from last: a retry may have come on a new connection.
            acks.append((record.peer, Message(type=ACK, shard=self.cfg.index, seq=seq,
                                              clock=self.version,
                                              meta={Key.APPLIED: True, Key.STALENESS: 0,
                                                    **self._told(record)})))
        return acks + self._release()

    # ---- DyLU: local steps sized to speed (dylu.py) ----------------------------------

    def _note_speed(self, record: WorkerRecord, meta: dict) -> Optional[tuple]:
        """Check a push's DyLU fields (every shard); shard 0 notes its worker's speed."""
        try:
            said = read_dylu(meta)
        except ProtocolError as exc:
            return exc.code, str(exc)
        if said is not None and self.cfg.index == 0:
            self.dylu.note(record.worker, *said)
        return None

    def _told(self, record: WorkerRecord) -> dict:
        """What shard 0's ack tells an auto worker: the H it runs next."""
        if self.cfg.index or record.worker not in self.dylu.fastest:
            return {}
        live = [w.worker for w in live_workers(self.workers)]
        return {Key.LOCAL_STEPS: self.dylu.steps_for(record.worker, live)}

    # ---- metrics the workers report -------------------------------------------------

    def _note_train(self, worker: str, meta: dict) -> None:
        loss, samples = meta.get(Key.LOSS), meta.get(Key.SAMPLES)
        if isinstance(loss, (int, float)) and isinstance(samples, int) and math.isfinite(loss):
            acc = self.train.setdefault(worker, [0.0, 0, 0])
            acc[0] += float(loss)
            acc[1] += 1
            acc[2] += samples
        traffic = meta.get(Key.TRAFFIC)
        if type(traffic) is list and len(traffic) == 2 and \
                all(type(v) is int and 0 <= v < 2 ** 40 for v in traffic):
            acc = self.traffic.setdefault(worker, [0, 0])
            acc[0] += traffic[0]
            acc[1] += traffic[1]

    # ---- liveness, stats and checkpoints --------------------------------------------

    def _give_back(self, worker: str) -> None:
        """A worker gone (left, silent, forgotten, restarted): its unfinished rows go back."""
        if self.dispatcher is not None:
            self.dispatcher.release(worker)

    def tick(self, now: float) -> list:
        """Drop workers silent for longer than the heartbeat timeout, close a sync round
        whose deadline passed; release what that frees."""
        self.settle()
        self.policy.now = self.now = now
        if self.streams.expire(now, self.cfg.heartbeat_timeout) and self.early is not None \
                and self.streams.open.get(self.early.stream.first.worker) is not self.early.stream:
            self._undo_early()
        self.tables.expire(now)  # --evict ttl: rows aged out
        dropped = False
        for record in live_workers(self.workers):
            if now - record.last_seen > self.cfg.heartbeat_timeout:
                log.warning("shard %d: worker %s silent for %.1f s; dropped from barriers",
                            self.cfg.index, record.worker, now - record.last_seen)
                record.alive = False
                record.held_pull = None
                record.backup = None
                self._give_back(record.worker)
                self.counters["dropped_workers"] += 1
                dropped = True
        if dropped:
            return self._release()
        wake = self.wake_at()
        return self._finish_round() if wake is not None and now >= wake else []

    def wake_at(self) -> Optional[float]:
        """When ``tick`` must next run to close a round by its deadline (on the clock of
        ``now``), or None when no round waits for one."""
        return self.policy.wake_at(self.workers)

    def stats(self, now: float) -> dict:
        """Counters, and the ``STATS_WORKERS`` most recently seen workers by name: the reply
        stays far under the 64 KiB header bound however many workers came and went."""
        self.settle()
        recent = sorted(self.workers.values(), key=lambda w: w.last_seen)[-STATS_WORKERS:]
        totals = list(self.train_forgotten)
        for loss_sum, steps, samples in self.train.values():
            totals = [totals[0] + loss_sum, totals[1] + steps, totals[2] + samples]
        return {
            "shard": self.cfg.index, "version": self.version, "size": self.size,
            "consistency": self.cfg.consistency, **self.counters,
            "lr": self.schedule(max(0, self.version - 1)),  # the latest update's
            "staleness": list(self.staleness),
            "worker_records": len(self.workers),
            "live_workers": sum(w.alive for w in self.workers.values()),
            "dc_copies": sum(w.backup is not None for w in self.workers.values()),
            "workers": {w.worker: {"alive": w.alive, "pushes": w.pushes,
                                   "last_seen_s": round(now - w.last_seen, 3),
                                   "push_format": w.wire[0], "pull_dtype": w.wire[1]}
                        for w in recent},
            "train": {w.worker: list(self.train[w.worker]) for w in recent
                      if w.worker in self.train},
            "train_total": totals,
            "traffic": {w.worker: list(self.traffic[w.worker]) for w in recent
                        if w.worker in self.traffic},
            "traffic_total": [self.traffic_forgotten[i] + sum(t[i] for t in self.traffic.values())
                              for i in range(2)],
            "restored": self.restored,
            **({"balance": self.balancer.report()} if self.balancer is not None else {}),
            "local_steps": {w.worker: self.dylu.assigned[w.worker] for w in recent
                            if w.worker in self.dylu.assigned},
            **({"dispatch": self.dispatch_stats()} if self.dispatcher else {}),
            **(self.tables.stats() if len(self.tables) else {}),
        }

    def dispatch_stats(self) -> dict:
        """--data-dispatch dynamic: how evenly rows were trained, and what was handed again."""
        d = self.dispatcher
        return {"coverage": of_samples(d.counts), "rehanded": d.rehanded,
                "unattributed": d.unattributed, "epoch": d.cursor[0], "finished": d.finished}

    def state_dict(self) -> dict:
        self.settle()
        self._undo_early()  # its parts wrote the rule's state; the push applies whole later
        return {"index": self.cfg.index, "start": self.cfg.start, "end": self.cfg.end,
                "params": self.params.clone(), "version": self.version,
                "rule": self.rule.state_dict(), "counters": dict(self.counters),
                "staleness": torch.tensor(self.staleness),
                # Dedupe windows survive a restart: a push applied before the checkpoint
                # whose ACK died with the process is re-sent, and must not apply twice.
                # Pushes waiting in a round are not in the windows: the round is not saved.
                "dedupe": {w.worker: [w.incarnation, w.pushes, *w.window.state()]
                           for w in self.workers.values()},
                # What forgotten records left behind: their old pushes stay refused.
                "forgotten": self.forgotten.state(),
                # sync: pushes waiting in the open round whose rows are in this checkpoint
                "rows_applied": {w.worker: sorted(w.rows_applied)
                                 for w in self.workers.values() if w.rows_applied},
                **({"sparse": self.tables.state_dict()} if len(self.tables) else {}),
                # --balance batch: shard 0's allocation, which a resumed run continues
                **({"balance": self.balancer.state_dict()} if self.balancer is not None else {}),
                **({"dispatch": self.dispatcher.state_dict()} if self.dispatcher else {})}

    def load_state_dict(self, state: dict, now: Optional[float] = None) -> None:
        """Continue from ``state``. With ``now``, the workers it names stay barrier members
        as if last heard from at ``now``: a restart must not let the first worker back
        complete a sync round alone; one that never comes back is dropped after the
        heartbeat timeout, as any silent worker."""
        if (state.get("start"), state.get("end")) != (self.cfg.start, self.cfg.end):
            raise ConfigError(f"checkpoint of shard range [{state.get('start')}, "
                              f"{state.get('end')}) does not fit "
                              f"[{self.cfg.start}, {self.cfg.end})")
        if ("sparse" in state) != bool(len(self.tables)):
            saved, mine = ("with" if has else "without" for has in ("sparse" in state,
                                                                    len(self.tables)))
            raise ConfigError(f"a checkpoint {saved} row-sparse tables for a shard {mine} "
                              "them: resume with the --embeddings it was saved with")
        if len(self.tables):
            self.tables.load_state_dict(state["sparse"], now)
        self._undo_early()
        self.store.load(state["params"])
        self.version = int(state["version"])
        self.rule.load_state_dict(state["rule"])
        self.counters.update(state.get("counters", {}))
        self.staleness = [int(x) for x in state["staleness"].tolist()]
        for worker, (incarnation, pushes, *window) in state.get("dedupe", {}).items():
            self.workers[worker] = WorkerRecord(
                worker, incarnation, peer=b"", last_seen=now or 0.0, pushes=pushes,
                alive=now is not None,
                window=SeqWindow.from_state(self.cfg.dedupe_window, window))
        for worker, seqs in state.get("rows_applied", {}).items():
            if worker in self.workers:
                self.workers[worker].rows_applied = set(seqs)
        self.forgotten = Forgotten.from_state(self.forgotten.size, state.get("forgotten"))
        self.lost_before = self.counters["lost_updates"]
        if self.balancer is not None:
            self.balancer.load_state_dict(state.get("balance"))
        if self.dispatcher is not None and "dispatch" in state:
            self.dispatcher.load_state_dict(state["dispatch"])
        self.restored = {"version": self.version, "sha256": params_digest(state["params"])}
