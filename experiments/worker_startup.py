"""How soon a parameter-server worker trains: seconds from its process start to its first push.

    python experiments/worker_startup.py                    # mnist1d-cnn, 5 workers, ~30 s
    python experiments/worker_startup.py --task lm --repeats 3

A real ``asyncsgd ps-server`` runs (and is up: its stats answer); then
``--repeats`` ``asyncsgd worker`` processes are started one after the other,
and for each this script polls the shard's ``stats`` every 10 ms until its
push counter moves. What it measures is what a user waits for: the Python
start, imports (torch alone is ~0.85 s of it here), the task's data, the
handshake, the same-host attach and the first step. Issue 14 asks for ~1 s
with the server up. Also prints ``import torch`` alone, measured the same way,
as the floor no worker can beat.
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import zmq

from asyncsgd.wire.protocol import STATS, Message, decode, encode

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(ctx: zmq.Context, port: int, timeout_ms: int = 5000):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(encode(Message(type=STATS, seq=1)))
        return decode(sock.recv_multipart()).meta if sock.poll(timeout_ms) else None
    finally:
        sock.close(0)


def _stop(proc: subprocess.Popen, sig=signal.SIGINT, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="mnist1d-cnn")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    port = _free_port()
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        server = subprocess.Popen(
            [PY, "-m", "asyncsgd", "ps-server", "--task", args.task, "--bind",
             f"tcp://127.0.0.1:{port}", "--out", f"{tmp}/run", "--progress", "off",
             "--no-exit-when-done", "--workers", str(args.repeats)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 120
            while (front := _stats(ctx, port, 500)) is None:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not come up: "
                                       f"{server.communicate()[1].decode()[-2000:]}")
            shard = front["shard_ports"][0]
            waits = []
            for rank in range(args.repeats):
                before = _stats(ctx, shard)["pushes"]
                started = time.monotonic()
                worker = subprocess.Popen(
                    [PY, "-m", "asyncsgd", "worker", "--server", f"tcp://127.0.0.1:{port}",
                     "--task", args.task, "--rank", str(rank), "--world", str(args.repeats),
                     "--progress", "off", "--max-seconds", "2"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                try:
                    while _stats(ctx, shard)["pushes"] == before:
                        if worker.poll() is not None:
                            raise RuntimeError(f"worker {rank} exited {worker.returncode} "
                                               f"before pushing: "
                                               f"{worker.communicate()[1].decode()[-2000:]}")
                        time.sleep(0.01)
                    waits.append(time.monotonic() - started)
                    print(f"  worker {rank}: first push {waits[-1]:.2f} s after its start",
                          file=sys.stderr)
                    worker.wait(60)
                    if worker.returncode != 0:
                        raise RuntimeError(f"worker {rank} exited {worker.returncode}: "
                                           f"{worker.communicate()[1].decode()[-2000:]}")
                finally:
                    _stop(worker, signal.SIGKILL, 10)
        finally:
            _stop(server)
            ctx.term()
    torch_alone = []
    for _ in range(3):
        started = time.monotonic()
        subprocess.run([PY, "-c", "import torch"], check=True)
        torch_alone.append(time.monotonic() - started)
    print(f"{args.task}: a worker's first push {statistics.median(waits):.2f} s after its "
          f"process start (median of {len(waits)}, range {min(waits):.2f}-{max(waits):.2f}); "
          f"`python -c 'import torch'` alone: {statistics.median(torch_alone):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
