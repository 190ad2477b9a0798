"""Settings of the parameter server's two commands: ps-server and worker.

Their knobs also carry the help that ps-job and ray-job (``jobs.py``) give them."""

from __future__ import annotations

from typing import Optional, Union

import click

from ..wire.busy_poll import BUSY_POLL_US, MAX_BUSY_POLL_US
from .knobs import knob, settings
from .shared import (ACCUMULATE, AMP, BALANCE, BATCH_SIZE, CLIP_GRAD_NORM, DATA, DATA_DISPATCH,
                     DEVICE, EPOCHS, LOCAL_STEPS, LR, LR_SCHEDULE, MAX_SECONDS, MOMENTUM, PACING,
                     PROGRESS, RECORD_DIGESTS, SEED, TASK, THREADS, WARMUP, WEIGHT_DECAY,
                     RunConfig, epochs_in_force)
from .values import BACKUP_WORKERS, SHARD_COUNT, Compression, Consistency, ValueType

BIND = knob(
    "bind", str, "tcp://127.0.0.1:5555",
    "Address the server listens on and workers connect to. The default, loopback, admits "
    "workers on this host only; workers on other hosts need an address they reach, or all "
    "interfaces, an explicit choice: --bind tcp://0.0.0.0:5555 (unauthenticated without "
    "CURVE, and a warning says so). Shards listen on free ports of the same host and are "
    "announced in the handshake.", metavar="tcp://HOST:PORT", per_command={
        "ps-job": dict(annotation=Optional[str], default=None, help="Where the server "
                       "listens: port 0 takes a free port, which reaches the workers through "
                       "the rendezvous store. By default loopback when all of the job's "
                       "processes run on the server's host ($LOCAL_WORLD_SIZE is "
                       "$WORLD_SIZE: torchrun --standalone, one node), else all interfaces "
                       "(workers on other hosts must reach it).",
                       show="tcp://127.0.0.1:0 on one host, else tcp://0.0.0.0:0"),
        "ray-job": dict(annotation=Optional[str], default=None, help="Where the server "
                        "listens; port 0 takes a free port, which the driver hands to the "
                        "workers.", show="tcp://127.0.0.1:0 on a one-node cluster (no peer "
                        "elsewhere can reach it), else tcp://0.0.0.0:0")})
SHARDS = knob(
    "shards", Union[int, str], "auto",
    "Shard processes; the parameters are split evenly by bytes. Each adds a request per step "
    "and pays only for large models (experiments/README.md). auto: one per 5 MB of float32 "
    "parameters, at most the cores --workers leave on this host (cores - workers) and "
    "cores // workers: 1 for every model under 10 MB, and on 2 cores; a resumed run "
    "keeps its count.", type=SHARD_COUNT, metavar="auto|N", per_command={
        "compare": "Parameter-server shard processes in the ps-* modes (auto: as ps-server "
                   "chooses them)."})
WORKERS = knob(
    "workers", int, 1, "Workers expected: ssp and sync wait for this many before starting.",
    type=click.IntRange(min=1), per_command={
        "ray-job": dict(default=2, help="Worker actors. The server runs in an actor of its "
                        "own, with its --shards shard processes as its children."),
        "simulate": dict(default=16, help="Simulated workers of every parallel mode: "
                         "parameter-server workers, ddp ranks, Hogwild processes (single "
                         "trains alone). Each is a schedule and a data partition, not a "
                         "process: only a worker with a step in flight holds a copy of the "
                         "parameters, so 256 fit.")})
CURVE_SECRET = knob(
    "curve_secret", Optional[str], None,
    "The server's secret key (server.key_secret from 'asyncsgd keygen DIR'): turns on CURVE "
    "authentication and encryption for the front and every shard. Needs --allowed-clients.",
    metavar="FILE", show="off: plain TCP", per_command={
        "worker": dict(help="This worker's secret key (DIR/clients/NAME.key_secret from "
                       "'asyncsgd keygen').", show="none")})
