"""The parameter-server modes on the virtual clock: workers pull, step and push through the
real ``ShardState``; the server's link and its applies queue in arrival order."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from asyncsgd.servers.shard import ShardConfig, ShardState

from ..config import ServerConfig, parse_local_steps
from ..core.balance import global_order, global_slice
from ..core.coverage import of_partitions
from ..core.dispatch import CHUNK, Chunk
from ..errors import WorkerError
from ..run.digests import DIGESTS, DigestLog
from ..wire.protocol import ACK, BYE, ERROR, PARAMS, PULL, PUSH, Code, Key, Message, Segment
from ..wire.stats import percentile
from .engine import Engine, SimWorker, local_steps


class PSEngine(Engine):
    """The parameter-server modes: workers pull, step and push through the real
    ``ShardState``. The server's link is shared: pushes arrive one after another on it,
    and its replies leave one after another; it applies in arrival order."""

    def __init__(self, *args):
        super().__init__(*args)
        server = ServerConfig()
        flags = dict(zip(self.spec.flags[::2], self.spec.flags[1::2]))
        hyper = {"weight_decay": server.weight_decay}
        if self.spec.optimizer in ("momentum", "nesterov", "delayed-nesterov"):
            hyper["momentum"] = float(flags.get("--momentum", server.momentum))
        if self.spec.optimizer == "delayed-nesterov":
            hyper["period"] = self.setup.workers
        # --local-steps H, or auto:H (DyLU): each worker's H as the shard's acks set it
        self.auto, self.H = parse_local_steps(local_steps(self.spec))
        self.steps_of = {w.name: self.H for w in self.workers}
        server_lr = float(flags["--lr"]) if "--lr" in flags else self.lr
        # --balance batch: shard 0 cuts the global batch by speed; a step's time is per sample
        self.batch = self.setup.batch_size or self.task.batch_size
        self.balance = flags.get("--balance", "none")
        self.orders: dict = {}  # epoch -> its permutation of all training rows (balanced)
        dynamic = flags.get("--data-dispatch") == "dynamic"
        self.global_rows = self.balance == "batch" or dynamic
        self.state = ShardState(ShardConfig(
            index=0, start=0, end=len(self.flat), rule=self.spec.optimizer, lr=server_lr,
            hyper=hyper, consistency=self.spec.consistency or "async",
            expected_workers=self.setup.workers, heartbeat_timeout=float("inf"),
            sync_reduce=server.sync_reduce, backup_workers=self.spec.backup_workers,
            dc_lambda=float(flags["--dc-asgd"]) if "--dc-asgd" in flags else None,
            balance=self.balance, batch_size=self.batch,
            balance_every=int(flags.get("--balance-every", server.balance_every)),
            min_batch=int(flags.get("--min-batch", server.min_batch or 0)),
            dispatch=((len(self.task.train), self.setup.epochs, self.setup.seed, CHUNK)
                      if dynamic else None),
            lr_schedule=self.setup.lr_schedule, warmup=self.setup.warmup),
            self.flat.detach().clone())
        # the staleness of every push the shard took, uncapped: the shard's histogram ends
        # at 63, and 256 async workers see about 255
        self.staleness = Counter()
        self.link = self.costs.link
        self.ingress = self.egress = self.server = 0.0  # when each is free again
        self.by_peer = {w.name.encode(): w for w in self.workers}
        self.deadline = None  # the virtual time of the round deadline last set
        self.digests = (DigestLog(self.rec.run.path / DIGESTS, "version")
                        if self.setup.record_digests else None)
        self._note_digest()

    def _note_digest(self) -> None:
        if self.digests is not None and self.digests.last != self.state.version:
            self.digests.note(self.state.version, [self.state.params])

    def params(self) -> torch.Tensor:
        return self.state.params

    def start(self) -> None:
        for w in self.workers[:self.setup.workers]:
            self.send(0.0, w, Message(type=PULL, worker=w.name, incarnation=1, seq=0), 0)
        for t, rank in self.setup.leave:
            self.at(t, "leave", self.workers[rank])
        for k, (t,) in enumerate(self.setup.join):
            w = self.workers[self.setup.workers + k]
            self.at(t, "join", w)

    def send(self, t: float, w: SimWorker, msg: Message, nbytes: int) -> None:
        """``msg`` leaves ``w`` at ``t``; it reaches the server once its bytes have come in
        on the server's link, after those of every push before it."""
        arrive = t + self.link.latency
        if nbytes:
            arrive = max(arrive, self.ingress) + nbytes / self.link.bandwidth
            self.ingress = arrive
            self.bytes += nbytes
        self.at(arrive, "arrive", w, msg, nbytes)

    def on_arrive(self, t: float, w: SimWorker, msg: Message, nbytes: int) -> None:
        done = max(t, self.server) + nbytes * self.costs.apply_per_byte
        self.server = done
        self.at(done, "handle", w, msg)

    def on_handle(self, t: float, w: SimWorker, msg: Message) -> None:
        staleness, taken = self.state.version - msg.clock, self.state.counters["pushes"]
        if self.trace is not None and msg.type == PUSH:
            self.trace.append(("apply", t, w.rank, staleness))
        replies = self.state.handle(w.name.encode(), msg, t)
        self._note_digest()
        if self.state.counters["pushes"] > taken:  # counted: applied, in a round, or late
            self.staleness[staleness] += 1
        for peer, reply in replies:
            if reply.type == ERROR and reply.meta.get("code") == Code.NON_FINITE:
                raise WorkerError(w.rank, (
                    f"diverged at {t:.4g} virtual s: worker {w.rank}'s gradient held NaN or "
                    f"Inf, which the server refuses, as a real one does (lr "
                    f"{self.lr:g} is too large for {self.setup.workers} workers here: try a "
                    "smaller --lr, or --tune lr)"))
            if reply.type == ERROR:  # anything else would be the simulator's own mistake
                raise RuntimeError(f"the shard refused a simulated {msg.type}: {reply.meta}")
            told = (reply.meta if reply.type == ACK else reply.meta.get(Key.ACK)) or {}
            if Key.LOCAL_STEPS in told:  # DyLU: this worker's H from its next push on
                self.steps_of[self.by_peer[peer].name] = told[Key.LOCAL_STEPS]
            if reply.type == PARAMS:
                self.send_params(t, peer, reply)
        self.set_deadline(t)

    def send_params(self, t: float, peer: bytes, reply: Message) -> None:
        """The parameters leave on the server's link after the replies before them."""
        params = torch.cat([s.data.float() for s in sorted(reply.segments,
                                                              key=lambda s: s.offset)])
        start = max(t, self.egress)
        self.egress = start + self.nbytes / self.link.bandwidth
        self.bytes += self.nbytes
        worker = self.by_peer[peer]
        if Key.CHUNKS in reply.meta:  # dynamic dispatch: the rows it trains next
            dispatcher = self.state.dispatcher
            worker.follow([dispatcher.rows(Chunk(*c)) for c in reply.meta[Key.CHUNKS]])
        self.at(self.egress + self.link.latency, "pulled", worker, params,
                reply.meta[Key.VERSION], reply.meta.get(Key.BATCH))

    def set_deadline(self, t: float) -> None:
        """A sync round with a deadline (--backup-workers auto) closes at that virtual time,
        whether or not a push arrives then: the shard ticks then."""
        wake = self.state.wake_at()
        if wake is not None and wake != self.deadline:
            self.deadline = wake
            self.at(max(t, wake), "deadline", wake)

    def on_deadline(self, t: float, wake: float) -> None:
        version = self.state.version
        for peer, reply in self.state.tick(t):
            if reply.type == PARAMS:
                self.send_params(t, peer, reply)
        self._note_digest()
        if self.trace is not None:  # when it fired, when it was set for, whether it closed
            self.trace.append(("deadline", t, wake, self.state.version > version))
        self.set_deadline(t)

    def balanced_batch(self, w: SimWorker, version: int, batch: list):
        """Under --balance batch: ``w``'s rows of the global batch of round ``version`` (as
        the real worker slices them), or None after the last epoch."""
        size, offset, total = batch
        rows = len(self.task.train)
        epoch, start, end = global_slice(version, rows, total, offset, size)
        if epoch >= self.setup.epochs:
            return None
        if epoch not in self.orders:
            self.orders = {epoch: global_order(rows, epoch)}
        w.epoch = epoch
        return self.orders[epoch][start:end]

    def on_pulled(self, t: float, w: SimWorker, params: torch.Tensor, version: int,
                  batch: Optional[list] = None) -> None:
        """New parameters reached ``w``: it computes its next push from them, for real."""
        if w.gone:
            return
        if self.trace is not None:
            self.trace.append(("pulled", t, w.rank))
        steps = 1
        if batch is not None:
            index = self.balanced_batch(w, version, batch)
            samples = 0
            if index is not None and len(index):
                grad, loss, samples = self.gradient(params, index)
                # the profile's step time is of --batch-size samples: this step's scales
                seconds = self.step_time(w) * samples / self.batch
        elif self.auto or self.H > 1:
            # --local-steps H: H inner SGD steps on its own copy, then the pseudo-gradient
            local, seconds, samples, losses, steps = params.clone(), 0.0, 0, 0.0, 0
            for _ in range(self.steps_of[w.name]):
                index = w.next_batch()
                if index is None:
                    break
                grad, loss, n = self.gradient(local, index)
                local.add_(grad, alpha=-self.lr)
                seconds, samples = seconds + self.step_time(w), samples + n
                losses, steps = losses + loss, steps + 1
            grad, loss = params.sub_(local), losses / max(1, steps)
        else:
            index = w.next_batch()
            samples = 0
            if index is not None:
                grad, loss, samples = self.gradient(params, index)
                seconds = self.step_time(w)
        del params
        if not samples:
            self.leave(t, w)
            return
        self.at(t + seconds, "push", w, grad, version, loss, samples, seconds, steps)

    def on_push(self, t: float, w: SimWorker, grad: torch.Tensor, version: int, loss: float,
                samples: int, seconds: float, steps: int) -> None:
        if w.gone:
            return  # it left while computing: its step is lost
        w.seq += 1
        meta = {Key.PULL: True, Key.SAMPLES: samples, Key.LOSS: loss, Key.COMPUTE: seconds}
        if self.auto:  # as a real auto worker's push (PROTOCOL.md, DyLU)
            meta.update({Key.LOCAL_STEPS: max(1, steps), Key.AUTO_STEPS: self.H})
        self.send(t, w, Message(type=PUSH, worker=w.name, incarnation=1, seq=w.seq, shard=0,
                                clock=version, meta=meta, segments=[Segment(0, grad)]),
                  self.nbytes)

    def leave(self, t: float, w: SimWorker) -> None:
        if not w.gone:
            w.gone = True
            w.seq += 1
            self.send(t, w, Message(type=BYE, worker=w.name, incarnation=1, seq=w.seq), 0)

    def on_leave(self, t: float, w: SimWorker) -> None:
        self.leave(t, w)

    def on_join(self, t: float, w: SimWorker) -> None:
        self.send(t, w, Message(type=PULL, worker=w.name, incarnation=1, seq=0), 0)

    def evaluate(self, t: float) -> None:
        self.count()
        super().evaluate(t)

    def lr_in_force(self) -> float:
        return self.state.schedule(max(0, self.state.version - 1))

    def end(self) -> str:
        self.count()  # the final evaluation reports the samples trained until the end
        if self.digests is not None:
            self.digests.close()
        return super().end()

    def count(self) -> None:
        """Samples and loss as the shard counted them from the pushes it took (each push
        reports its mean loss), as a real server's evaluator reads them."""
        self.loss_sum, self.loss_steps, self.samples = (
            sum(v[i] for v in self.state.train.values()) + self.state.train_forgotten[i]
            for i in range(3))

    def summary(self) -> dict:
        uncapped = [self.staleness[k] for k in range(max(self.staleness, default=-1) + 1)]
        pushes = sum(uncapped)
        return {"updates": self.state.counters["updates"],
                "staleness_hist": list(self.state.staleness),
                "staleness_p50": percentile(uncapped, 0.5),
                "staleness_p99": percentile(uncapped, 0.99),
                "staleness_mean": (sum(k * n for k, n in enumerate(uncapped)) / pushes
                                   if pushes else None),
                "stale_pushes": self.state.counters["stale"],
                **({"balance": self.state.balancer.report()}
                   if self.state.balancer is not None else {}),
                **({"local_steps": dict(self.state.dylu.assigned)} if self.auto else {}),
                "consistency": str(self.state.cfg.consistency),
                # rows on demand: the dispatcher's counts; balanced: the engine's (one order)
                **(self.state.dispatch_stats() if self.state.dispatcher else
                   {} if self.global_rows else self.partition_coverage())}

    def partition_coverage(self) -> dict:
        """Static partitions: each worker's samples over its partition's rows (every worker
        the shard heard from; none before any did)."""
        heard = [w for w in self.workers if w.name in self.state.workers]
        if not heard:
            return {}
        return {"coverage": of_partitions(
            [self.state.train.get(w.name, (0, 0, 0))[2] for w in heard],
            [len(w.part) for w in heard])}


