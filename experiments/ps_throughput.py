r"""Parameter-server push+pull round trips: asyncsgd, an RPC PS, the floor, raw pyzmq.

    python experiments/ps_throughput.py           # 4 sizes x 1,2,4 trainers x 5 repeats: ~17 min
    python experiments/ps_throughput.py --busy 2  # the same beside 2 spinning processes
    python experiments/ps_throughput.py --sizes 20KB,1MB --trainers 1,2 --seconds 0.5 \
        --repeats 1 --no-save                     # a quick look: ~35 s

All in one interleaved run, with 1 to N trainers at once: asyncsgd over TCP and over its
same-host path against a real ``asyncsgd ps-server`` (one kept per size), an RPC parameter
server on torch.distributed.rpc (``rpc_ps.py``), the floor (``ps_floor.py``) and raw pyzmq
(``raw_zmq.py``); every further ``--shards`` count gets its own ps-server. The methods' order
rotates from repeat to repeat and medians are compared, since this machine drifts. What each
method is, how trainers are started and timed, and what the tables say: experiments/README.md,
"Parameter-server round trips". Writes ``experiments/results/ps_throughput.md``
(``ps_throughput_busyN`` with --busy), ``.json`` and ``.png``, unless --no-save.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from asyncsgd.run.process_group import available_cores
from asyncsgd.servers.sharding import auto_shards

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ps_floor import measure_floor  # noqa: E402
from raw_zmq import measure_raw  # noqa: E402
from results import RESULTS, save_results  # noqa: E402
from rpc_ps import (RESULT_GRACE_S, SIZES, START_MARGIN_S, START_METHODS,  # noqa: E402
                    START_TIMEOUT_S, Owned, aggregate, die_with_parent, free_port, measure_rpc,
                    start_context, timed_round_trips)
FRAME = 4 * 2 ** 20
METHODS = {  # key: column title
    "asyncsgd_tcp": "asyncsgd, TCP",
    "asyncsgd_local": "asyncsgd, same host",
    "rpc_default": "RPC PS, TensorPipe default",
    "rpc_tcp": "RPC PS, TensorPipe TCP",
}
SERVER_STOP_S = 30.0
PROBE_TIMEOUT_S = 2.0  # one try of the start-up probe; tries go on until START_TIMEOUT_S
# What the asyncsgd trainers import, for the fork server to import once (rpc_ps adds its own).
PRELOAD = ["asyncsgd.core.tasks", "asyncsgd.wire.layout", "asyncsgd.wire.memory",
           "asyncsgd.workers.client"]
FELL_BACK = "†"  # marks a same-host cell where some trainer's shard went over TCP


def flat_task(samples=None):
    """A model of exactly ``samples`` bytes of float32 parameters (one flat tensor)."""
    from asyncsgd.core.tasks import Split, Task
    numel = (samples or 20_000) // 4
    x = torch.zeros(4, 1)
    return Task(name=f"flat-{numel}", model_fn=functools.partial(FlatModel, numel),
                train=Split((x,), torch.zeros(4, dtype=torch.long)),
                test=Split((x,), torch.zeros(4, dtype=torch.long)), lr=1e-6)


class FlatModel(torch.nn.Module):
    def __init__(self, numel: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(numel))

    def forward(self, x):
        return self.w[:2].expand(len(x), 2)


def _signature(nbytes: int) -> dict:
    from asyncsgd.wire.layout import Layout
    return Layout.of(flat_task(nbytes).build_model()).signature()


# ---------------------------------------------------------------------------- asyncsgd

def _asyncsgd_trainer(conn, address: str, worker: str, nbytes: int, rank: int, world: int,
                      seconds: float, transport: str) -> None:
    """One trainer process (one torch thread): PSClient.push_pull in a timed loop."""
    from asyncsgd.wire.memory import keep_freed_memory
    from asyncsgd.workers.client import PSClient
    keep_freed_memory()  # as every asyncsgd worker does
    numel = nbytes // 4
    params = torch.zeros(numel)
    grads = torch.ones(numel)
    # server_timeout also bounds the wait for a server still starting up.
    client = PSClient(address, worker, _signature(nbytes), rank=rank, world=world,
                      heartbeat=0.5, server_timeout=60.0, transport=transport)
    try:
        before = dict(client.stats)
        polled = client.busy_poll.polls, client.busy_poll.hits
        warmed = []  # params[0] once warmed up: the server is shared, it was moved before
        result = timed_round_trips(conn, lambda: client.push_pull(grads, params), seconds,
                                   lambda: warmed.append(float(params[0])))
        if not float(params[0]) < warmed[0]:
            raise RuntimeError(f"parameters did not move: params[0] = {float(params[0])} "
                               f"after the timed part, {warmed[0]} before it")
        stats = {k: v - before.get(k, 0) for k, v in client.stats.items()}
        # How often the trainer polled for a reply (and found it) rather than slept in recv
        stats.update(busy_polls=client.busy_poll.polls - polled[0],
                     busy_poll_hits=client.busy_poll.hits - polled[1])
        # How the tensors went, at the end: through a same-host area (per shard), or frames.
        shared = [area is not None for area in client.areas]
        stats.update(shards=len(shared), shared_shards=sum(shared), all_shared=all(shared),
                     tcp_only=(client.transport == "tcp" and not any(shared) and all(
                         a.startswith("tcp://") for a in [client.server, *client.shard_addrs])))
        client.bye()
    finally:
        client.close()
    conn.send(("result", {**result, **stats}))


def _log_tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-3000:]


def _live_group_members(pgid: int) -> list:
    """Pids of the live (not zombie) processes in process group ``pgid``, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(group) == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def _own_group_dying_with_parent() -> None:
    os.setpgid(0, 0)
    die_with_parent(signal.SIGTERM)


