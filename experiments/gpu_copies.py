"""What a GPU worker's step spends moving its model between the GPU and host memory.

    python experiments/gpu_copies.py                     # needs a CUDA GPU; ~20 s
    python experiments/gpu_copies.py --sizes 40MiB --tensors 64 --repeats 9

A parameter-server worker with ``--device cuda`` computes its gradient on the
GPU, pushes it from host memory and pulls the parameters into host memory (the
bytes to and from the server go through the CPU, as a CPU worker's do). Every
step therefore copies the gradient off the GPU and the parameters onto it. Two
ways, timed on a model of ``--tensors`` equal parameter tensors, interleaved:

- **per tensor, pageable**: each gradient into its slice of an ordinary flat
  host buffer, then each parameter from its slice (what ``asyncsgd worker``
  did before 2026-11-27);
- **flat, pinned**: the parameters and gradients are views of one flat buffer
  each on the GPU (``Layout.bind``), copied with one copy each way to and
  from pinned (page-locked) host buffers (what it does now).

Prints ms per step (both copies, median of ``--repeats`` runs of ``--steps``
steps) and GB/s; writes ``results/gpu_copies.md`` and ``.json`` unless
``--no-save``. Without a GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from results import save_results
from rpc_ps import SIZES  # the model sizes every round-trip benchmark here uses


def _per_tensor(params: list, grads: list, flat_g: torch.Tensor, flat_p: torch.Tensor) -> None:
    offset = 0
    for g in grads:
        flat_g[offset:offset + g.numel()].copy_(g.reshape(-1))
        offset += g.numel()
    offset = 0
    for p in params:
        p.copy_(flat_p[offset:offset + p.numel()].view(p.shape), non_blocking=True)
        offset += p.numel()
    torch.cuda.synchronize()


def _flat(gpu_p: torch.Tensor, gpu_g: torch.Tensor, flat_g: torch.Tensor,
          flat_p: torch.Tensor) -> None:
    flat_g.copy_(gpu_g)
    gpu_p.copy_(flat_p)
    torch.cuda.synchronize()


def _time(step, steps: int) -> float:
    step()  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def measure(nbytes: int, tensors: int, steps: int, repeats: int) -> dict:
    n = nbytes // 4 // tensors
    dev = torch.device("cuda")
    params = [torch.randn(n, device=dev) for _ in range(tensors)]
    grads = [torch.randn(n, device=dev) for _ in range(tensors)]
    pageable_g, pageable_p = torch.zeros(n * tensors), torch.randn(n * tensors)
    gpu_p, gpu_g = torch.randn(n * tensors, device=dev), torch.randn(n * tensors, device=dev)
    pinned_g = torch.zeros(n * tensors, pin_memory=True)
    pinned_p = torch.randn(n * tensors, pin_memory=True)
    ways = {"per tensor, pageable": lambda: _per_tensor(params, grads, pageable_g, pageable_p),
            "flat, pinned": lambda: _flat(gpu_p, gpu_g, pinned_g, pinned_p)}
    runs: dict = {name: [] for name in ways}
    for rep in range(repeats):
        for name in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
            runs[name].append(_time(ways[name], steps))
    moved = 2 * 4 * n * tensors
    return {name: {"ms": statistics.median(t) * 1e3, "gbps": moved / statistics.median(t) / 1e9}
            for name, t in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--sizes", default="1MB,10MB,40MiB", help=f"model sizes, of {list(SIZES)}")
    ap.add_argument("--tensors", default="8,64", help="parameter tensors the model has")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--repeats", type=int, default=7, help="interleaved runs (medians)")
    ap.add_argument("--no-save", action="store_true", help="print only, write no results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_copies.py needs a CUDA GPU (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"--sizes {','.join(unknown)}: choose among {','.join(SIZES)}")
    rows = []
    for size in sizes:
        for tensors in (int(t) for t in args.tensors.split(",")):
            for way, fig in measure(SIZES[size], tensors, args.steps, args.repeats).items():
                rows.append({"size": size, "tensors": tensors, "way": way,
                             "ms_per_step": round(fig["ms"], 3), "gbps": round(fig["gbps"], 2)})
                print(f"{size:>6} x {tensors:>3} tensors  {way:<22} {fig['ms']:8.3f} ms a step "
                      f"{fig['gbps']:6.2f} GB/s", flush=True)
    command = " ".join(["python experiments/gpu_copies.py", *sys.argv[1:]])
    table = [f"GPU worker's copies per step (gradient off the GPU, parameters onto it): "
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M')}; median of {args.repeats} interleaved runs "
             f"of {args.steps} steps. `{command}`\n",
             "| model | tensors | per tensor, pageable | flat, pinned | speed-up |",
             "|---|---:|---:|---:|---:|"]
    for i in range(0, len(rows), 2):
        old, new = rows[i], rows[i + 1]
        table.append(f"| {old['size']} | {old['tensors']} | {old['ms_per_step']:.3f} ms "
                     f"({old['gbps']:.1f} GB/s) | {new['ms_per_step']:.3f} ms "
                     f"({new['gbps']:.1f} GB/s) | "
                     f"{old['ms_per_step'] / new['ms_per_step']:.2f}x |")
    print("\n".join(table))
    if not args.no_save:
        save_results("gpu_copies", "\n".join(table), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
