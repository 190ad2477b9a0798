"""DDP's communication: PyTorch's comm hooks (--comm-hook), post-local SGD (--local-steps).

``ddp`` builds a ``DDPComm`` and hands it to the synchronous loop, which attaches it to the
wrapped model and calls it after each step; the loop itself knows nothing of DDP.
"""

from __future__ import annotations

from ..config import DDPConfig, parse_comm_hook
from ..errors import ConfigError


def check_hooks(cfg: DDPConfig, backend: str) -> None:
    """--comm-hook and --local-steps that cannot run together or on this backend."""
    if type(cfg.local_steps) is not int:  # DyLU's auto needs a server that measures speeds
        raise ConfigError(f"ddp --local-steps {cfg.local_steps}: post-local SGD averages "
                          "every rank at the same step; auto[:H] is for the parameter "
                          "server's workers (asyncsgd worker, compare's diloco:auto); give "
                          "a whole number, e.g. --local-steps 8")
    if cfg.local_steps > 1 and cfg.comm_hook != "allreduce":
        raise ConfigError(f"--local-steps {cfg.local_steps} with --comm-hook {cfg.comm_hook}: "
                          "post-local SGD registers its own hook; choose one")
    if cfg.comm_hook == "bf16" and backend != "nccl":
        raise ConfigError(f"--comm-hook bf16: PyTorch's bf16_compress_hook all-reduces with "
                          f"NCCL only, and this run uses {backend}; use --comm-hook fp16 (or "
                          "--device cuda with NCCL)")


class DDPComm:
    """What a DDP rank's gradients go through: the hook registered on the wrapped model,
    post-local SGD's averager called after each step, and the bytes it all has moved.

    The loop's interface: ``attach(net, pacer)`` once, ``after_step(params)`` after each
    update, ``bytes(steps)`` for the summary."""

    def __init__(self, hook: str, local_steps: int, local_warmup: int, world: int):
        self.spec, self.world = hook, world
        self.local_steps, self.local_warmup = local_steps, local_warmup
        self.averager = None  # --local-steps: averages the ranks' parameters periodically
        self.traffic: AllReduceTraffic | None = None

    def attach(self, net, pacer) -> None:
        """Register the hook on the DDP-wrapped ``net``; ``pacer`` (or None: unpaced) makes
        this rank wait, as a straggler, before it hands its gradients over."""
        hook = comm_hook(self.spec)
        if self.local_steps > 1:
            hook, self.averager = post_local_sgd(self.local_steps, self.local_warmup)
        self.traffic = AllReduceTraffic(net, self.world, self.spec, hook[0], self.local_steps,
                                        self.local_warmup)
        if pacer is not None:
            net.register_comm_hook((pacer, *hook), _paced_hook)
        elif hook[1] is not None:
            net.register_comm_hook(*hook)

    def after_step(self, params) -> None:
        """What PostLocalSGDOptimizer.step does after the step: average when due."""
        if self.averager is not None:
            self.averager.average_parameters(params)

    def bytes(self, steps: int) -> int:
        """Bytes on the network in the first ``steps`` steps, every rank's together."""
        return self.traffic.bytes(steps)