class PSServer:
    """One ``asyncsgd ps-server`` for one model size, up for every asyncsgd measurement of
    that size; a context manager that stops it (and everything it started) on leaving.

    Started in its own process group (its shards can be killed with it) and with
    PR_SET_PDEATHSIG (it gets SIGTERM when this process dies); up once a probe
    client got its welcome and said bye. In this process's session, as the floor's,
    raw pyzmq's and the RPC PS's servers are: Linux schedules each session as one
    group (autogroup), and a ps-server in a session of its own answers more
    slowly (experiments/README.md, "Sessions and autogroup")."""

    def __init__(self, nbytes: int, shards: int, workers: int, python: str = sys.executable,
                 extra: tuple = ()):
        """``python``: the interpreter that runs it (another commit's, for an A/B);
        ``extra``: more ps-server arguments."""
        self.nbytes = nbytes
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.tmp = tempfile.TemporaryDirectory()
        self.log = open(f"{self.tmp.name}/server.log", "w+b")
        self.serial = itertools.count()
        env = dict(os.environ,
                   PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [python, "-m", "asyncsgd", "ps-server", "--task", "ps_throughput:flat_task",
             "--samples", str(nbytes), "--shards", str(shards), "--workers", str(workers),
             "--bind", self.address, "--out", f"{self.tmp.name}/run", "--progress", "off",
             "--eval-every", "100000", "--checkpoint-every", "0", "--no-exit-when-done",
             *extra],
            env=env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            preexec_fn=_own_group_dying_with_parent)
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _wait_up(self) -> None:
        """Return once a probe client got its welcome (and said bye); raise if the server
        exits or is not up within START_TIMEOUT_S."""
        from asyncsgd.workers.client import PSClient, ServerUnavailable
        from asyncsgd.workers.client import log as client_log
        signature = _signature(self.nbytes)
        deadline = time.monotonic() + START_TIMEOUT_S
        level = client_log.level
        client_log.setLevel(logging.ERROR)  # its "retrying" while the shards start: expected
        try:
            while True:
                self.check()
                try:
                    client = PSClient(self.address, "bench-probe", signature, rank=0, world=1,
                                      heartbeat=0.5, server_timeout=PROBE_TIMEOUT_S,
                                      transport="tcp")
                    break
                except ServerUnavailable:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"ps-server not up within {START_TIMEOUT_S:g} s:\n"
                                           f"{_log_tail(self.log)}") from None
        finally:
            client_log.setLevel(level)
        try:
            client.bye()
        finally:
            client.close()

    def worker_ids(self, trainers: int) -> list:
        """Ids no earlier measurement used: exactly-once state never spans two."""
        n = next(self.serial)
        return [f"bench{n}-{rank}" for rank in range(trainers)]

    def check(self) -> None:
        """Raise if the server exited (it must serve until ``stop``)."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"ps-server exited with {self.proc.returncode}:\n"
                               f"{_log_tail(self.log)}")

    def stop(self) -> None:
        """SIGTERM, as a job scheduler would (SIGINT is ignored by a server started from a
        background shell); kill its whole process group if anything of it stays."""
        server, log = self.proc, self.log
        try:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
            try:
                server.wait(SERVER_STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)  # the leader is not reaped: its group
                server.wait()
                print(f"    ps-server ignored SIGTERM for {SERVER_STOP_S:g} s: killed\n"
                      f"{_log_tail(log)}", file=sys.stderr)
                return
            if server.returncode not in (0, 130, 143, -signal.SIGTERM):
                print(f"    ps-server exited with {server.returncode}:\n{_log_tail(log)}",
                      file=sys.stderr)
            deadline = time.monotonic() + 5  # its shards and resource tracker leave after it
            while (left := _live_group_members(server.pid)) and time.monotonic() < deadline:
                time.sleep(0.05)
            if left:
                os.killpg(server.pid, signal.SIGKILL)
                print(f"    ps-server left processes {left} behind: killed", file=sys.stderr)
        finally:
            log.close()
            self.tmp.cleanup()

    def __enter__(self) -> "PSServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def measure_asyncsgd(server: PSServer, trainers: int, seconds: float, transport: str,
                     ctx) -> dict:
    """Aggregate round trips/s of ``trainers`` PSClient processes against ``server``, all
    with ``transport`` ("tcp" or "auto"), started from ``ctx``."""
    names = [f"trainer{i}" for i in range(trainers)]
    workers = server.worker_ids(trainers)
    t0 = time.monotonic()
    with Owned(f"asyncsgd({transport})", ctx) as group:
        for rank, (name, worker) in enumerate(zip(names, workers)):
            group.spawn(name, _asyncsgd_trainer, server.address, worker, server.nbytes, rank,
                        trainers, seconds, transport)
        group.expect("ready", names, START_TIMEOUT_S, server.check)
        startup = time.monotonic() - t0
        start = time.monotonic() + START_MARGIN_S
        for name in names:
            group.send(name, start)
        results = group.expect("result", names, seconds + START_MARGIN_S + RESULT_GRACE_S,
                               server.check)
    per_trainer = [results[n] for n in names]
    if transport == "tcp" and not all(r["tcp_only"] for r in per_trainer):
        raise RuntimeError("asyncsgd with transport='tcp': a trainer's tensors did not all go "
                           f"as frames over tcp:// ({[r['shared_shards'] for r in per_trainer]}"
                           " shards through shared memory)")
    return aggregate(per_trainer, server.nbytes, seconds, transport=transport, startup_s=startup,
                     retries=sum(r["retries"] for r in per_trainer),
                     reconnects=sum(r["reconnects"] for r in per_trainer),
                     busy_polls=sum(r["busy_polls"] for r in per_trainer),
                     busy_poll_hits=sum(r["busy_poll_hits"] for r in per_trainer),
                     shards=per_trainer[0]["shards"],
                     shared_shards=min(r["shared_shards"] for r in per_trainer),
                     all_shared=all(r["all_shared"] for r in per_trainer),
                     tcp_only=all(r["tcp_only"] for r in per_trainer))


# ---------------------------------------------------------------------------- the run

def _spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)


SHARD_METHODS = ["asyncsgd_tcp", "asyncsgd_local"]  # measured at every --shards count


def measure(method: str, trainers: int, server: PSServer, ctx, args) -> dict:
    nbytes = server.nbytes
    if method == "asyncsgd_tcp":
        return measure_asyncsgd(server, trainers, args.seconds, "tcp", ctx)
    if method == "asyncsgd_local":
        return measure_asyncsgd(server, trainers, args.seconds, "auto", ctx)
    if method == "rpc_default":
        return measure_rpc(nbytes, trainers, args.seconds, "default", ctx)
    if method == "rpc_tcp":
        return measure_rpc(nbytes, trainers, args.seconds, "tcp", ctx)
    if method == "floor":
        return measure_floor(nbytes, args.seconds)
    if method == "raw":
        return measure_raw(nbytes, FRAME, args.seconds)
    raise ValueError(method)


def run(args, sizes: list, trainer_counts: list, methods: list, ctx) -> dict:
    """{(size, trainers, method): [result of each repeat]}, interleaved, progress on stderr."""
    single = ["floor", "raw"]
    more_shards = args.shard_counts[1:]
    shard_trainers = sorted({1, max(trainer_counts)})
    per_repeat = (len(trainer_counts) * len(methods) + len(single)
                  + len(more_shards) * len(shard_trainers) * len(SHARD_METHODS))
    total = len(sizes) * args.repeats * per_repeat
    runs: dict = {}
    done, t_run = 0, time.monotonic()
    workers = max(4, *trainer_counts)  # every same-host trainer gets an area (max(8, 2x))
    for size in sizes:
        nbytes = SIZES[size]
        with contextlib.ExitStack() as stack:
            servers = {}
            for shards in args.shard_counts:
                servers[shards] = stack.enter_context(PSServer(nbytes, shards, workers))
                print(f"ps-server for {size} ({shards} shard(s), --workers {workers}) up in "
                      f"{servers[shards].startup_s:.1f} s", file=sys.stderr, flush=True)
            first = args.shard_counts[0]
            for rep in range(args.repeats):
                # Rotate the order every repeat, so that no method always follows the same one.
                order = ([(1, m, first) for m in single]
                         + [(t, m, first) for t in trainer_counts for m in methods]
                         + [(t, m, n) for n in more_shards for t in shard_trainers
                            for m in SHARD_METHODS])
                k = rep % len(order)
                for trainers, method, shards in order[k:] + order[:k]:
                    t0 = time.monotonic()
                    r = measure(method, trainers, servers[shards], ctx, args)
                    r["wall_s"] = time.monotonic() - t0
                    done += 1
                    key = (size, trainers, method) + (() if shards == first else (shards,))
                    runs.setdefault(key, []).append(r)
                    left = (time.monotonic() - t_run) / done * (total - done)
                    rate = r.get("round_trips_per_s", 1000 / r["ms_per_round_trip"])
                    extra = f", start-up {r['startup_s']:.2f} s" if "startup_s" in r else ""
                    if method == "asyncsgd_local":
                        extra += f", same-host areas {r['shared_shards']}/{r['shards']}" + (
                            "" if r["all_shared"] else f" {FELL_BACK} a trainer fell back to TCP")
                    if "busy_polls" in r:  # the share of round trips that polled, and found
                        extra += (f", polled {r['busy_polls'] / max(1, r['round_trips']):.0%}"
                                  f" (found {r['busy_poll_hits'] / max(1, r['round_trips']):.0%})")
                    if r.get("retries") or r.get("reconnects"):
                        extra += f", {r['retries']} retries, {r['reconnects']} reconnects"
                    name = label(method) + ("" if shards == first else f", {shards} shards")
                    print(f"[{done}/{total}] {size:>5} x{trainers} {name:37s} "
                          f"rep {rep + 1}/{args.repeats}: {r['ms_per_round_trip']:8.3f} ms, "
                          f"{rate:9,.1f} round trips/s, {2 * nbytes * rate / 1e9:5.2f} GB/s "
                          f"({r['wall_s']:.1f} s{extra}; ~{left / 60:.1f} min left)",
                          file=sys.stderr, flush=True)
    return runs


def label(method: str) -> str:
    return METHODS.get(method) or {"floor": "floor", "raw": "raw pyzmq, 4 MiB frames"}[method]


def summarise(runs: dict, sizes: list, trainer_counts: list, methods: list) -> list:
    """One row per (size, trainers): medians over repeats of every method, and the ratios."""
    rows = []
    for size in sizes:
        nbytes = SIZES[size]
        for trainers in trainer_counts:
            row = {"size": size, "bytes": nbytes, "trainers": trainers}
            for method in methods:
                rs = runs[(size, trainers, method)]
                rate = statistics.median(r["round_trips_per_s"] for r in rs)
                row[method] = {"ms": statistics.median(r["ms_per_round_trip"] for r in rs),
                               "round_trips_per_s": rate, "gbps": 2 * nbytes * rate / 1e9,
                               "runs_ms": [r["ms_per_round_trip"] for r in rs],
                               "runs_round_trips_per_s": [r["round_trips_per_s"] for r in rs],
                               "startup_s": statistics.median(r["startup_s"] for r in rs),
                               **({"runs_polled": [r["busy_polls"] / max(1, r["round_trips"])
                                                   for r in rs]}
                                  if "busy_polls" in rs[0] else {}),
                               "wall_s": statistics.median(r["wall_s"] for r in rs)}
                if method == "asyncsgd_local":  # fewest shards any trainer reached by an area
                    row[method]["shared_shards"] = [r["shared_shards"] for r in rs]
                    row[method]["all_shared"] = all(r["all_shared"] for r in rs)
            if trainers == 1:
                for method in ("floor", "raw"):
                    rs = runs[(size, 1, method)]
                    row[f"{method}_ms"] = statistics.median(r["ms_per_round_trip"] for r in rs)
                    row[f"{method}_runs_ms"] = [r["ms_per_round_trip"] for r in rs]
                # the floor answering each part as it arrives: not all-or-nothing (ps_floor.py)
                row["floor_on_arrival_ms"] = statistics.median(
                    r["on_arrival_ms"] for r in runs[(size, 1, "floor")])
            rows.append(row)
    by_key = {(r["size"], r["trainers"]): r for r in rows}
    for row in rows:
        def ratio(a, b):
            return row[a]["round_trips_per_s"] / row[b]["round_trips_per_s"] \
                if a in row and b in row else None
        row["local_vs_rpc_default"] = ratio("asyncsgd_local", "rpc_default")
        row["tcp_vs_rpc_tcp"] = ratio("asyncsgd_tcp", "rpc_tcp")
        for base in ("floor", "raw"):  # > 1: asyncsgd faster than the floor (then no floor)
            row[f"{base}_vs_tcp"] = row[f"{base}_ms"] / row["asyncsgd_tcp"]["ms"] \
                if f"{base}_ms" in row else None
        # what the floor itself reaches against raw pyzmq: no correct server gets closer
        row["raw_vs_floor"] = row["raw_ms"] / row["floor_ms"] \
            if "raw_ms" in row and "floor_ms" in row else None
        one = by_key.get((row["size"], 1))
        for method in methods:
            row[f"{method}_vs_1_trainer"] = (
                row[method]["round_trips_per_s"] / one[method]["round_trips_per_s"]
                if one is not None else None)
    return rows


def summarise_shards(runs: dict, sizes: list, shard_counts: list, trainers: list) -> list:
    """One row per (size, trainers, shard count) of the asyncsgd methods, each with its rate
    against the first shard count's (> 1: more shards paid)."""
    rows = []
    for size in sizes:
        for t in trainers:
            base = {m: statistics.median(r["round_trips_per_s"] for r in runs[(size, t, m)])
                    for m in SHARD_METHODS}
            for n in shard_counts:
                row = {"size": size, "trainers": t, "shards": n}
                for m in SHARD_METHODS:
                    rs = runs[(size, t, m) + (() if n == shard_counts[0] else (n,))]
                    rate = statistics.median(r["round_trips_per_s"] for r in rs)
                    row[m] = {"ms": statistics.median(r["ms_per_round_trip"] for r in rs),
                              "round_trips_per_s": rate, "vs_first": rate / base[m],
                              "runs_round_trips_per_s": [r["round_trips_per_s"] for r in rs]}
                rows.append(row)
    return rows


