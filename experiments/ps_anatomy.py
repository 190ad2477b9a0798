r"""Where a parameter-server round trip goes: per thread, per round trip, on both sides.

    python experiments/ps_anatomy.py                       # 20KB and 1MB, idle: ~1 min
    python experiments/ps_anatomy.py --busy 2              # beside 2 spinning processes
    python experiments/ps_anatomy.py --sizes 10MB --round-trips 300

For asyncsgd over TCP, asyncsgd over its same-host path, and the floor
(``ps_floor.py``: raw pyzmq plus only the work no server can skip), one
client in this process does ``--round-trips`` push+pull round trips against a
server (a real ``asyncsgd ps-server`` with one shard, or the floor's server),
and the kernel's per-thread counters are read before and after
(``/proc/<pid>/task/<tid>/status``, ``stat``, ``schedstat``). Per round trip
and per thread it gives voluntary context switches (the thread slept: a
wake-up each), involuntary ones (it was preempted), user and system CPU, and
the time it sat runnable on a run queue waiting for a core (schedstat's
second field) — on a busy machine, the cost of every wake-up. The threads are
the Python threads and libzmq's I/O threads (``ZMQbg/IO/0``) of the client,
the server's front and its shard process.

Why: issue 14 asks where the busy-machine round trip goes, "measure, don't
guess". Idle, at 20 KB, asyncsgd and the floor wake the same threads (the
client's and server's main threads once, their I/O threads about twice per
round trip); the difference is CPU in the two main threads (Python).
Writes ``results/ps_anatomy.md`` (``ps_anatomy_busyN.md`` with --busy) and
``.json`` unless --no-save.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ps_floor import FloorClient, _serve  # noqa: E402
from ps_throughput import SIZES, PSServer, _signature  # noqa: E402
from raw_zmq import time_against_server  # noqa: E402
from results import save_results  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")
WARMUP = 50


def _threads(pid: int) -> dict:
    """{(pid, tid, name): (voluntary, involuntary, user ticks, system ticks, run-queue ns)}."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            status = Path(f"{base}/status").read_text()
            name = Path(f"{base}/comm").read_text().strip()
            stat = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
            waited = int(Path(f"{base}/schedstat").read_text().split()[1])
        except OSError:
            continue  # the thread ended meanwhile
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        out[(pid, int(tid), name)] = (int(fields["voluntary_ctxt_switches"]),
                                      int(fields["nonvoluntary_ctxt_switches"]),
                                      int(stat[11]), int(stat[12]), waited)
    return out


def _descendants(pid: int) -> list:
    """Every process below ``pid`` (shards may be children of a fork server), but the
    resource tracker and this benchmark's spinners."""
    found, todo = [], [pid]
    while todo:
        kids = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True)
        for child in (int(p) for p in kids.stdout.split()):
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "resource_tracker" not in cmdline and "while True" not in cmdline:
                found.append(child)
                todo.append(child)
    return found


def _measure(roles: dict, round_trip, count: int) -> dict:
    """Per-thread counters per round trip over ``count`` calls of ``round_trip``."""
    for _ in range(WARMUP):
        round_trip()
    before = {role: _threads(pid) for role, pid in roles.items()}
    t0 = time.perf_counter()
    for _ in range(count):
        round_trip()
    elapsed = time.perf_counter() - t0
    after = {role: _threads(pid) for role, pid in roles.items()}
    rows = []
    for role, threads in after.items():
        for key, now in threads.items():
            was = before[role].get(key, (0, 0, 0, 0, 0))
            d = [a - b for a, b in zip(now, was)]
            if d[0] + d[1] < 0.05 * count and sum(d[2:4]) / HZ < 1e-6 * count \
                    and d[4] < 1e3 * count:
                continue  # idle: under 0.05 switches, 1 µs CPU and 1 µs waiting a round trip
            rows.append({"process": role, "thread": key[2], "tid": key[1],
                         "voluntary": d[0] / count, "involuntary": d[1] / count,
                         "user_us": d[2] / HZ / count * 1e6, "sys_us": d[3] / HZ / count * 1e6,
                         "runqueue_us": d[4] / 1e3 / count})
    return {"us_per_round_trip": elapsed / count * 1e6, "threads": rows}


