"""``asyncsgd single``: plain SGD in one process, the baseline every speed-up is measured against.

It is the one-rank case of the loop every DDP rank runs (``modes.syncloop``), so ddp with N
ranks and ``--batch-size B`` makes the same update as single with ``--batch-size N*B``.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..config import SingleConfig
from ..core.pacing import Pacing
from ..core.tasks import Task, task_of
from ..run.process_group import available_cores, idle_cores
from ..run.recorder import Recorder, RunResult, check_target
from .syncloop import check_settings, train_process

log = logging.getLogger(__name__)


def train(cfg: SingleConfig, task: Optional[Task] = None, argv: Optional[list] = None) -> RunResult:
    """Train in this process as configured; returns the run directory and its summary."""
    check_settings(cfg)
    Pacing.parse(cfg.slowdown, cfg.delay).check_ranks(1, "single")
    run = Recorder.open_run(cfg)
    with run.removed_on_error():
        task = task or task_of(cfg)
        check_target(cfg, task)
    threads = cfg.threads or idle_cores()
    cores = available_cores()
    if threads > cores:
        log.warning("--threads %d exceeds this machine's %d core(s): steps slow down; use "
                    "--threads %d or fewer", threads, cores, cores)
    elif threads < cores and not cfg.threads:
        # a thread that waits for a busy core stalls every step (experiments/README.md,
        # "The synchronous modes")
        log.info("single: %d of %d cores are busy with other work (load average %.1f): "
                 "%d torch thread(s); --threads N to choose", cores - threads, cores,
                 os.getloadavg()[0], threads)
    torch.set_num_threads(threads)
    log.info("single: 1 process x %d thread(s), task %s, lr %g, batch %d, amp %s", threads,
             task.name, cfg.lr or task.lr, cfg.batch_size or task.batch_size, cfg.amp)
    # flag_signals: Ctrl-C and SIGTERM stop at the next check, between two steps, so the
    # final checkpoint is one consistent state and --resume continues it exactly
    return train_process(cfg, task, device=torch.device(cfg.device), run=run, argv=argv,
                         flag_signals=True, extra={"threads": threads, "device": cfg.device})
