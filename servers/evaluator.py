"""The server's evaluator: every ``--eval-every`` seconds it pulls each shard's parameters as
an observer (never held, never counted as a worker) and reads its counters, for the
recorder, ``stats`` and knowing when every worker has gone.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import zmq

from asyncsgd.core.sparse_ids import hash_id
from asyncsgd.run.recorder import Recorder
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import (PARAMS, PULL, STATS, Key, Message, ParamsIntake,
                                    ProtocolError, Rows)
from asyncsgd.wire.security import ClientKeys
from asyncsgd.wire.stats import percentile
from asyncsgd.wire.transport import dealer, recv, send

from .evaluator_tables import TableRows, touched_ids
from .shard_process import max_frame

log = logging.getLogger(__name__)


def merged_staleness(shard_stats: list) -> list:
    """The shards' staleness histograms added bucket by bucket."""
    return [sum(bucket) for bucket in zip(*[s["staleness"] for s in shard_stats])]


class ShardReader:
    """Observer pulls and stats requests to every shard; parameters assembled into one
    flat vector."""

    def __init__(self, ctx: zmq.Context, host: str, shards: list, total: int,
                 curve: Optional[ClientKeys] = None, tables: bool = False):
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "*") else host
        self.socks = [dealer(ctx, f"tcp://{connect_host}:{s[Key.PORT]}", curve=curve,
                             max_frame=max_frame(s[Key.END] - s[Key.START], tables))
                      for s in shards]
        self.shards = shards
        self.flat = torch.zeros(total)
        self.intake = ParamsIntake()
        self.seq = 0

    def pull(self, timeout: float = 10.0, rows: Optional[TableRows] = None) -> dict:
        """Fill ``flat`` from every shard, and with ``rows`` the model's tables at the ids
        it asks; returns {shard: version}."""
        if rows is not None:  # a pull per message of ids, one shard after another
            return {i: self._pull_rows(i, asked, rows, timeout)
                    for i in range(len(self.shards)) for asked in rows.pulls[i]}
        self.seq += 1
        for sock in self.socks:
            send(sock, Message(type=PULL, seq=self.seq, meta={Key.OBSERVER: True}))
        return {i: self._params(i, timeout)[0] for i in range(len(self.shards))}

    def _params(self, i: int, timeout: float) -> tuple:
        """Shard ``i``'s reply to the current pull, its dense slice copied into ``flat``:
        (its version, its rows segments)."""
        shard, got = self.shards[i], []
        while True:  # a large reply comes as several parts
            msg = self._reply(i, PARAMS, timeout)
            got += [s for s in msg.segments if type(s.data) is Rows]
            msg.segments = [s for s in msg.segments if type(s.data) is not Rows]
            if self.intake.take((i, self.seq), msg, self.flat, shard[Key.START],
                                shard[Key.END] - shard[Key.START]):
                return msg.meta.get(Key.VERSION, 0), got

    def _pull_rows(self, i: int, asked: list, rows: TableRows, timeout: float) -> int:
        self.seq += 1
        send(self.socks[i], Message(type=PULL, seq=self.seq, meta={Key.OBSERVER: True},
                                    segments=asked))
        version, got = self._params(i, timeout)
        problem = rows.take(asked, got)
        if problem:
            log.warning("shard %d's rows for the evaluator were not those asked (%s); the "
                        "model keeps its former rows there", i, problem)
        return version

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
                self.intake.forget()
                raise TimeoutError(f"shard {shard} did not answer {kind} within {timeout} s")
            try:
                msg = recv(sock)
            except ProtocolError as exc:  # whatever a shard sends, the server goes on
                log.warning("shard %d sent a %s reply that cannot be read: %s", shard, kind, exc)
                continue
            if msg.type == kind and msg.seq == self.seq:
                return msg

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)