def report_shards(rows: list, first: int) -> str:
    lines = ["", f"How many shards pay: asyncsgd at each shard count; × = aggregate rate "
                 f"against {first} shard(s) (> 1: the extra shards paid).", "",
             "| model | trainers | shards | " + " | ".join(
                 f"{METHODS[m]} | × {first}" for m in SHARD_METHODS) + " |",
             "|---|---:|---:|" + "---:|---:|" * len(SHARD_METHODS)]
    for r in rows:
        cells = [f"{r[m]['ms']:.3f} ms · {r[m]['round_trips_per_s']:,.0f}/s | "
                 f"{r[m]['vs_first']:.2f}×" for m in SHARD_METHODS]
        lines.append(f"| {r['size']} | {r['trainers']} | {r['shards']} | "
                     + " | ".join(cells) + " |")
    best = {}
    for r in rows:
        for m in SHARD_METHODS:
            key = (r["size"], r["trainers"], m)
            if key not in best or r[m]["vs_first"] > best[key][1]:
                best[key] = (r["shards"], r[m]["vs_first"])
    lines += ["", "Best shard count (1 % more rate at least): " + "; ".join(
        f"{size} x{t} {METHODS[m].split(', ')[1]}: "
        + (f"{n} ({ratio:.2f}×)" if ratio >= 1.01 else str(first))
        for (size, t, m), (n, ratio) in sorted(
            best.items(), key=lambda kv: (SIZES[kv[0][0]], kv[0][1], kv[0][2])))]
    return "\n".join(lines)


