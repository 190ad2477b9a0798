"""Dynamic dispatch: chunks of each epoch's permutation handed to workers as they ask.

Every row is trained once per epoch whatever the workers' speeds. A chunk a worker
leaves unfinished (it died, left, or came back as a new incarnation) goes back to the
front of the queue, counted in ``rehanded``. Epoch ``e + 1``'s chunks are handed while
the last of ``e``'s are still being trained (fast workers never idle at an epoch's end),
but never before every chunk of ``e`` has been handed, re-handed ones included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

# Rows a chunk holds by default: a few batches, so that a straggler holds little at an
# epoch's end (the others wait on no one) and a chunk costs one list in a reply
CHUNK = 128
AHEAD = 2  # chunks a worker holds: the one it trains and the next (it never waits for data)


def epoch_rows(n: int, seed: int, epoch: int) -> torch.Tensor:
    """Epoch ``epoch``'s permutation of ``n`` rows: what a chunk's start and stop index."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, stop)`` of epoch ``epoch``'s permutation."""

    epoch: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


class Dispatcher:
    """Hands out chunks of ``chunk`` rows of each epoch's seeded permutation of ``n`` rows,
    and counts the rows trained. No sockets: the shard and the virtual clock both use it."""

    def __init__(self, n: int, epochs: int, seed: int, chunk: int):
        if n < 1 or epochs < 1 or chunk < 1:
            raise ValueError(f"a dispatcher of {n} rows, {epochs} epochs, chunks of {chunk}")
        self.n, self.epochs, self.seed, self.chunk = n, epochs, seed, chunk
        self.cursor = (0, 0)  # the next fresh chunk's epoch and start
        self.queue: deque = deque()  # chunks given back, handed before any fresh one
        self.held: dict = {}  # worker -> [[chunk, rows of it trained], ...] in order
        self.counts = torch.zeros(n, dtype=torch.int32)  # times each row was trained
        self.rehanded = 0  # rows given back unfinished and handed again
        # rows a worker reported trained beyond the chunks it holds: after a restore from a
        # checkpoint, what it trained since is re-handed, so those rows may be trained twice
        self.unattributed = 0
        self._perm: tuple = (-1, None)

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s permutation of the rows (the same for every process)."""
        if self._perm[0] != epoch:
            self._perm = (epoch, epoch_rows(self.n, self.seed, epoch))
        return self._perm[1]

    def rows(self, chunk: Chunk) -> torch.Tensor:
        return self.order(chunk.epoch)[chunk.start:chunk.stop]

    @property
    def exhausted(self) -> bool:
        """Nothing left to hand (chunks may still be out)."""
        return not self.queue and self.cursor[0] >= self.epochs

    @property
    def finished(self) -> bool:
        """Every chunk handed and trained."""
        return self.exhausted and not any(self.held.values())

    def hand(self, worker: str) -> Optional[Chunk]:
        """The next chunk for ``worker`` (given-back ones first), or None when none is left."""
        if self.queue:
            chunk = self.queue.popleft()
        elif self.cursor[0] < self.epochs:
            epoch, start = self.cursor
            chunk = Chunk(epoch, start, min(self.n, start + self.chunk))
            self.cursor = (epoch + 1, 0) if chunk.stop >= self.n else (epoch, chunk.stop)
        else:
            return None
        self.held.setdefault(worker, []).append([chunk, 0])
        return chunk

    def top_up(self, worker: str) -> list:
        """Hand ``worker`` chunks until it holds ``AHEAD``; what it holds left to train."""
        while len(self.held.get(worker, ())) < AHEAD and self.hand(worker) is not None:
            pass
        return self.plan(worker)

    def plan(self, worker: str) -> list:
        """The rest of ``worker``'s chunks, in the order it trains them."""
        return [Chunk(c.epoch, c.start + done, c.stop) for c, done in self.held.get(worker, ())]

    def done(self, worker: str, samples: int) -> None:
        """``worker`` trained ``samples`` more rows of its chunks, in order."""
        chunks = self.held.get(worker, [])
        while samples > 0 and chunks:
            entry = chunks[0]
            chunk, trained = entry
            take = min(samples, len(chunk) - trained)
            rows = self.rows(chunk)[trained:trained + take]
            self.counts[rows] += 1
            entry[1] += take
            samples -= take
            if entry[1] >= len(chunk):
                chunks.pop(0)
        self.unattributed += max(0, samples)

    def release(self, worker: str) -> int:
        """``worker`` is gone: the unfinished rest of its chunks goes back to the front of the
        queue, in order; the rows given back."""
        rest = self.plan(worker)
        self.held.pop(worker, None)
        self._give_back(rest)
        return sum(len(c) for c in rest)

    def _give_back(self, rest: list) -> None:
        for chunk in reversed(rest):
            if len(chunk):
                self.queue.appendleft(chunk)
                self.rehanded += len(chunk)

    def state_dict(self) -> dict:
        return {"n": self.n, "epochs": self.epochs, "seed": self.seed, "chunk": self.chunk,
                "cursor": list(self.cursor),
                "queue": [[c.epoch, c.start, c.stop] for c in self.queue],
                "held": {w: [[c.epoch, c.start + d, c.stop] for c, d in chunks]
                         for w, chunks in self.held.items()},
                "counts": self.counts.clone(), "rehanded": self.rehanded,
                "unattributed": self.unattributed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``. The chunks out at the checkpoint go back to the front of the
        queue (counted in ``rehanded``): what their workers trained after the checkpoint was
        lost with the parameters, so it is trained again."""
        if (state["n"], state["seed"], state["chunk"]) != (self.n, self.seed, self.chunk):
            raise ValueError(f"a dispatcher checkpoint of {state['n']} rows, seed "
                             f"{state['seed']}, chunks of {state['chunk']} does not fit "
                             f"{self.n} rows, seed {self.seed}, chunks of {self.chunk}")
        self.cursor = tuple(state["cursor"])
        self.queue = deque(Chunk(*c) for c in state["queue"])
        self.held = {}
        self.counts = state["counts"].clone().to(torch.int32)
        self.rehanded, self.unattributed = int(state["rehanded"]), int(state["unattributed"])
        for chunks in reversed(list(state["held"].values())):  # the first worker's first
            self._give_back([Chunk(*c) for c in chunks])