def comm_hook(spec: str) -> tuple:
    """``(state, hook)`` of --comm-hook: PyTorch's own DDP communication hooks, so that a
    comparison runs what a PyTorch user would; ``(None, None)``: DDP's built-in all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    kind, rank = parse_comm_hook(spec)
    if kind == "fp16":
        return None, default_hooks.fp16_compress_hook
    if kind == "bf16":
        return None, default_hooks.bf16_compress_hook
    if kind == "powersgd":
        # start_powerSGD_iter 2, not 1,000: runs here are short, and PowerSGD must start
        # after at least one plain step (its error feedback needs one)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=2)
        return state, (_one_bucket_at_a_time if _gloo() else powerSGD_hook.powerSGD_hook)
    return None, None


def _gloo() -> bool:
    import torch.distributed as dist
    return dist.is_initialized() and dist.get_backend() == "gloo"


def _one_bucket_at_a_time(state, bucket):  # no annotations: DDP checks them as objects
    """PowerSGD on Gloo, each bucket's collectives done before the next bucket's begin.

    PowerSGD chains its all-reduces (uncompressed tensors, then P, then Q) in future
    callbacks; with two buckets (DDP's first holds 1 MiB: mnist1d-mlp:width=512 has two)
    the chains interleave in a different order on each rank, and Gloo, which matches
    collectives by order, failed: 'Received data size doesn't match expected size. 264 vs
    256', rank 0 already in the next all-reduce. NCCL orders them on its stream."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    fut = powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def post_local_sgd(period: int, warmup: int) -> tuple:
    """``((state, hook), averager)`` of ddp --local-steps: PyTorch's post-local SGD.

    Its hook all-reduces gradients for ``warmup`` steps, then not at all (no subgroup
    all-reduce: ranks train alone); the averager all-reduces the parameters every
    ``period`` steps after the warm-up. PyTorch's PostLocalSGDOptimizer is the optimizer's
    step then this averager; it wraps a torch.optim.Optimizer, which this loop's optimizer
    is not (modes.optim says why), so the loop calls the averager itself."""
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState, post_localSGD_hook)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup,
                              post_local_gradient_allreduce=False)
    return (state, post_localSGD_hook), PeriodicModelAverager(period=period,
                                                              warmup_steps=warmup)


class AllReduceTraffic:
    """The bytes a DDP job's gradient all-reduces put on the network, from what DDP hands
    its communication hook each step (all the gradients: every parameter here is used):
    the gradients' bytes with the default hook, 2 bytes a value with fp16/bf16, PowerSGD's
    own count of what it sent once it compresses (``total_numel_after_compression``),
    post-local SGD's warm-up steps and then a copy of the parameters at each averaging.
    Gloo's and NCCL's all-reduce is a ring: each of W ranks sends and receives 2(W-1)/W of
    that payload, so the network carries 2(W-1) times it. Computed, not counted: a run
    over shaped links (compare --link) has the kernel's count beside it. DDP also
    broadcasts the model's buffers from rank 0 before each step (``broadcast_buffers``:
    the LM task's causal mask, context^2 values): W-1 copies. Left out: the agreement
    all-reduces (a few float64 per check)."""

    def __init__(self, net, world: int, hook: str, hook_state, local_steps: int,
                 local_warmup: int):
        params = [p for p in net.parameters() if p.requires_grad]
        self.values = sum(p.numel() for p in params)
        self.itemsize = params[0].element_size() if params else 4
        self.buffers = sum(b.numel() * b.element_size() for b in net.buffers()) \
            if getattr(net, "broadcast_buffers", False) else 0
        self.world, self.kind = world, parse_comm_hook(hook)[0]
        self.state, self.local_steps, self.warmup = hook_state, local_steps, local_warmup

    def payload(self, steps: int) -> int:
        """Bytes one rank handed to all-reduce in its first ``steps`` steps."""
        full = self.values * self.itemsize
        if self.local_steps > 1:  # post-local SGD: PeriodicModelAverager's schedule
            averagings = len(range(self.warmup, steps, self.local_steps))
            return min(steps, self.warmup) * full + averagings * full
        if self.kind in ("fp16", "bf16"):
            return steps * self.values * 2
        if self.kind == "powersgd":
            plain = min(steps, self.state.start_powerSGD_iter)
            return plain * full + int(self.state.total_numel_after_compression) * self.itemsize
        return steps * full

    def bytes(self, steps: int) -> int:
        """Bytes on the network, every rank's together: a ring's 2(W-1) x the payload, and
        W-1 copies of the buffers a step."""
        return (self.world - 1) * (2 * self.payload(steps) + steps * self.buffers)


def _paced_hook(state, bucket):  # no annotations: DDP checks them as objects
    """DDP's all-reduce (or --comm-hook's), after this rank's pace: a straggler's gradients
    reach the others late. The last bucket is handed over once every gradient of the step
    is computed. ``state``: (pacer, the hook's own state, the hook or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    pacer, inner_state, inner = state
    if bucket.is_last():
        pacer.end()
    return (inner or allreduce_hook)(inner_state, bucket)