# Polling pays only for small, frequent messages on an otherwise idle core
# (asyncsgd/wire/busy_poll.py; experiments/README.md, "Busy polling").
BUSY_POLL = knob(
    "busy_poll_us", int, BUSY_POLL_US,
    "Each shard polls for its next message for up to this many microseconds before "
    "sleeping, while messages come that often, are no larger than 256 KiB and no other "
    "thread wants its core. 0: always sleep.",
    type=click.IntRange(0, MAX_BUSY_POLL_US), per_command={
        "worker": "Wait for the shards' replies to a step by polling for up to this many "
                  "microseconds before sleeping, while replies come that fast, are no larger "
                  "than 256 KiB and no other thread wants the core. 0: always sleep.",
        "ps-job": "Shards poll for their next message, and workers for their shards' "
                  "replies, for up to this many microseconds before sleeping, while "
                  "messages come that often, are no larger than 256 KiB and no other thread "
                  "wants the core. 0: always sleep."})
# Exactly-once made visible: what each shard applied and each worker sent and was told
# (asyncsgd.run.audit writes it, asyncsgd.analysis.audit reads it).
AUDIT_DIR = knob(
    "audit_dir", Optional[str], None,
    "Write an exactly-once audit into DIR: each shard appends every push it applies, each "
    "worker every push it sends and every acknowledgement it gets, one JSON line each (read "
    "with asyncsgd.analysis.audit). Costs one write per push; off by default. E.g. "
    "--audit-dir runs/audit.", metavar="DIR", show="off")
_WIRE_DTYPES = click.Choice(["float32", "bf16", "fp16"])
EMBEDDINGS = knob(
    "embeddings", str, "sparse",
    "How the task's embedding tables travel (a task declares them, as ctr does; the others "
    "have none): sparse, row by row (a worker pulls the rows its batch touches "
    "and pushes their gradients; shards hold the tables by row, id % shards); dense, in the "
    "flat vector with every other parameter, pushed and pulled whole. Server and workers "
    "must agree: the handshake refuses a worker that lays the tables out otherwise.",
    type=click.Choice(["sparse", "dense"]))

# Row-sparse tables on the shards (--embeddings sparse): ids, memory and their update rule
ID_SPACE = knob(
    "id_space", str, "fixed",
    "The ids of the tables served by row: fixed, ids 0 to rows - 1 of the model's tables, "
    "which start from the model's own rows; hashed, any int64 id (a user feeds raw ids), a "
    "row created on first touch from a seed, held by shard hash(id) % shards.",
    type=click.Choice(["fixed", "hashed"]))
EVICT = knob(
    "evict", str, "none",
    "Bound the memory of hashed tables (needs --id-space hashed): ttl:SECONDS drops rows "
    "untouched for that long, lfu:ROWS keeps at most ROWS rows per table and shard, evicting "
    "the least used; evictions are counted, an evicted row comes back fresh. E.g. ttl:600.",
    metavar="none|ttl:SECONDS|lfu:ROWS")
TABLE_OPTIMIZER = knob(
    "table_optimizer", str, "auto",
    "Update rule of the tables served by row, on the rows a push names: auto is the "
    "counterpart of --optimizer (sgd, momentum, nesterov and delayed-nesterov: sgd, whose "
    "rows keep no momentum; adagrad: adagrad; adam: lazy-adam, whose moments decay only in "
    "the rows pushed); rowwise-adagrad is the embedding standard (TorchRec's: one "
    "accumulator per row).",
    type=click.Choice(["auto", "sgd", "adagrad", "rowwise-adagrad", "lazy-adam"]))

TABLE_LR = knob(
    "table_lr", Optional[float], None,
    "Learning rate of the tables' rule (--table-optimizer), scheduled as --lr is: "
    "adagrad-like rules take steps near lr per coordinate from the first push, so they want "
    "one far below SGD's (ctr: SGD 0.5 on the dense part, rowwise-adagrad 0.02 on the "
    "tables, TorchRec's best of 0.02-0.2 in experiments/README.md).",
    type=click.FloatRange(min=0, min_open=True), show="--lr")