class _Running:
    """A total kept by a shard that starts again from zero when the shard is restarted
    (its checkpoint does not hold it): what it counted before stays counted."""

    def __init__(self):
        self.before, self.last = 0, 0

    def __call__(self, total: int) -> int:
        if total < self.last:  # the shard restarted
            self.before += self.last
        self.last = total
        return self.before + total


class _TrainFeed:
    """Per-worker train events from the cumulative counters shard 0 keeps."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self.seen: dict = {}
        self.samples = recorder.samples_offset
        self._samples, self._bytes = _Running(), _Running()
        self._shared: dict = {}  # shard -> its _Running bytes through same-host areas

    def shared(self, shards: list) -> None:
        """The bytes every shard moved through same-host areas (each shard's own count,
        kept across its restarts): what the wire's count leaves out."""
        moved = sum(self._shared.setdefault(i, _Running())(s.get("area_bytes", 0))
                    for i, s in enumerate(shards))
        self.recorder.shared_bytes = self.recorder.shared_offset + moved

    def update(self, shard0: dict) -> None:
        train = shard0.get("train", {})  # the most recently seen workers only
        self.samples = self.recorder.samples_offset + self._samples(shard0["train_total"][2])
        # every worker's traffic with the server, as each reported it with its pushes
        sent, received = shard0.get("traffic_total", (0, 0))
        self.recorder.wire_bytes = self.recorder.bytes_offset + self._bytes(sent + received)
        # Bounded like the reply: a worker no longer listed is no longer followed.
        self.seen = {w: v for w, v in self.seen.items() if w in train}
        for worker, (loss_sum, steps, samples) in sorted(train.items()):
            prev = self.seen.get(worker, (0.0, 0, 0))
            if steps > prev[1]:
                self.recorder.train(self.samples, worker, (loss_sum - prev[0]) / (steps - prev[1]),
                                    steps - prev[1], -1)
            self.seen[worker] = (loss_sum, steps, samples)


