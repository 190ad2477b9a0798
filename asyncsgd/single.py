"""``asyncsgd single``: plain SGD in one process, the baseline every speed-up is measured against.

    asyncsgd single --task mnist1d-cnn --epochs 20
    asyncsgd single --task mnist1d-cnn --batch-size 64     # = ddp --procs 2 --batch-size 32
    asyncsgd single --device cuda --amp bf16
    asyncsgd single --resume runs/20261122-101500-single --epochs 40

or from Python: ``asyncsgd.single.train(SingleConfig(epochs=20))``.

The same task, data order, SGD (``asyncsgd.optim.SGD``), run directory and
stop conditions as every other mode, with all cores' threads (``--threads``)
in one process. It is the one-rank case of the loop every DDP rank runs
(``asyncsgd.syncloop``), so single and ddp differ only in the all-reduce:
DDP with N processes and ``--batch-size B`` averages N gradients of B samples,
the same update as single with ``--batch-size N*B`` (and the same lr).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .config import SingleConfig, threads_per_process
from .errors import ConfigError
from .precision import check_amp
from .recorder import Recorder, RunResult
from .syncloop import train_process
from .tasks import Task, load_task

log = logging.getLogger(__name__)


def check_settings(cfg: SingleConfig) -> None:
    """Settings that cannot work on this machine: one clear error before any slow work."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA GPU is visible to torch "
                          "(torch.cuda.is_available() is False); use --device cpu")
    check_amp(cfg.amp, cfg.device)


def load(cfg: SingleConfig) -> Task:
    return load_task(cfg.task, samples=cfg.samples, data_dir=cfg.data_dir,
                     cache_dir=cfg.cache_dir, seed=cfg.seed)


def train(cfg: SingleConfig, task: Optional[Task] = None, argv: Optional[list] = None) -> RunResult:
    """Train in this process as configured; returns the run directory and its summary."""
    check_settings(cfg)
    run = Recorder.open_run(cfg)
    task = task or load(cfg)
    threads = threads_per_process(1, cfg.threads)
    torch.set_num_threads(threads)
    log.info("single: 1 process x %d thread(s), task %s, lr %g, batch %d, amp %s", threads,
             task.name, cfg.lr or task.lr, cfg.batch_size or task.batch_size, cfg.amp)
    return train_process(cfg, task, device=torch.device(cfg.device), run=run, argv=argv,
                         extra={"threads": threads, "device": cfg.device})