ServerConfig = settings(
    "ServerConfig", "ps", "Settings of ``asyncsgd ps-server``.", BIND, SHARDS, EMBEDDINGS,
    ID_SPACE, EVICT, TABLE_OPTIMIZER, TABLE_LR,
    knob("optimizer", str, "sgd",
         "Update rule each shard applies to its slice. For workers' --local-steps "
         "pseudo-gradients: nesterov (DiLoCo's outer optimizer with --consistency sync: --lr "
         "0.7 --momentum 0.9) or delayed-nesterov (asynchronous Local SGD, Liu et al. 2024: "
         "momentum applied every --nesterov-period pushes).",
         type=click.Choice(["sgd", "momentum", "adagrad", "adam", "nesterov",
                            "delayed-nesterov"])),
    LR, MOMENTUM,
    knob("nesterov_period", int, 0,
         "delayed-nesterov: pushes per momentum step (each push moves the parameters by lr / "
         "period at once); 0 means --workers, as Liu et al. chose.", type=click.IntRange(min=0)),
    WEIGHT_DECAY,
    knob("consistency", Consistency, Consistency("async"),
         "async (apply every push on arrival), ssp:K (no worker more than K clocks ahead of "
         "the slowest live one) or sync (mean of one push per live worker). With tables "
         "served by row (--embeddings sparse) it governs the dense part only, hence its "
         "other name --dense: rows apply on arrival whatever it says, so --dense sync is "
         "Persia's hybrid (sparse asynchronous, dense synchronous).",
         type=ValueType(Consistency, "async|ssp:K|sync"), metavar="async|ssp:K|sync",
         aliases=("--dense",)),
    WORKERS,
    knob("sync_reduce", str, "mean", "How sync combines a round's pushes.",
         type=click.Choice(["mean", "sum"])),
    knob("backup_workers", Union[int, str], 0,
         "sync: apply each round once all live workers but this many have pushed (Chen et al. "
         "2016); a push that comes after its round is stale, counted, never applied. Each "
         "shard takes the first pushes to reach it, as TensorFlow's SyncReplicas did. auto: "
         "each shard times every push from its round's start and closes a round at the "
         "median + 4.45 MADs (3 standard deviations) of the last 16 rounds' times, or once "
         "as many pushes came as those rounds had by then, never before half the live "
         "workers (rounded up) pushed, and at once when all did; the first rounds wait for "
         "all. E.g. --backup-workers 1, or auto.",
         type=BACKUP_WORKERS, metavar="N|auto"),
    BALANCE, BATCH_SIZE, DATA_DISPATCH, EPOCHS,
    knob("staleness_lr", bool, False,
         "Divide the learning rate by a push's staleness (Zhang et al. 2016)."),
    knob("dc_asgd", Optional[float], None,
         "Delay-compensated ASGD (Zheng et al. 2017) with this lambda, e.g. 0.04.",
         type=click.FloatRange(min=0), show="off"),
    knob("heartbeat_timeout", float, 10.0,
         "Seconds of silence after which a worker is dropped from ssp/sync barriers.",
         type=click.FloatRange(min=0.1)),
    knob("max_grad_norm", Optional[float], None,
         "Reject pushes whose gradient norm (per shard) exceeds this: a security limit "
         "against a broken or hostile worker, counted and never applied. To clip gradients "
         "(rescale and apply them) give the workers --clip-grad-norm instead.",
         type=click.FloatRange(min=0, min_open=True), show="no bound"),
    # Parts applied early pay only with a core to spare beside the shard's and the
    # workers' threads: on 2 cores the whole-push path was 0.95-0.96x as fast with one
    # trainer, i.e. parts early were 4-5 % slower, and 0.92x with four (experiments/README.md,
    # "Parts applied as they arrive").
    knob("early_parts", str, "auto",
         "Apply each part of a push that travels in parts (over TCP, more than 4 MiB a "
         "shard) as it arrives, overlapping the update with the transfer; the push stays all "
         "or nothing, and only async and ssp without --dc-asgd, --max-grad-norm or tables "
         "do it. auto: on when each shard gets 2 torch threads or more (the default "
         "--threads on hosts of 4 cores or more).", type=click.Choice(["auto", "on", "off"])),
    knob("allow_nonfinite", bool, False,
         "Apply gradients holding NaN or Inf (rejected by default)."),
    knob("exit_when_done", bool, True,
         "Stop once every worker that joined has left (said bye or went silent)."),
    CURVE_SECRET,
    knob("allowed_clients", Optional[str], None,
         "Directory of the workers' public keys (*.key, e.g. DIR/allowed_clients from "
         "'asyncsgd keygen DIR'); with CURVE only these workers get in.", metavar="DIR",
         show="none"),
    knob("shard_restarts", int, 3,
         "Restart a crashed shard from its last checkpoint up to this many times: workers "
         "reconnect on their own, and the updates applied since that checkpoint are lost and "
         "counted (lost_updates). 0: a crashed shard ends the run.", type=click.IntRange(min=0)),
    BUSY_POLL, RECORD_DIGESTS, AUDIT_DIR, LR_SCHEDULE, WARMUP,
    extends=RunConfig, finish=epochs_in_force, module=__name__)