class Evaluator:
    """Reads the shards into ``model`` and records evaluations, rates and staleness."""

    def __init__(self, model: torch.nn.Module, layout: Layout, recorder: Recorder,
                 test_split=None, id_space: str = "fixed"):
        """``test_split``: with tables served by row, the split whose ids are pulled at each
        evaluation (every row at the last); ``id_space``: theirs."""
        self.model, self.layout, self.recorder = model, layout, recorder
        self.test_split, self.id_space = test_split, id_space
        self.rows: Optional[TableRows] = None  # the test split's rows, once connected
        self.shard_count = 0
        self.reader: Optional[ShardReader] = None
        self.feed = _TrainFeed(recorder)
        self.latest: list = []  # every shard's counters at the last observation
        # What the last pull of every row of the tables took (the final one takes as long)
        self._every_row_seconds = 0.0
        self._updates_mark = (0, recorder.elapsed())
        self._samples_mark = (self.feed.samples, recorder.elapsed())
        self.rate = 0.0  # samples/s between the last two evaluations

    def connect(self, ctx: zmq.Context, host: str, shards: list,
                curve: Optional[ClientKeys] = None) -> None:
        """Connect to the shards (``shards`` as a welcome lists them) once they listen."""
        self.reader = ShardReader(ctx, host, shards, self.layout.total, curve,
                                  tables=bool(self.layout.tables))
        self.shard_count = len(shards)
        if self.layout.tables:
            self.rows = self._rows(touched_ids(self.model, self.layout, self.test_split))

    def _rows(self, ids: list) -> TableRows:
        return TableRows(self.model, self.layout, ids, self.shard_count,
                         hash_id if self.id_space == "hashed" else None)

    @property
    def samples(self) -> int:
        """Training samples the workers reported, across resumes."""
        return self.feed.samples

    def observe(self, every_row: bool = False) -> dict:
        """Pull the parameters into the model and every shard's counters; what they say.
        Tables served by row: the rows the test split reads, or ``every_row``."""
        rows, began = self.rows, time.monotonic()
        if rows is not None and every_row:
            if rows.remapped:  # the test split's raw ids, apart: for the final evaluation
                self.reader.pull(rows=rows)
            rows = self._rows([torch.arange(t.rows, dtype=torch.int64)
                               for t in self.layout.tables])
        self.reader.pull(rows=rows)
        if rows is not None and every_row:
            self._every_row_seconds = time.monotonic() - began
        dense = self.layout.state_dict(self.reader.flat)
        # the tables were written in place, row by row: the rest is the dense slice
        self.model.load_state_dict(dense, strict=not self.layout.tables)
        self.latest = self.reader.stats()
        self.recorder.stop_seconds = self.stop_seconds()
        self.feed.update(self.latest[0])
        self.feed.shared(self.latest)
        self.recorder.lr = self.latest[0].get("lr")  # shard 0's latest update's
        return self.last_observation()

    def every_row_count(self) -> int:
        """The rows the final observation pulls: every row of the tables (and the test
        split's again, where they are held apart)."""
        if self.rows is None:
            return 0
        return sum(t.rows for t in self.layout.tables) + (self.rows.count if self.rows.remapped
                                                           else 0)

    def every_row_seconds(self) -> float:
        """What the final pull of every row will take: as long as the last one (the first
        observation's, under --max-seconds); 0 before any."""
        return self._every_row_seconds

    def stop_seconds(self) -> float:
        """What the stop costs besides the final evaluation and checkpoint, as last
        measured: the final pull of every row, and the shards' saves as they stop (each
        one's last; they save at once, so the slowest's)."""
        saves = max((s.get("save_seconds", 0.0) for s in self.latest), default=0.0)
        return self.every_row_seconds() + saves

    def last_observation(self) -> dict:
        """What the shards' counters said at the last observation."""
        hist = merged_staleness(self.latest)
        return {"updates": sum(s.get("updates", 0) for s in self.latest),
                "staleness_p50": percentile(hist, 0.5), "staleness_p99": percentile(hist, 0.99),
                "staleness_hist": hist}

    def evaluate_start(self) -> None:
        """The starting point, before any update of this run. Under --max-seconds, every row
        of the tables is pulled: the final pull, for checkpoint.pt, will take about as long,
        and that time is set aside before the limit. Reckoned instead from the test split's
        rows, per row, it came out 0.5 s against the final pull's 1.52 s (2.6 million rows,
        30,869 of them the test split's): a large pull costs more per row than a small one.
        Not when the start-up already took the whole limit (beside 4 busy processes it once
        did): the run stops next, and pulls every row then."""
        timed = self.recorder.cfg.max_seconds and not self.recorder.out_of_time()
        obs = self.observe(every_row=bool(self.rows is not None and timed))
        self.recorder.evaluate(self.samples, updates=obs["updates"])

    def evaluate(self) -> None:
        """Observe, evaluate and record, with updates/s and samples/s since the last time."""
        obs = self.observe()
        now = self.recorder.elapsed()
        updates0, t_updates0 = self._updates_mark
        rate = (obs["updates"] - updates0) / max(1e-9, now - t_updates0)
        self._updates_mark = (obs["updates"], now)
        # --balance batch: shard 0's current cut of the global batch, worker by worker
        batches = (self.latest[0].get("balance") or {}).get("batches") if self.latest else None
        # --local-steps auto: each worker's H as shard 0 last set it
        dylu = {"local_steps": self.latest[0]["local_steps"]} \
            if self.latest and self.latest[0].get("local_steps") else {}
        self.recorder.evaluate(self.samples, updates=obs["updates"],
                               updates_per_second=round(rate, 1),
                               staleness_p50=obs["staleness_p50"],
                               staleness_p99=obs["staleness_p99"],
                               **({"batches": batches} if batches else {}), **dylu)
        samples0, t0 = self._samples_mark
        self.rate = (self.samples - samples0) / max(1e-9, now - t0)
        self.recorder.show(self.samples, self.rate,
                           note="batches " + "/".join(str(b) for b in batches.values())
                           if batches else "")
        self._samples_mark = (self.samples, now)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
