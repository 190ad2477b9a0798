"""The modes without a server on the virtual clock: single and Hogwild (interleaved applies)
and ddp (lock-step rounds and a ring all-reduce), ddp+balance's batches sized to speed."""

from __future__ import annotations

import torch

from asyncsgd.servers.rules import make_rule

from ..core.schedule import schedule

from ..config.shared import min_batch
from ..modes.balancing import BatchBalance
from .engine import Engine, SimWorker

BALANCE_EVERY = 20  # rounds between re-sizings: --balance-every's default


class _SharedEngine(Engine):
    """A mode without a server: one copy of the parameters, stepped by plain SGD, and the
    count of its updates."""

    def __init__(self, *args):
        super().__init__(*args)
        self.shared = self.flat.detach().clone()
        self.rule = make_rule("sgd", len(self.shared), self.lr)
        self.schedule = schedule(self.lr, self.setup.lr_schedule, self.setup.warmup)
        self.updates = 0

    def lr_in_force(self) -> float:
        return self.schedule(max(0, self.updates - 1))

    def _step(self, grad: torch.Tensor) -> None:
        """One update of the shared parameters, at the schedule's lr of its count."""
        self.rule.lr = self.schedule(self.updates)
        self.rule.apply(self.shared, [(0, grad)])
        self.updates += 1

    def params(self) -> torch.Tensor:
        return self.shared

    def summary(self) -> dict:
        return {"updates": self.updates}


class AloneEngine(_SharedEngine):
    """single and hogwild: workers step the shared parameters, read at each step's start
    and written at its end (Hogwild's races as interleaved applies); no link, no server."""

    def start(self) -> None:
        for w in self.workers[:self.setup.workers]:
            self.on_begin(0.0, w)

    def on_begin(self, t: float, w: SimWorker) -> None:
        index = w.next_batch()
        if index is None:
            return
        grad, loss, n = self.gradient(self.shared, index)
        self.at(t + self.step_time(w), "apply", w, grad, loss, n)

    def on_apply(self, t: float, w: SimWorker, grad: torch.Tensor, loss: float, n: int) -> None:
        self._step(grad)
        self.trained(n, loss)
        self.on_begin(t, w)


class DDPEngine(_SharedEngine):
    """ddp: lock-step rounds; each ends when the slowest rank computed its gradient and
    the ring all-reduce of the gradients is done, then every rank applies their mean."""

    def start(self) -> None:
        self.on_round(0.0)

    def on_round(self, t: float) -> None:
        ranks = self.workers[:self.setup.workers]
        batches = [w.next_batch() for w in ranks]
        if any(b is None for b in batches):
            return  # a rank's epochs are over: so are everyone's (equal partitions)
        total, losses, samples, slowest = None, 0.0, 0, 0.0
        for w, index in zip(ranks, batches):
            grad, loss, n = self.gradient(self.shared, index)
            total = grad if total is None else total.add_(grad)
            losses, samples = losses + loss * n, samples + n
            slowest = max(slowest, self.step_time(w))
        total.div_(len(ranks))
        allreduce = self.costs.link.ring_allreduce(self.nbytes, len(ranks))
        self.at(t + slowest + allreduce, "applied", total, losses / samples, samples,
                len(ranks))

    def on_applied(self, t: float, mean: torch.Tensor, loss: float, samples: int,
                   ranks: int) -> None:
        if self.trace is not None:
            self.trace.append(("round", t, None))
        self._step(mean)
        n = self.setup.workers
        self.bytes += int(2 * (n - 1) * self.nbytes) if n > 1 else 0
        self.trained(samples, loss, ranks)
        self.on_round(t)




class BalancedDDPEngine(DDPEngine):
    """ddp+balance: each round is one global batch of the epoch's permutation of all rows,
    each rank's share sized to its speed (``modes.balancing``, as a real run slices it),
    measured over the last ``BALANCE_EVERY`` rounds as samples per second of simulated
    compute. A rank's step time scales with its batch: the profile's time for the batch
    size, per sample (a fixed per-step cost is not modelled)."""

    def __init__(self, *args):
        super().__init__(*args)
        batch = self.setup.batch_size or self.task.batch_size
        n = self.setup.workers
        self.balance = BatchBalance(len(self.task.train), n, 0, batch, min_batch(None, batch),
                                    BALANCE_EVERY, self.setup.seed)
        self.data_epoch, self.row, self.order = 0, 0, self.balance.order(0)
        self.global_rows = True
        self.rounds = 0
        self.window = [[0.0, 0] for _ in range(n)]  # each rank's (seconds, samples)

    def epoch(self) -> int:
        return self.data_epoch

    def on_round(self, t: float) -> None:
        if self.row >= len(self.order):
            if self.data_epoch + 1 >= self.setup.epochs:
                return
            self.data_epoch, self.row = self.data_epoch + 1, 0
            self.order = self.balance.order(self.data_epoch)
        ranks = self.workers[:self.setup.workers]
        slices = self.balance.slices(self.order, self.row)
        size = sum(len(index) for index in slices)
        self.row += size
        total, losses, slowest = torch.zeros_like(self.shared), 0.0, 0.0
        for w, index, window in zip(ranks, slices, self.window):
            grad, loss, n = self.gradient(self.shared, index)
            total.add_(grad, alpha=n / size)  # the weighted mean: the global batch's gradient
            losses += loss * n
            seconds = self.step_time(w, n)
            window[0], window[1] = window[0] + seconds, window[1] + n
            slowest = max(slowest, seconds)
        self.rounds += 1
        if self.balance.due(self.rounds):
            self.balance.resize([n / s for s, n in self.window], self.rounds)
            self.window = [[0.0, 0] for _ in ranks]
        allreduce = self.costs.link.ring_allreduce(self.nbytes, len(ranks))
        self.at(t + slowest + allreduce, "applied", total, losses / size, size, len(ranks))

    def summary(self) -> dict:
        return {**super().summary(), "balance": self.balance.to_dict()}
