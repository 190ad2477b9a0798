"""Parameter-server push+pull throughput against raw pyzmq, side by side in one run.

    python experiments/ps_throughput.py                       # 4 sizes x 1 and 2 shards, ~4 min
    python experiments/ps_throughput.py --sizes 20KB,40MiB --seconds 2

For each model size (20 KB, 1 MB, 10 MB, 40 MiB of float32 parameters) and
shard count, a real ``asyncsgd ps-server`` runs in its own process tree and
this process acts as one worker: every round trip pushes the whole gradient
and pulls the whole parameter vector through ``workers.client.PSClient``
(msgpack headers, 4 MiB frames, one request per shard, the shards applying
plain SGD). In the same loop ``experiments/raw_zmq.py`` measures raw pyzmq
DEALER/ROUTER round trips of the same bytes (one frame, and 4 MiB frames),
and ``experiments/ps_floor.py`` the floor: raw pyzmq plus only the work no
parameter server can skip (NaN/Inf check, SGD, headers, the worker's copy);
each is repeated ``--repeats`` times, interleaved, and the medians compared,
because this machine drifts by 2x within minutes.

Writes ``experiments/results/ps_throughput.md`` (and ``.json``, and the figure
``ps_throughput.png``) unless --no-save.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ps_floor import measure_floor  # noqa: E402
from raw_zmq import measure_raw  # noqa: E402
from results import save_results  # noqa: E402

SIZES = {"20KB": 20_000, "1MB": 1_000_000, "10MB": 10_000_000, "40MiB": 40 * 2 ** 20}


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_ps(nbytes: int, shards: int, seconds: float) -> dict:
    from asyncsgd.wire.layout import Layout
    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [sys.executable, "-m", "asyncsgd", "ps-server", "--task", "ps_throughput:flat_task",
             "--samples", str(nbytes), "--shards", str(shards), "--bind",
             f"tcp://127.0.0.1:{port}", "--out", f"{tmp}/run", "--progress", "off",
             "--eval-every", "100000", "--checkpoint-every", "0", "--no-exit-when-done"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            layout = Layout.of(flat_task(nbytes).build_model())
            params = torch.zeros(layout.total)
            grads = torch.ones(layout.total)
            client = _connect(f"tcp://127.0.0.1:{port}", layout, server)
            with client:
                for _ in range(3):
                    client.push_pull(grads, params)
                times = []
                end = time.perf_counter() + seconds
                while time.perf_counter() < end or len(times) < 5:
                    t0 = time.perf_counter()
                    client.push_pull(grads, params)
                    times.append(time.perf_counter() - t0)
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    ms = statistics.median(times) * 1000
    return {"ms_per_round_trip": ms, "round_trips": len(times),
            "gbps": 2 * nbytes / (ms / 1000) / 1e9}


def _connect(address: str, layout, server: subprocess.Popen):
    from workers.client import PSClient, ServerUnavailable
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {server.stderr.read().decode()[-2000:]}")
        try:
            return PSClient(address, "bench", layout.signature(), rank=0, world=1,
                            heartbeat=0.5, server_timeout=2.0)
        except ServerUnavailable:
            if time.monotonic() > deadline:
                raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--shards", default="1,2")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    from asyncsgd.wire.memory import keep_freed_memory
    keep_freed_memory()  # as every asyncsgd worker does; applies to the raw client here too
    # This process is the worker, sharing the machine with the server: one torch thread,
    # as `asyncsgd worker` takes beside a local server. With two, OpenMP's spinning threads
    # burnt a core after every parameter copy and starved the shard (40 MiB: 130 ms -> ?).
    torch.set_num_threads(1)
    rows = []
    shard_counts = [int(s) for s in args.shards.split(",")]
    for size in args.sizes.split(","):
        nbytes = SIZES[size]
        runs: dict = {"one": [], "framed": [], "floor": [], **{k: [] for k in shard_counts}}
        for _ in range(args.repeats):  # interleaved, so drift hits raw and asyncsgd alike
            runs["one"].append(measure_raw(nbytes, None, args.seconds)["ms_per_round_trip"])
            runs["framed"].append(
                measure_raw(nbytes, 4 * 2 ** 20, args.seconds)["ms_per_round_trip"])
            runs["floor"].append(measure_floor(nbytes, args.seconds)["ms_per_round_trip"])
            for shards in shard_counts:
                runs[shards].append(measure_ps(nbytes, shards, args.seconds)["ms_per_round_trip"])
        one, framed = statistics.median(runs["one"]), statistics.median(runs["framed"])
        floor = statistics.median(runs["floor"])
        best_raw = min(one, framed)
        for shards in shard_counts:
            ps_ms = statistics.median(runs[shards])
            row = {"size": size, "bytes": nbytes, "shards": shards, "ps_ms": ps_ms,
                   "ps_gbps": 2 * nbytes / (ps_ms / 1000) / 1e9,
                   "ps_round_trips_per_s": 1000 / ps_ms, "raw_one_frame_ms": one,
                   "raw_4mib_frames_ms": framed, "floor_ms": floor,
                   "vs_best_raw": best_raw / ps_ms, "vs_floor": floor / ps_ms,
                   "overhead_us": (ps_ms - best_raw) * 1000,
                   "floor_overhead_us": (floor - best_raw) * 1000, "runs_ms": runs[shards]}
            rows.append(row)
            print(f"  {size:6s} shards={shards}: asyncsgd {ps_ms:.3f} ms, raw "
                  f"{one:.3f} / {framed:.3f} ms, floor {floor:.3f} ms", file=sys.stderr)
    lines = [f"Push + pull of the whole model, one worker, 127.0.0.1 "
             f"({time.strftime('%Y-%m-%d %H:%M')}); "
             f"median of {args.repeats} interleaved runs of {args.seconds:g} s; raw pyzmq in the "
             "same loop. Floor: raw pyzmq plus only the work no server can skip "
             "(experiments/ps_floor.py).", "",
             "| model | shards | asyncsgd ms | round trips/s | GB/s | raw 1 frame ms | "
             "raw 4 MiB frames ms | floor ms | best raw / asyncsgd | floor / asyncsgd | "
             "overhead µs (floor's) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['shards']} | {r['ps_ms']:.3f} | "
                     f"{r['ps_round_trips_per_s']:,.0f} | {r['ps_gbps']:.2f} | "
                     f"{r['raw_one_frame_ms']:.3f} | {r['raw_4mib_frames_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['vs_best_raw']:.2f}x | {r['vs_floor']:.2f}x | "
                     f"{r['overhead_us']:,.0f} ({r['floor_overhead_us']:,.0f}) |")
    text = "\n".join(lines)
    print(text)
    if not args.no_save:
        save_results("ps_throughput", text, rows)
        plot(rows, shard_counts, HERE / "results" / "ps_throughput.png")
    return 0


def plot(rows: list, shard_counts: list, path: Path) -> None:
    """Round-trip time against model size: asyncsgd per shard count, raw pyzmq beside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
    sizes = sorted({r["bytes"] for r in rows})
    for shards in shard_counts:
        mine = sorted((r["bytes"], r["ps_ms"]) for r in rows if r["shards"] == shards)
        ax.plot(*zip(*mine), marker="o", label=f"asyncsgd, {shards} shard(s)")
    for key, label in (("raw_one_frame_ms", "raw pyzmq, one frame"),
                       ("raw_4mib_frames_ms", "raw pyzmq, 4 MiB frames"),
                       ("floor_ms", "floor: raw + the work no server can skip")):
        raw = {r["bytes"]: r[key] for r in rows}
        ax.plot(sizes, [raw[b] for b in sizes], linestyle="--", marker=".", label=label)
    ax.set(xscale="log", yscale="log", xlabel="model size (bytes of float32 parameters)",
           ylabel="push + pull round trip (ms)", title="Parameter server vs raw ZeroMQ, 127.0.0.1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