def anatomy_asyncsgd(nbytes: int, transport: str, count: int) -> dict:
    from asyncsgd.workers.client import PSClient
    with PSServer(nbytes, 1, 4) as server:
        below = _descendants(server.proc.pid)
        client = PSClient(server.address, server.worker_ids(1)[0], _signature(nbytes), rank=0,
                          world=1, heartbeat=0.5, server_timeout=30, transport=transport)
        try:
            grads, params = torch.full((nbytes // 4,), 1e-3), torch.zeros(nbytes // 4)
            roles = {"client": os.getpid(), "server front": server.proc.pid,
                     **{f"server child {p}": p for p in below}}
            result = _measure(roles, lambda: client.push_pull(grads, params), count)
            result["shared"] = sum(a is not None for a in client.areas)
            client.bye()
        finally:
            client.close()
    return result


def anatomy_floor(nbytes: int, count: int) -> dict:
    def run(port: int) -> dict:
        client = FloorClient(port, nbytes)
        ok = False
        try:
            roles = {"client": os.getpid(),
                     **{f"floor server {p}": p for p in _descendants(os.getpid())}}
            result = _measure(roles, client.round_trip, count)
            ok = True
            return result
        finally:
            client.close(bye=ok)
    return time_against_server(_serve, (nbytes,), "ps-floor server", run)


def report(results: dict, header: str) -> str:
    lines = [header, "", "Per round trip, per thread: voluntary / involuntary context switches, "
             "user and system CPU (µs, from 100 Hz ticks: ±1 tick over the run), time runnable "
             "but waiting for a core (µs). Idle threads (under 0.05 switches, 1 µs of CPU and 1 µs "
             "of waiting a round trip) are left out.", ""]
    for (size, method), r in results.items():
        extra = f", same-host areas {r['shared']}/1" if "shared" in r else ""
        lines += [f"### {size}, {method}: {r['us_per_round_trip']:.0f} µs a round trip{extra}",
                  "", "| process | thread | voluntary | involuntary | user µs | sys µs | "
                  "run queue µs |", "|---|---|---:|---:|---:|---:|---:|"]
        totals = [0.0] * 5
        for t in r["threads"]:
            vals = [t["voluntary"], t["involuntary"], t["user_us"], t["sys_us"],
                    t["runqueue_us"]]
            totals = [a + b for a, b in zip(totals, vals)]
            lines.append(f"| {t['process']} | {t['thread']} | {vals[0]:.2f} | {vals[1]:.2f} | "
                         f"{vals[2]:.0f} | {vals[3]:.0f} | {vals[4]:.0f} |")
        lines += [f"| **all** | | {totals[0]:.2f} | {totals[1]:.2f} | {totals[2]:.0f} | "
                  f"{totals[3]:.0f} | {totals[4]:.0f} |", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", default="20KB,1MB", help=f"model sizes, of {','.join(SIZES)}")
    ap.add_argument("--round-trips", type=int, default=3000,
                    help="timed round trips per measurement (40 MiB: use ~100)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run N spinning processes beside the whole measurement")
    ap.add_argument("--no-save", action="store_true", help="print only, write no results")
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    if any(s not in SIZES for s in sizes) or args.round_trips < 1 or args.busy < 0:
        ap.error(f"sizes must be of {','.join(SIZES)}; --round-trips >= 1; --busy >= 0")
    torch.set_num_threads(1)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                 stdin=subprocess.DEVNULL) for _ in range(args.busy)]
    results = {}
    try:
        for size in sizes:
            nbytes = SIZES[size]
            for method in ("floor", "asyncsgd, TCP", "asyncsgd, same host"):
                print(f"{size} {method} ...", file=sys.stderr, flush=True)
                if method == "floor":
                    results[(size, method)] = anatomy_floor(nbytes, args.round_trips)
                else:
                    transport = "tcp" if method.endswith("TCP") else "auto"
                    results[(size, method)] = anatomy_asyncsgd(nbytes, transport,
                                                               args.round_trips)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    busy = f", {args.busy} spinning processes beside it" if args.busy else ", no added load"
    header = (f"Round-trip anatomy, 127.0.0.1, {os.cpu_count()} cores{busy}; "
              f"{args.round_trips} round trips each; {time.strftime('%Y-%m-%d %H:%M')}. "
              "`python experiments/ps_anatomy.py "
              + " ".join(a for a in sys.argv[1:] if a != "--no-save") + "`")
    text = report(results, header)
    print(text)
    if not args.no_save:
        save_results(f"ps_anatomy_busy{args.busy}" if args.busy else "ps_anatomy", text,
                     [{"size": s, "method": m, **r} for (s, m), r in results.items()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