def report_default(rows: list, shard_rows: list, cores: int) -> str:
    """What a user gets by default, one worker: the floor against TCP asyncsgd at the shard
    count ``ps-server --shards auto --workers 1`` chooses on this host (informational; the
    targets above are judged at the first shard count)."""
    floor = {r["size"]: r["floor_ms"] for r in rows if r["trainers"] == 1 and "floor_ms" in r}
    at = {(r["size"], r["shards"]): r["asyncsgd_tcp"]["ms"] for r in shard_rows
          if r["trainers"] == 1}
    cells = []
    for size in floor:
        n = auto_shards(SIZES[size] // 4, 1, cores)
        cells.append(f"{size}: {n} shard(s), " + (
            f"{floor[size] / at[(size, n)]:.2f}×" if (size, n) in at
            else "not measured (add it to --shards)"))
    return ("\nAt ps-server's default shard count (`--shards auto`, one worker, "
            f"{cores} cores), floor / TCP asyncsgd (ms), 1 trainer: " + "; ".join(cells))


TARGETS = [  # (key, what, threshold, rows it applies to)
    ("local_vs_rpc_default", "same-host asyncsgd / RPC PS, TensorPipe default (rate)", 1.0,
     lambda r: True),
    ("tcp_vs_rpc_tcp", "TCP asyncsgd / RPC PS, TensorPipe TCP (rate)", 1.0, lambda r: True),
    ("floor_vs_tcp", "floor / TCP asyncsgd (ms), 1 trainer", 0.9, lambda r: r["trainers"] == 1),
    ("raw_vs_tcp", "raw pyzmq / TCP asyncsgd (ms), 1 trainer", 0.8,
     lambda r: r["trainers"] == 1),
    ("asyncsgd_tcp_vs_1_trainer", "TCP asyncsgd: aggregate rate, 4 trainers / 1", 1.0,
     lambda r: r["trainers"] == 4),
    ("asyncsgd_local_vs_1_trainer", "same-host asyncsgd: aggregate rate, 4 trainers / 1", 1.0,
     lambda r: r["trainers"] == 4),
]


def mark(value, threshold: float) -> str:
    if value is None:
        return ""
    return f"{value:.2f}× {'met' if value >= threshold else '**NOT met**'}"


def report(rows: list, methods: list, header: str) -> str:
    cols = [m for m in METHODS]
    fell_back = [f"{r['size']} x{r['trainers']}" for r in rows
                 if not r["asyncsgd_local"].get("all_shared", True)]
    lines = [header, "",
             "Per cell: ms per round trip (median over the trainers) · aggregate round trips/s "
             "of all trainers · GB/s (push + pull). Floor and raw pyzmq: one trainer. "
             "asyncsgd runs with its defaults, so its shards, and its trainers (for their "
             "shards' replies), poll for a message for up to 400 µs before sleeping while "
             "messages come that fast and are no larger than 256 KiB (`--busy-poll-us`; the "
             "JSON counts the "
             "trainers' polls); the floor polls as asyncsgd does (its own BusyPoll, "
             "`ps_floor.py`); raw pyzmq and the RPC PS sleep in recv. The floor of a push "
             "in parts is its faster all-or-nothing order, as every correct server must be; "
             "beside it, the floor answering each part as it arrives, which gives that up "
             "(a bad last part would leave the others applied and sent).", "",
             "| model | trainers | " + " | ".join(METHODS[m] for m in cols)
             + " | floor | floor, parts answered on arrival | raw pyzmq, 4 MiB frames |",
             "|---|---:|" + "---:|" * (len(cols) + 3)]
    for r in rows:
        cells = []
        for m in cols:
            f = r[m]
            cells.append(f"{f['ms']:.3f} ms · {f['round_trips_per_s']:,.0f}/s · "
                         f"{f['gbps']:.2f} GB/s" + ("" if f.get("all_shared", True)
                                                      else f" {FELL_BACK}"))
        floor = f"{r['floor_ms']:.3f} ms" if "floor_ms" in r else ""
        arrival = f"{r['floor_on_arrival_ms']:.3f} ms" \
            if "floor_ms" in r and r["bytes"] > FRAME else "one part" if "floor_ms" in r else ""
        raw = f"{r['raw_ms']:.3f} ms" if "raw_ms" in r else ""
        lines.append(f"| {r['size']} | {r['trainers']} | " + " | ".join(cells)
                     + f" | {floor} | {arrival} | {raw} |")
    titles = ["same-host / RPC default (≥ 1.0)", "TCP / RPC TCP (≥ 1.0)",
              "floor / TCP, 1 trainer (≥ 0.9)", "raw / TCP, 1 trainer (≥ 0.8)",
              "4 trainers / 1, TCP (≥ 1.0)", "4 trainers / 1, same host (≥ 1.0)"]
    lines += ["", "Targets (issues 14 and 42, \"Done when\"); ratios > 1: asyncsgd faster.", "",
              "| model | trainers | " + " | ".join(titles) + " |",
              "|---|---:|" + "---:|" * len(titles)]
    for r in rows:
        cells = []
        for key, _, threshold, applies in TARGETS:
            cells.append(mark(r.get(key), threshold) if applies(r) else "")
        lines.append(f"| {r['size']} | {r['trainers']} | " + " | ".join(cells) + " |")
    lines.append("")
    for key, what, threshold, applies in TARGETS:
        cells = [r for r in rows if applies(r)]
        if not cells or any(r.get(key) is None for r in cells):
            verdict = "not measured in this run (--trainers needs 1" + (
                " and 4)" if key.endswith("_vs_1_trainer") else ")")
        else:
            misses = [f"{r['size']} x{r['trainers']}: {r[key]:.2f}×" + _beyond(r, key, threshold)
                      for r in cells if r[key] < threshold]
            verdict = "met" if not misses else "**NOT met** (" + ", ".join(misses) + ")"
        lines.append(f"- {what} ≥ {threshold:g} at every size: {verdict}")
    lines.append(floor_verdict(rows))
    lines += ["", f"{FELL_BACK} Same-host cells where a trainer's shard went over TCP at the end "
              "of some repeat: " + (", ".join(fell_back) if fell_back else
                                    "none (every trainer reached every shard by its area)")]
    return "\n".join(lines)


def _beyond(row: dict, key: str, threshold: float) -> str:
    """For a miss against raw pyzmq where the floor itself falls short of ``threshold``
    (it does only what every correct server must, so none can reach it in this run): says
    so, with the floor's own ratio; else ''. Not where asyncsgd beat the floor: there the
    floor bounded nothing."""
    ceiling = row.get("raw_vs_floor") if key == "raw_vs_tcp" else None
    if ceiling is None or ceiling >= threshold or (row.get("floor_vs_tcp") or 0) > 1:
        return ""
    return f", beyond any correct server here: the floor's own is {ceiling:.2f}×"


def floor_verdict(rows: list) -> str:
    """Whether the floor was a floor in this run: never slower than TCP asyncsgd (its
    ms per round trip at most asyncsgd's, 1 trainer, every size)."""
    cells = [r for r in rows if r.get("floor_vs_tcp") is not None]
    if not cells:
        return "- the floor is a lower bound: not measured in this run (--trainers needs 1)"
    beaten = [f"{r['size']}: floor {r['floor_ms']:.3f} ms, asyncsgd "
              f"{r['asyncsgd_tcp']['ms']:.3f} ms" for r in cells if r["floor_vs_tcp"] > 1]
    return ("- the floor is a lower bound (never slower than TCP asyncsgd, 1 trainer): "
            + ("met at every size" if not beaten else
               "**NOT met**, asyncsgd beat it (" + "; ".join(beaten) + ")"))


def plot(rows: list, methods: list, path: Path, title: str) -> None:
    """Left: round trip against model size, one trainer. Then one panel per size: aggregate
    round trips/s against trainers."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, 1 + len(sizes), figsize=(4 + 3 * len(sizes), 3.8), dpi=90)
    ax = axes[0]
    ones = [r for r in rows if r["trainers"] == 1]
    for m in methods:
        ax.plot([r["bytes"] for r in ones], [r[m]["ms"] for r in ones], marker="o",
                label=METHODS[m])
    for key, name in (("floor_ms", "floor"), ("raw_ms", "raw pyzmq, 4 MiB frames")):
        ax.plot([r["bytes"] for r in ones], [r[key] for r in ones], linestyle="--", marker=".",
                label=name)
    ax.set(xscale="log", yscale="log", xlabel="model size (bytes of float32)",
           ylabel="push + pull round trip (ms)", title="1 trainer")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    for ax, size in zip(axes[1:], sizes):
        mine = [r for r in rows if r["size"] == size]
        for m in methods:
            ax.plot([r["trainers"] for r in mine], [r[m]["round_trips_per_s"] for r in mine],
                    marker="o", label=METHODS[m])
        ax.set(xlabel="trainers", ylabel="aggregate round trips/s", title=size,
               xticks=[r["trainers"] for r in mine], ylim=(0, None))
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", default=",".join(SIZES), help="model sizes, of those")
    ap.add_argument("--trainers", default="1,2,4", help="trainer counts")
    ap.add_argument("--shards", default="1,2",
                    help="asyncsgd shard processes: the first for the comparison, each other "
                         "measured beside it (1 and the most trainers) to show which pays")
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per measurement")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats (medians)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run N spinning processes beside the whole measurement")
    ap.add_argument("--start-method", choices=START_METHODS, default="forkserver",
                    help="how trainer and RPC processes start: forked from a fork server "
                         "with torch preloaded, or each a fresh interpreter")
    ap.add_argument("--no-save", action="store_true", help="print only, write no results")
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    try:
        trainer_counts = [int(t) for t in args.trainers.split(",")]
        args.shard_counts = list(dict.fromkeys(int(n) for n in args.shards.split(",")))
    except ValueError:
        ap.error(f"--trainers {args.trainers!r} and --shards {args.shards!r}: comma-separated "
                 "integers, e.g. --trainers 1,2,4 --shards 1,2")
    if unknown or min(trainer_counts) < 1 or args.repeats < 1 or args.seconds <= 0 \
            or args.busy < 0 or min(args.shard_counts) < 1:
        ap.error(f"sizes must be of {','.join(SIZES)}; trainers, repeats, shards >= 1; "
                 "seconds > 0; busy >= 0")
    from asyncsgd.wire.memory import keep_freed_memory
    keep_freed_memory()  # as every asyncsgd worker does; applies to the raw and floor clients
    # This process is the raw and floor client, sharing the machine with their servers: one
    # torch thread, as `asyncsgd worker` takes beside a local server.
    torch.set_num_threads(1)
    methods = list(METHODS)
    # Before the spinners, so that they never slow the fork server's one start (~1 s).
    ctx = start_context(args.start_method, PRELOAD)
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    spinners = [_spin() for _ in range(args.busy)]
    try:
        runs = run(args, sizes, trainer_counts, methods, ctx)
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
    minutes = (time.monotonic() - t0) / 60
    count = sum(len(rs) for rs in runs.values())
    rows = summarise(runs, sizes, trainer_counts, methods)
    shard_rows = summarise_shards(runs, sizes, args.shard_counts,
                                  sorted({1, max(trainer_counts)})) \
        if len(args.shard_counts) > 1 else []
    busy = f", {args.busy} spinning processes beside it" if args.busy else ", no added load"
    header = (f"Push + pull of the whole model, 127.0.0.1, {os.cpu_count()} cores"
              f"{busy} (1-min load {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
              f"{time.strftime('%Y-%m-%d %H:%M')}; {count} measurements in {minutes:.1f} min, "
              f"processes started by {args.start_method}). Median of "
              f"{args.repeats} interleaved runs of {args.seconds:g} s; asyncsgd with "
              f"{args.shard_counts[0]} shard(s) (shard counts compared: {args.shards}), "
              "one ps-server per size and shard count; "
              f"torch {torch.__version__.split('+')[0]}. "
              "`python experiments/ps_throughput.py "
              + " ".join(a for a in sys.argv[1:] if a != "--no-save") + "`")
    text = report(rows, methods, header)
    if shard_rows:
        text += "\n" + report_shards(shard_rows, args.shard_counts[0])
        text += "\n" + report_default(rows, shard_rows, available_cores())
    print(text)
    if not args.no_save:
        name = f"ps_throughput_busy{args.busy}" if args.busy else "ps_throughput"
        save_results(name, text, {"rows": rows, "shards": shard_rows})
        plot(rows, methods, RESULTS / f"{name}.png",
             f"Parameter server round trips, 127.0.0.1{busy}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
