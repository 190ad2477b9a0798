"""A push in parts applied as it arrives: a scratch buffer against a staged copy, timed.

The shard applies each part of a push as it arrives (servers/early.py) and must be able to
undo it. Two ways keep the parameters unharmed until the last part: apply each part into a
scratch buffer swapped in at the end (what the shard does), or stage a copy of the part's
range of the parameters and apply in place. Both stage the rule's state. This times, per
push of ``--mib`` MiB in 4 MiB parts, one shard thread as ps-server gives it:
- ``whole``: today's path before issue 42, the whole update once the last part has come;
- ``scratch`` and ``staged``: the CPU of every part, and what is left after the last one
  arrives (its part and the commit), which is what stays on a round trip's critical path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from asyncsgd.servers.early import EarlyPush
from asyncsgd.servers.rules import make_rule
from asyncsgd.servers.store import ParamStore
from asyncsgd.wire.memory import keep_freed_memory
from asyncsgd.wire.protocol import split


def _staged(store: ParamStore, parts: list) -> tuple:
    """The alternative: a copy of each part's range of parameters and rule state, then the
    part applied in place; (seconds of all parts, seconds of the last)."""
    rule = store.rule
    lr = rule.begin(1.0)
    saved = []
    began = time.perf_counter()
    for offset, grad in parts:
        last = time.perf_counter()
        end = offset + grad.shape[0]
        saved.append((offset, store.buffer[offset:end].clone(),
                      [t[offset:end].clone() for t in rule.state.values()]))
        rule.apply_one(store.buffer, offset, grad, lr)
    done = time.perf_counter()
    return done - began, done - last


def _scratch(store: ParamStore, parts: list) -> tuple:
    early = EarlyPush(store, None, store.rule.lr, 1.0)
    began = time.perf_counter()
    for offset, grad in parts:
        last = time.perf_counter()
        early.take(offset, grad)
    early.commit()
    done = time.perf_counter()
    return done - began, done - last


def _whole(store: ParamStore, parts: list) -> tuple:
    began = time.perf_counter()
    store.update(parts)
    done = time.perf_counter()
    return done - began, done - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=40.0, help="push size (MiB)")
    parser.add_argument("--rules", default="sgd,momentum,adam")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the shard")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()  # as a shard process does: staged copies reuse freed pages
    n = int(args.mib * 2 ** 20 / 4)
    grad = torch.randn(n)
    parts = [(s.offset, s.data) for s in split(grad)]
    print(f"{args.mib:g} MiB push in {len(parts)} parts, {args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.2f}; median of {args.repeats}, interleaved (ms)")
    print("rule | whole (all after the last part) | scratch: all / after the last part | "
          "staged: all / after the last part")
    for name in args.rules.split(","):
        stores = {way: ParamStore(torch.randn(n), make_rule(name, n, 0.01))
                  for way in ("whole", "scratch", "staged")}
        times: dict = {way: [] for way in stores}
        for _ in range(args.repeats):
            for way, run in (("whole", _whole), ("scratch", _scratch), ("staged", _staged)):
                times[way].append(run(stores[way], parts))
        med = {way: [1000 * statistics.median(t[i] for t in ts) for i in (0, 1)]
               for way, ts in times.items()}
        print(f"{name} | {med['whole'][0]:.2f} | {med['scratch'][0]:.2f} / "
              f"{med['scratch'][1]:.2f} | {med['staged'][0]:.2f} / {med['staged'][1]:.2f}")
        print(f"    load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