WorkerConfig = settings(
    "WorkerConfig", "worker", "Settings of ``asyncsgd worker``.",
    knob("server", str, "tcp://127.0.0.1:5555", "The server's address.",
         metavar="tcp://HOST:PORT"),
    TASK, DATA, EMBEDDINGS,
    knob("rank", Optional[int], None,
         "This worker's index; its data partition follows from rank and world.",
         type=click.IntRange(min=0), show="$RANK or $SLURM_PROCID or 0"),
    knob("world", Optional[int], None, "Number of workers sharing the data.",
         type=click.IntRange(min=1), show="$WORLD_SIZE or $SLURM_NTASKS or 1"),
    EPOCHS, BATCH_SIZE,
    knob("push_every", int, 1,
         "Local steps per push (Downpour's n_push): between pushes the worker applies plain "
         "SGD locally with --local-lr and pushes the summed gradients, so scale the server's "
         "--lr down by about this factor. --local-steps pushes the change of the parameters "
         "instead.", type=click.IntRange(min=1)),
    LOCAL_STEPS,
    knob("inner_optimizer", str, "sgd",
         "The optimizer of --local-steps: sgd, momentum (0.9) or adamw (DiLoCo's: e.g. "
         "--local-lr 0.001 --inner-weight-decay 0.1).",
         type=click.Choice(["sgd", "momentum", "adamw"])),
    knob("inner_weight_decay", float, 0.0,
         "Weight decay of --inner-optimizer (adamw: decoupled, as torch.optim.AdamW).",
         type=click.FloatRange(min=0)),
    knob("local_lr", Optional[float], None,
         "Learning rate of local steps: --push-every's plain SGD, or --local-steps' "
         "--inner-optimizer.", type=click.FloatRange(min=0, min_open=True),
         show="task's default"),
    MAX_SECONDS, SEED, PACING, DEVICE, THREADS,
    knob("local_workers", int, 0,
         "Workers on this host, for the default --threads; 0 means $LOCAL_WORLD_SIZE or "
         "$SLURM_NTASKS_PER_NODE, else all --world workers when the server runs on this host "
         "(its address is local) or this worker runs in a network namespace (hosts staged on "
         "one machine, as 'asyncsgd hosts up' makes them), else 1.",
         type=click.IntRange(min=0)),
    knob("heartbeat", float, 1.0, "Seconds between heartbeats while waiting on the server.",
         type=click.FloatRange(min=0.05)),
    BUSY_POLL,
    knob("server_timeout", float, 60.0,
         "Give up with an error after the server has been unreachable this long (seconds). "
         "While it waits to reach the server, a worker says so a second in, then every 5 s.",
         type=click.FloatRange(min=0.1)),
    knob("transport", str, "auto",
         "How tensors travel: auto puts them in shared memory when the server runs on this "
         "host (its address is one of this host's, in this network namespace) and sends them "
         "over TCP otherwise; shared insists on shared memory (an error if it cannot be had); "
         "tcp always uses TCP. Shared memory is the faster path on one host.",
         type=click.Choice(["auto", "shared", "tcp"])),
    knob("push_dtype", str, "float32",
         "How gradients travel: float32, or cast to bf16 or fp16 (half the bytes; the server "
         "widens them and keeps float32).", type=_WIRE_DTYPES),
    knob("pull_dtype", str, "float32",
         "How the parameters come back: float32, bf16 or fp16 (half the bytes; this worker "
         "computes from the rounded copy).", type=_WIRE_DTYPES),
    knob("compress", Compression, Compression("none"),
         "Compress pushes with error feedback (what a push leaves out is added to the next): "
         "int8 (a float32 scale per 256 values: 3.9x fewer bytes) or topk:RATIO (the RATIO "
         "share of values largest in magnitude, as index and value: topk:0.01 sends 50x fewer "
         "bytes). Not with --push-dtype. Compressed pushes and pulls go over TCP, also on "
         "this host.", type=ValueType(Compression, "none|int8|topk:RATIO"),
         metavar="none|int8|topk:RATIO"),
    PROGRESS,
    knob("curve_server_key", Optional[str], None,
         "The server's public key (server.key from 'asyncsgd keygen DIR'): connect with CURVE "
         "authentication and encryption. Needs --curve-secret.", metavar="FILE",
         show="off: plain TCP"),
    CURVE_SECRET, AUDIT_DIR, AMP, CLIP_GRAD_NORM, ACCUMULATE,
    finish=epochs_in_force, module=__name__)
