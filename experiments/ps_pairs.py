"""Many trainers against one, in interleaved pairs, on one ps-server: does the rate fall?

    python experiments/ps_pairs.py               # 40 MiB, 1 vs 4 trainers, 12 pairs: ~1.6 min
    python experiments/ps_pairs.py --size 10MB --pairs 6 --transport auto
    python experiments/ps_pairs.py --against /tmp/base/.venv/bin/python --size 40MiB --pairs 10
    python experiments/ps_pairs.py --against .venv/bin/python --args="--early-parts on" \
        --against-args="--early-parts off"

With ``--against PYTHON`` it compares two servers instead: this code's ps-server against one
run by PYTHON (the venv of a worktree of another commit), ``--few`` trainers each, in pairs
of runs alternating which goes first (``--args`` and ``--against-args``: more ps-server
arguments of each), the same trainers' code against both; it reports the
median ms per round trip of each and the median of the pairs' ratios, with the 1-minute
load, and each shard's ``early_pushes`` (pushes in parts applied as they arrived) and
``early_undone``.

Where one trainer already keeps the cores busy, the 4-trainer / 1-trainer ratio of two
``ps_throughput.py`` medians taken minutes apart falls either side of 1 with the machine's
drift; this measures only that ratio, in pairs of runs as close together as it can (few,
many; then many, few; ...) against one ``asyncsgd ps-server`` (1 shard), with the share of
the CPU busy during each run (``/proc/stat``). Results: experiments/README.md,
"Parameter-server round trips".
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics

import zmq

from asyncsgd.wire.protocol import STATS, Message, decode, encode
from ps_throughput import PRELOAD, SIZES, PSServer, measure_asyncsgd
from rpc_ps import start_context


def _cpu() -> tuple:
    """(all jiffies, idle + iowait jiffies) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--size", default="40MiB", choices=list(SIZES))
    ap.add_argument("--few", type=int, default=1, help="trainers in the first run of a pair")
    ap.add_argument("--many", type=int, default=4, help="trainers in the other")
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per run")
    ap.add_argument("--transport", default="tcp", choices=["tcp", "auto"])
    ap.add_argument("--against", metavar="PYTHON",
                    help="compare this code's ps-server with one run by PYTHON (--few trainers)")
    ap.add_argument("--args", default="", help="--against: more arguments of this code's server")
    ap.add_argument("--against-args", default="",
                    help="--against: more arguments of PYTHON's server")
    args = ap.parse_args()
    if min(args.few, args.many, args.pairs) < 1 or args.seconds <= 0 or \
            (args.few == args.many and not args.against):
        ap.error("--few, --many and --pairs >= 1, --few != --many, --seconds > 0")
    ctx = start_context("forkserver", PRELOAD)
    if args.against:
        return _against(args, ctx)
    rates: dict = {args.few: [], args.many: []}
    busy: dict = {args.few: [], args.many: []}
    with PSServer(SIZES[args.size], 1, max(4, args.many)) as server:
        for k in range(args.pairs):
            for trainers in (args.few, args.many)[::1 if k % 2 == 0 else -1]:
                before = _cpu()
                r = measure_asyncsgd(server, trainers, args.seconds, args.transport, ctx)
                after = _cpu()
                rates[trainers].append(r["round_trips_per_s"])
                busy[trainers].append(1 - (after[1] - before[1]) / (after[0] - before[0]))
            print(f"pair {k + 1}/{args.pairs}: {rates[args.few][-1]:.1f} and "
                  f"{rates[args.many][-1]:.1f} round trips/s", flush=True)
    ratios = [m / f for m, f in zip(rates[args.many], rates[args.few])]
    print(f"{args.size}, {args.transport}, {args.pairs} pairs of {args.seconds:g} s: "
          f"{args.many} trainers / {args.few}: median {statistics.median(ratios):.2f}x, "
          f"{sum(x >= 1 for x in ratios)} of {len(ratios)} pairs at or above 1 "
          f"({min(ratios):.2f}-{max(ratios):.2f}x); median rates "
          f"{statistics.median(rates[args.few]):.1f} and "
          f"{statistics.median(rates[args.many]):.1f}/s; CPU busy "
          f"{statistics.median(busy[args.few]):.0%} and {statistics.median(busy[args.many]):.0%}")
    return 0


def _early_pushes(server: PSServer) -> str:
    """Shard 0's counts of pushes in parts applied as they arrived, and of those undone
    (applied whole later, or never); "none" where it counts none."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        sock.send_multipart(encode(Message(type=STATS, seq=1)))
        port = decode(sock.recv_multipart()).meta["shard_ports"][0]
        sock.disconnect(server.address)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(encode(Message(type=STATS, seq=2)))
        meta = decode(sock.recv_multipart()).meta
        if "early_pushes" not in meta:
            return "none"
        return f"{meta['early_pushes']} ({meta['early_undone']} undone)"


def _against(args, ctx) -> int:
    """This code's server (``new``) against PYTHON's (``old``), in alternating pairs."""
    ms: dict = {"new": [], "old": []}
    loads = [os.getloadavg()[0]]
    nbytes, workers = SIZES[args.size], max(4, args.few)
    with PSServer(nbytes, 1, workers, extra=tuple(shlex.split(args.args))) as new, \
            PSServer(nbytes, 1, workers, args.against,
                     tuple(shlex.split(args.against_args))) as old:
        servers = {"new": new, "old": old}
        for k in range(args.pairs):
            for name in ("new", "old")[::1 if k % 2 == 0 else -1]:
                r = measure_asyncsgd(servers[name], args.few, args.seconds, args.transport, ctx)
                ms[name].append(r["ms_per_round_trip"])
            loads.append(os.getloadavg()[0])
            print(f"pair {k + 1}/{args.pairs}: new {ms['new'][-1]:.3f} ms, old "
                  f"{ms['old'][-1]:.3f} ms (load {loads[-1]:.2f})", flush=True)
        early = {name: _early_pushes(server) for name, server in servers.items()}
    ratios = [o / n for n, o in zip(ms["new"], ms["old"])]
    print(f"new: this code {args.args}; old: {args.against} {args.against_args}")
    print(f"{args.size}, {args.transport}, {args.few} trainer(s), {args.pairs} pairs of "
          f"{args.seconds:g} s: new {statistics.median(ms['new']):.3f} ms, old "
          f"{statistics.median(ms['old']):.3f} ms per round trip; old / new median "
          f"{statistics.median(ratios):.3f}x, new faster in {sum(x > 1 for x in ratios)} of "
          f"{len(ratios)}; load {min(loads):.2f}-{max(loads):.2f}; early pushes: new "
          f"{early['new']}, old {early['old']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
