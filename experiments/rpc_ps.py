"""A parameter server on torch.distributed.rpc: the yardstick a PyTorch user would reach for.

    python experiments/rpc_ps.py         # 4 sizes x 2 transports x 1, 2 trainers, ~30 s
    python experiments/rpc_ps.py --sizes 1MB --trainers 1,4 --transport tcp --seconds 1

As in pytorch/examples ``distributed/rpc`` (parameter_server, batch): one PS
process (rank 0, named "ps") holds the model, here one flat float32 tensor of
N bytes; every trainer process calls ``rpc.rpc_sync("ps", push_pull,
args=(grad,))``; the PS applies plain SGD (``p.add_(g, alpha=-lr)``) under a
``threading.Lock`` and returns the parameter tensor itself, as the examples
return their model (TensorPipe sends it after the function returns, so a
concurrent push may tear what one trainer reads: the cheapest thing an RPC PS
can do, and what the examples do); the trainer copies the reply into its own
preallocated buffer (``params.copy_(reply)``).

Two transports:
  * ``default``: TensorPipe as it comes. On one host it picks its ``shm``
    transport (ring buffers in shared memory) and the ``cma`` channel
    (process_vm_readv) for tensor data; TCP (``uv``) is never touched.
  * ``tcp``: ``TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])``,
    TensorPipe over libuv TCP only, tensor data on the same connection.
    (Checked for torch 2.13: ``TensorPipeAgent::startImpl`` registers only the
    registry keys listed in ``opts.transports``/``opts.channels``, the keys
    being uv/shm/ibv and basic/cma/mpt_uv; with ``TP_VERBOSE_LOGGING=9`` the
    default run's connections are ``tr_shm``/``ch_cma`` and the TCP run's only
    ``tr_uv``/``ch_basic``.) ``TP_SOCKET_IFNAME=lo`` pins uv to 127.0.0.1.

Every process is owned here (``Owned``): a fresh PS and fresh trainers per
measurement, forked from one fork server that imported torch,
torch.distributed.rpc and this module once (``start_context``; ``--start-method
spawn`` starts each as a fresh interpreter instead: same figures, ~1-2 s more
per process); one torch thread each, the RPC rendezvous on a free port of
127.0.0.1 (``init_method="tcp://..."``), start-up bounded by a timeout,
children's tracebacks sent back over a pipe and raised here, exit codes
checked, and anything left running killed. A child also dies with this
process: PR_SET_PDEATHSIG, and, since a forked child's direct parent is the
fork server, a thread waiting on a pidfd of this process
(``asyncsgd.run.process_group``). The PS keeps the rendezvous store until
every trainer is through ``rpc.shutdown`` (see ``_serve``). Trainers warm up with 3
round trips, then all start at one shared instant (CLOCK_MONOTONIC is one
clock for every process on Linux) and count the round trips they complete in
the next ``seconds``. RPC processes keep glibc's default malloc settings, as
a PyTorch user's would (asyncsgd workers raise the mmap threshold).

``measure_rpc`` is importable (with ``experiments/`` on ``sys.path``);
``experiments/ps_throughput.py`` runs it beside asyncsgd. The helpers for
owned process groups (``Owned``, ``timed_round_trips``) serve it too.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings

import torch

from asyncsgd.run.process_group import _die_with_parent as die_with_owner, context

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the fork server imports this module by name (PRELOAD)
    sys.path.insert(0, HERE)

WARMUP_ROUND_TRIPS = 3
LR = 1e-6
START_TIMEOUT_S = 180.0  # spawn + import torch + rendezvous + warm-up, on a loaded 2-core box
RESULT_GRACE_S = 120.0  # after the timed window: a last 40 MiB round trip, reporting, shutdown
EXIT_TIMEOUT_S = 30.0
START_MARGIN_S = 0.2  # the shared start lies this far after the last trainer is ready
RPC_TIMEOUT_S = 120.0
TRANSPORTS = ("default", "tcp")
SIZES = {"20KB": 20_000, "1MB": 1_000_000, "10MB": 10_000_000, "40MiB": 40 * 2 ** 20}


# ---------------------------------------------------------------------------- owned processes

def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies (best effort)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(conn, parent_pid: int, target, args: tuple) -> None:
    """Entry point of every owned child: one torch thread, dies with the parent, reports errors.

    ``die_with_owner`` (``asyncsgd.run.process_group``): PR_SET_PDEATHSIG follows the
    direct parent, which under forkserver is the fork server, so a thread also waits on
    a pidfd of the owning process and ends this one when it dies (or at once, when it
    died before we got here)."""
    die_with_owner(parent_pid)
    torch.set_num_threads(1)
    try:
        target(conn, *args)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
        sys.stderr.flush()
        os._exit(1)
    finally:
        conn.close()


# What the fork server imports once, before it forks any child: the children's targets
# and the modules they use (``start_context`` adds a caller's). "__main__" re-runs the
# main script there as ``__mp_main__`` (its ``if __name__ == "__main__"`` part excluded),
# so that children unpickle targets defined in it without importing it again.
PRELOAD = ["__main__", "torch.distributed.rpc", "rpc_ps"]
START_METHODS = ("forkserver", "spawn")


def start_context(method: str = "forkserver", preload=()):
    """The multiprocessing context owned children start from.

    ``forkserver`` (the default): one fresh interpreter, started here (~1 s, once per
    process), imports torch and ``PRELOAD`` + ``preload`` once and forks every child
    from there: a child runs its target ~10 ms after ``start()``, against 1-2 s for a
    spawned one importing torch on this 2-core machine (more beside other work). The
    fork server holds one thread and no CUDA context, so forking it is safe, and the
    owning process is never forked. Its preload list is fixed once it runs: a later
    call's ``preload`` is imported by each child instead. ``spawn``: a fresh
    interpreter per child."""
    if method not in START_METHODS:
        raise ValueError(f"start method {method!r} not in {START_METHODS}")
    PRELOAD.extend(m for m in preload if m not in PRELOAD)
    ctx = context(method, PRELOAD if method == "forkserver" else ())
    if method == "forkserver":
        from multiprocessing import forkserver
        forkserver.ensure_running()  # now, not inside the first measurement's start-up
    return ctx


class Owned:
    """Children this process owns: started, talked to over pipes, joined, or killed.

    Every child runs ``target(conn, *args)``; it sends ``(kind, payload)``
    tuples and may receive whatever the parent sends. ``expect`` waits for one
    message of a given kind from each named child and raises RuntimeError,
    with the child's traceback, if a child reports an error, dies or stays
    silent past the timeout. ``close`` joins the children, checks their exit
    codes (when asked) and kills whatever is left; use it as a context
    manager so that no child outlives a failure. ``ctx``: the multiprocessing
    context they start from (default ``start_context()``: the fork server).
    """

    def __init__(self, what: str, ctx=None):
        self.what = what
        self.ctx = ctx if ctx is not None else start_context()
        self.children: dict = {}  # name -> (process, parent end of the pipe)

    def spawn(self, name: str, target, *args) -> None:
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=_child, args=(theirs, os.getpid(), target, args),
                                name=f"{self.what}:{name}", daemon=True)
        proc.start()
        theirs.close()
        self.children[name] = (proc, mine)

    def send(self, name: str, obj) -> None:
        self.children[name][1].send(obj)

    def expect(self, kind: str, names, timeout: float, watch=None) -> dict:
        """``{name: payload}`` of one ``kind`` message from each of ``names``.

        ``watch`` is called every 0.2 s while waiting (to notice a dead helper
        outside this group, say) and may raise to abort."""
        waiting, got = set(names), {}
        deadline = time.monotonic() + timeout
        while waiting:
            for name in sorted(waiting):
                proc, conn = self.children[name]
                try:
                    ready = conn.poll(0)
                    message = conn.recv() if ready else None
                except (EOFError, OSError):
                    proc.join(5)
                    raise RuntimeError(f"{self.what}: {name} exited without a word "
                                       f"(exit code {proc.exitcode}) while we waited for "
                                       f"'{kind}'") from None
                if message is None:
                    continue
                if message[0] == "error":
                    raise RuntimeError(f"{self.what}: {name} failed:\n{message[1]}")
                if message[0] != kind:
                    raise RuntimeError(f"{self.what}: {name} sent {message[0]!r}, "
                                       f"expected {kind!r}")
                got[name] = message[1]
                waiting.discard(name)
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.what}: no '{kind}' from {sorted(waiting)} within "
                                   f"{timeout:g} s")
            if watch is not None:
                watch()
            multiprocessing.connection.wait([self.children[n][1] for n in waiting]
                                            + [self.children[n][0].sentinel for n in waiting],
                                            timeout=0.2)
        return got

    def close(self, check: bool = True) -> None:
        """Join every child (EXIT_TIMEOUT_S), kill stragglers; with ``check``, raise on a bad
        exit code."""
        bad = []
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        for name, (proc, conn) in self.children.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                bad.append(f"{name} still running after {EXIT_TIMEOUT_S:g} s: killed")
                proc.kill()
                proc.join(5)
            elif proc.exitcode != 0:
                bad.append(f"{name} exited with {proc.exitcode}")
            conn.close()
        self.children.clear()
        if bad and check:
            raise RuntimeError(f"{self.what}: " + "; ".join(bad))

    def kill(self) -> None:
        for proc, conn in self.children.values():
            if proc.is_alive():
                proc.kill()
        for proc, conn in self.children.values():
            proc.join(5)
            conn.close()
        self.children.clear()

    def __enter__(self) -> "Owned":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.kill()
        else:
            self.close()


def timed_round_trips(conn, round_trip, seconds: float, warmed=None) -> dict:
    """A trainer's timed part: warm up, say ready, wait for the shared start, count round trips.

    Sends ``("ready", {})`` after WARMUP_ROUND_TRIPS round trips (and a call of
    ``warmed()``, when given: to note the state the timed part starts from) and waits
    (at most START_TIMEOUT_S) for the parent's start instant on
    ``time.monotonic()``. Counts the round trips that complete within
    ``[start, start + seconds]``; the one in flight at the end completes
    (so every trainer loads the server to the end) and counts for the share
    of it that fell inside the window (``last_share``). Counting it as 0
    lost each trainer half a round trip on average: at 40 MiB, ~30 round
    trips/s in all, 4 trainers (~15 each in 2 s) lost ~3.4 % of their count
    and one trainer ~0.8 %, so 4 trainers read ~0.97x of one where they
    matched it.
    Returns the count, that share, every timed duration, the median and how
    late this trainer began.
    """
    for _ in range(WARMUP_ROUND_TRIPS):
        round_trip()
    if warmed is not None:
        warmed()
    conn.send(("ready", {}))
    if not conn.poll(START_TIMEOUT_S):
        raise RuntimeError(f"no start time from the parent within {START_TIMEOUT_S:g} s")
    start = conn.recv()
    end = start + seconds
    while (left := start - time.monotonic()) > 0:
        time.sleep(left)
    late = time.monotonic() - start
    durations, counted, last_share = [], 0, 0.0
    while True:
        began = time.monotonic()
        t0 = time.perf_counter()
        round_trip()
        t1 = time.perf_counter()
        durations.append(t1 - t0)
        if time.monotonic() > end:
            last_share = min(1.0, max(0.0, (end - began) / max(t1 - t0, 1e-9)))
            break
        counted += 1
    # The last duration belongs to the round trip that ended past the window; keep it for the
    # median only when it is the only one (a window shorter than one round trip).
    timed = durations[:-1] or durations
    return {"round_trips": counted, "last_share": last_share,
            "calls": WARMUP_ROUND_TRIPS + len(durations),
            "median_ms": statistics.median(timed) * 1e3,
            "durations_ms": [d * 1e3 for d in timed], "late_ms": late * 1e3}


def aggregate(per_trainer: list, nbytes: int, seconds: float, **extra) -> dict:
    """One measurement's figures from its trainers' ``timed_round_trips`` results."""
    total = sum(r["round_trips"] for r in per_trainer)
    rate = (total + sum(r["last_share"] for r in per_trainer)) / seconds
    return {"nbytes": nbytes, "trainers": len(per_trainer), "seconds": seconds,
            "round_trips": total, "round_trips_per_s": rate,
            "ms_per_round_trip": statistics.median(r["median_ms"] for r in per_trainer),
            "per_trainer_ms": [r["median_ms"] for r in per_trainer],
            "per_trainer_round_trips": [r["round_trips"] for r in per_trainer],
            "max_late_ms": max(r["late_ms"] for r in per_trainer),
            "gbps": 2 * nbytes * rate / 1e9, **extra}


# ---------------------------------------------------------------------------- the RPC PS

_PARAMS: torch.Tensor | None = None
_LOCK = threading.Lock()
_UPDATES = 0


def push_pull(grad: torch.Tensor) -> torch.Tensor:
    """Runs on the PS (an RPC worker thread): apply SGD under the lock, return the parameters."""
    global _UPDATES
    with _LOCK:
        _PARAMS.add_(grad, alpha=-LR)
        _UPDATES += 1
    return _PARAMS


def _options(transport: str, port: int):
    from torch.distributed import rpc
    kw = {}
    if transport == "tcp":
        kw = {"_transports": ["uv"], "_channels": ["basic"]}
    elif transport != "default":
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=RPC_TIMEOUT_S, **kw)


def _init_rpc(name: str, rank: int, world: int, transport: str, port: int) -> float:
    """init_rpc with TCP pinned to the loopback interface; returns the seconds it took."""
    os.environ["TP_SOCKET_IFNAME"] = "lo"
    # rpc's start-up gathers through a Gloo group and warns that this is deprecated: noise here.
    warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
    from torch.distributed import rpc
    t0 = time.perf_counter()
    rpc.init_rpc(name, rank=rank, world_size=world,
                 rpc_backend_options=_options(transport, port))
    return time.perf_counter() - t0


def _serve(conn, port: int, world: int, transport: str, nbytes: int) -> None:
    global _PARAMS
    from torch.distributed import rpc
    _PARAMS = torch.zeros(nbytes // 4)
    init_s = _init_rpc("ps", 0, world, transport, port)
    # The rendezvous store (a TCPStore) lives here, in rank 0, and its agent drops it at the
    # end of shutdown. Shutdown's last barrier (TensorPipeAgent::join, syncCallCount) lets
    # this rank through once every rank has arrived, possibly before a trainer has read
    # the result: a trainer then failed with "Connection reset by peer" (seen once, beside
    # 2 spinning processes). Keep the store until the owner has every trainer's result.
    from torch._C._distributed_rpc import _get_current_rpc_agent
    store = _get_current_rpc_agent().store
    conn.send(("up", {"init_rpc_s": init_s}))
    rpc.shutdown()  # graceful: returns once every trainer has shut down too
    conn.send(("done", {"updates": _UPDATES, "param0": float(_PARAMS[0])}))
    if conn.poll(RESULT_GRACE_S + EXIT_TIMEOUT_S):  # "exit": the trainers are through
        conn.recv()
    del store


def _train(conn, port: int, world: int, rank: int, transport: str, nbytes: int,
           seconds: float) -> None:
    from torch.distributed import rpc
    init_s = _init_rpc(f"trainer{rank}", rank, world, transport, port)
    numel = nbytes // 4
    params = torch.zeros(numel)
    grad = torch.full((numel,), 1e-3)

    def round_trip() -> None:
        params.copy_(rpc.rpc_sync("ps", push_pull, args=(grad,)))

    result = timed_round_trips(conn, round_trip, seconds)
    if not float(params[0]) < 0:
        raise RuntimeError(f"parameters did not move: params[0] = {float(params[0])}")
    rpc.shutdown()
    conn.send(("result", {**result, "init_rpc_s": init_s}))


def measure_rpc(nbytes: int, trainers: int = 1, seconds: float = 2.0,
                transport: str = "default", ctx=None) -> dict:
    """Aggregate push+pull round trips/s of ``trainers`` processes against an RPC PS.

    ``transport`` is "default" (TensorPipe's choice: shm + cma on one host) or
    "tcp" (uv + basic only). Returns round_trips_per_s (all trainers, counted
    in a window they all start together), ms_per_round_trip (median of the
    trainers' medians), gbps (push + pull bytes at that rate), startup_s (from
    the first start until every trainer had warmed up) and the details.
    ``ctx``: the context processes start from (default ``start_context()``).
    Raises RuntimeError if any process fails, with its traceback.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if nbytes < 8 or trainers < 1 or seconds <= 0:
        raise ValueError("need nbytes >= 8, trainers >= 1 and seconds > 0")
    port, world = free_port(), trainers + 1
    names = [f"trainer{r}" for r in range(1, world)]
    t0 = time.monotonic()
    with Owned(f"rpc-ps({transport})", ctx) as group:
        group.spawn("ps", _serve, port, world, transport, nbytes)
        for rank, name in enumerate(names, start=1):
            group.spawn(name, _train, port, world, rank, transport, nbytes, seconds)
        up = group.expect("up", ["ps"], START_TIMEOUT_S)["ps"]
        group.expect("ready", names, START_TIMEOUT_S)
        startup = time.monotonic() - t0
        start = time.monotonic() + START_MARGIN_S
        for name in names:
            group.send(name, start)
        results = group.expect("result", names, seconds + START_MARGIN_S + RESULT_GRACE_S)
        done = group.expect("done", ["ps"], EXIT_TIMEOUT_S)["ps"]
        group.send("ps", "exit")  # its store may go now: every trainer is through shutdown
    per_trainer = [results[n] for n in names]
    calls = sum(r["calls"] for r in per_trainer)
    if done["updates"] != calls:
        raise RuntimeError(f"the PS applied {done['updates']} pushes, trainers made {calls}")
    return aggregate(per_trainer, nbytes, seconds, transport=transport, startup_s=startup,
                     init_rpc_s=max([up["init_rpc_s"]] + [r["init_rpc_s"] for r in per_trainer]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES), help="of " + ",".join(SIZES))
    ap.add_argument("--trainers", default="1,2")
    ap.add_argument("--transport", default="default,tcp")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--start-method", choices=START_METHODS, default="forkserver",
                    help="how the PS and trainer processes start")
    args = ap.parse_args()
    ctx = start_context(args.start_method)
    for size in args.sizes.split(","):
        for transport in args.transport.split(","):
            for trainers in [int(t) for t in args.trainers.split(",")]:
                r = measure_rpc(SIZES[size], trainers, args.seconds, transport, ctx)
                print(f"{size:>6} {transport:7} trainers={trainers}: "
                      f"{r['ms_per_round_trip']:8.3f} ms, {r['round_trips_per_s']:8,.1f} "
                      f"round trips/s, {r['gbps']:5.2f} GB/s (start-up {r['startup_s']:.1f} s, "
                      f"init_rpc {r['init_rpc_s']:.2f} s)", flush=True)
    return 0


if __name__ == "__main__":
    # Run under the module's own name, so that trainers pickle ``rpc_ps.push_pull`` and the
    # PS (which imports rpc_ps, not __main__) finds it.
    import rpc_ps
    sys.exit(rpc_ps.main())
