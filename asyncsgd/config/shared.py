"""The settings several commands share: what a run is and when it stops, and how it trains.

Each is declared here once, with what a command says otherwise in its ``per_command``;
``RUN`` and ``TRAINING`` are the groups every run and every training command take.
"""

from __future__ import annotations

from typing import Optional, Union

import click

from ..core.pacing import parse_delay, parse_slowdown
from ..core.schedule import parse_schedule, parse_warmup
from ..errors import ConfigError
from .knobs import knob, settings
from .values import LOCAL_STEPS_VALUE, CheckedText

_PROGRESS = click.Choice(["auto", "bar", "log", "off"])

# What a run trains on.
TASK = knob(
    "task", str, "mnist1d-cnn",
    "Task to train: a built-in name (list them with 'asyncsgd tasks') or "
    "'package.module:function' returning an asyncsgd.Task.",
    metavar="NAME|MODULE:FUNC", identity=True, per_command={
        "worker": "Task; must match the server's model.",
        "compare": "Task every mode trains: a built-in name (see 'asyncsgd tasks') or "
                   "'package.module:function' returning an asyncsgd.Task."})
DATA = (
    knob("samples", Optional[int], None,
         "Samples to generate for generated tasks (mnist1d: 80% train, 20% test).",
         type=click.IntRange(min=10), show="task's default (mnist1d: 5000)", identity=True,
         per_command={"worker": dict(help="Samples of generated tasks (as on the server).",
                                     show="task's default")}),
    knob("data_dir", Optional[str], None,
         "Directory with MNIST / Fashion-MNIST IDX files (for the mnist-* tasks). "
         "Nothing is ever downloaded.", metavar="DIR", identity=True, per_command={
             "worker": "Directory with MNIST IDX files (mnist-* tasks).",
             "compare": "Directory with MNIST / Fashion-MNIST IDX files (for the mnist-* "
                        "tasks)."}),
    knob("cache_dir", Optional[str], None, "Where generated data sets are cached.",
         metavar="DIR", show="$ASYNCSGD_CACHE or ~/.cache/asyncsgd"),
)

# When a run stops, evaluates and saves.
MAX_SECONDS = knob(
    "max_seconds", Optional[float], None,
    "Stop this many seconds after the command started (its start-up counts: it is time you "
    "wait too); from Python, after the run started.",
    type=click.FloatRange(min=0, min_open=True), show="no limit", per_command={
        "worker": "Stop this many seconds after the command started (its start-up counts).",
        "ps-job": "Stop this many seconds after the command started, server and workers "
                  "alike.",
        "ray-job": "Stop this many seconds after the command started (Ray's start-up "
                   "counts), server and workers alike; from Python, after asyncsgd.ray.run "
                   "was called."})
TARGET = knob(
    "target", Optional[float], None,
    "Stop once the test metric reaches this, in the task's metric and direction ('asyncsgd "
    "tasks'): accuracy as a fraction (0.9), lm's perplexity (2.0) from above.",
    type=float, metavar="VALUE", show="none", aliases=("--target-accuracy",), per_command={
        "compare": dict(
            help="Test metric whose first crossing the report times, in the task's metric "
                 "(0.9 for 90% accuracy; a perplexity for lm); runs go on to the end of the "
                 "budget unless --stop-at-target.",
            show="the task's own (lm: perplexity 2.0), else none"),
        "plot": "Draw this test metric (0.9 for 90% accuracy) and time each run's first "
                "crossing of it.",
        "simulate": dict(
            help="Test metric whose first crossing the report times, in virtual seconds and "
                 "samples, in the task's metric (0.85 for 85% accuracy); each run ends there "
                 "(--stop-at-target, on by default).",
            show="the task's own (lm: perplexity 2.0), else none")})
EVAL_EVERY = knob(
    "eval_every", float, 2.0, "Seconds between evaluations of the model on the test set.",
    type=click.FloatRange(min=0.05), per_command={
        "hogwild": "Seconds between evaluations of the shared model on the test set; the "
                   "parent evaluates beside training, without pausing the processes.",
        "single": "Seconds between evaluations on the test set, taken between steps "
                  "(training waits for them).",
        "ddp": "Seconds between evaluations on the test set: rank 0 evaluates between steps "
               "and the other ranks wait for it at the next all-reduce.",
        "ps": "Seconds between evaluations of the current parameters on the test set; the "
              "shards keep serving meanwhile.",
        "compare": dict(default=1.0, help="Seconds between test-set evaluations in every run "
                        "(the resolution of the time to target)."),
        "simulate": dict(annotation=Optional[float], default=None,
                         show="50 x the median step time",
                         help="Virtual seconds between test-set evaluations in every run (the "
                              "resolution of the time to target; each costs real time to "
                              "compute, none of the virtual clock's), e.g. 0.5.")})
SEED = knob(
    "seed", int, 0, "Random seed of the model's initial weights, the data order and torch.",
    per_command={
        "hogwild": "Random seed: the model's initial weights and the data partition; process "
                   "r seeds torch with seed + r, and its data order follows from seed and r.",
        "ddp": "Random seed: the model's initial weights (the same on every rank) and the "
               "data partition; rank r seeds torch with seed + r, and its data order follows "
               "from seed and r.",
        "ps": "Random seed of the model's initial weights, which the shards start from, and "
              "of the data of a task function that takes a seed (give its workers the same "
              "--seed). Workers split the training data with seed 0 whatever this seed, and "
              "order their batches with their own --seed.",
        "worker": "Seed of this worker's data order (each epoch's shuffle of its partition) "
                  "and of its --delay draws; a task function that takes a seed builds its "
                  "data with it, so give such a task the server's --seed. The partition "
                  "always uses seed 0, whatever the seeds, so workers given different seeds "
                  "still split the data disjointly.",
        "compare": "Seed of the first repeat: model initialisation and data order.",
        "simulate": "Seed of the first repeat (repeat r uses seed + r): the model's "
                    "initialisation, data order and every draw of the virtual clock (step "
                    "times, delays, slow workers). The same seed gives the same run."})

# Where a run computes.
DEVICE = knob(
    "device", str, "cpu", "Where the model lives and trains: cpu, or cuda (a GPU).",
    type=click.Choice(["cpu", "cuda"]), per_command={
        "hogwild": "Where the shared model lives and trains: cpu, or cuda to share it on one "
                   "GPU (every process updates it there).",
        "ddp": "Where each rank's model lives and trains: cpu, or cuda (one GPU per rank).",
        "ps": "The server keeps the parameters in CPU memory and evaluates there: only cpu. "
              "Compute gradients on GPUs with 'asyncsgd worker --device cuda'.",
        "worker": "Where the gradients are computed: cpu, or cuda (a GPU of this host). With "
                  "cuda the model lives on the GPU, each pull is copied onto it and each "
                  "gradient off it; the bytes to and from the server go through host memory "
                  "as with cpu.",
        "ps-job": "Where the workers compute gradients: cpu or cuda. The server keeps the "
                  "parameters in CPU memory whatever this is.",
        "ray-job": "Where the workers compute gradients: cpu, or cuda (with "
                   "--gpus-per-worker). The server keeps the parameters in CPU memory."})
THREADS = knob(
    "threads", int, 0,
    "Torch threads; 0 means the cores not busy with other work (the cores less the 1-minute "
    "load average, at least 1).", type=click.IntRange(min=0), per_command={
        "hogwild": "Torch threads per process; 0 means CPU cores // --procs (at least 1): N "
                   "processes each running a thread per core thrash.",
        "ddp": "Torch threads per rank; 0 means CPU cores // the ranks on this host (at "
               "least 1).",
        "ps": "Torch threads of each shard process and of the evaluation; 0 means CPU cores "
              "// (--shards + 1) for each shard (at least 1) and 1 for the evaluation.",
        "worker": "Torch threads; 0 means CPU cores // the server's processes on this host "
                  "(its workers, --local-workers, and its shards when the server runs here "
                  "too), at least 1. Several workers on one host each starting one thread per "
                  "core slow every step many times over.",
        "ps-job": "Torch threads of each shard and of each worker; 0 means CPU cores shared "
                  "among the processes on each host (at least 1).",
        "ray-job": "Torch threads of each shard and of each worker; 0 means the CPU cores of "
                   "each node shared among the job's processes there (its worker actors, and "
                   "the shards on the driver's node), at least 1."})

# What a run writes.
OUT = knob(
    "out", Optional[str], None,
    "Run directory to write (config.json, metrics.jsonl, summary.json, checkpoint.pt).",
    metavar="DIR", show="runs/<time>-<mode>", per_command={
        "compare": dict(help="Directory for the report, the plots and every run's directory.",
                        show="runs/<time>-compare"),
        "plot": dict(annotation=str, default="plots", show=None,
                     help="Directory for the PNGs and report.md."),
        "simulate": dict(help="Directory for the report, the plots and every run's "
                         "directory (OUT/<mode>-r<k>).", show="runs/<time>-simulate")})
RESUME = knob(
    "resume", Optional[str], None, "Continue the run in this run directory from its checkpoint.",
    metavar="RUN_DIR", show="none")
CHECKPOINT_EVERY = knob(
    "checkpoint_every", float, 60.0,
    "Seconds between checkpoints during training (0: only at the end).",
    type=click.FloatRange(min=0), per_command={
        "ps": "Seconds between checkpoints during training; the server and its shards also "
              "save one as they start serving, and one at the end (0: only those)."})
TENSORBOARD = knob(
    "tensorboard", bool, False, "Also write TensorBoard event files into the run directory.",
    per_command={
        "compare": "Every run also writes TensorBoard event files, into its run directory "
                   "(OUT/<mode>-r<k>/tensorboard: test metric and loss vs samples and vs whole "
                   "seconds since its launch, training loss per worker); view them all "
                   "together with 'tensorboard --logdir OUT' (needs the tensorboard "
                   "package)."})
PROGRESS = knob(
    "progress", str, "auto",
    "Progress display: a bar on a terminal and log lines otherwise (auto), or force bar, log "
    "or off.", type=_PROGRESS, per_command={
        "worker": "Progress display (auto, bar, log, off).",
        "compare": "Progress display: a live line on a terminal and log lines otherwise "
                   "(auto), or force bar, log or off; each shows the run's time since its "
                   "launch, its ETA (its budget, or --epochs at its pace, whichever ends "
                   "first) and the comparison's.",
        "simulate": "Progress display: a line per run as it starts and ends, and each run's "
                    "progress in virtual seconds, as a live line on a terminal and log lines "
                    "otherwise (auto), or force bar, log or off."})

# Two runs of a deterministic mode compare bit for bit through these (tests/test_golden.py).
RECORD_DIGESTS = knob(
    "record_digests", bool, False,
    "Write the SHA-256 of the parameters' float32 bytes after every step into the run "
    "directory's digests.jsonl, a JSON line each ({\"round\": 12, \"sha256\": ...}), so "
    "that two runs can be compared step by step. The same seed, task and --threads give the "
    "same digests on the same torch and CPU; a resumed run appends, and a step it repeats "
    "has the digest it had.", per_command={
        "ps": "Write the SHA-256 of each shard's slice of the parameters (float32 bytes) "
              "after every version it applies into the run directory's "
              "digests-shard-<i>.jsonl, a JSON line each ({\"version\": 12, \"sha256\": "
              "...}), so that two runs can be compared round by round. Reproducible under "
              "--consistency sync without --backup-workers, with the same seed, task, "
              "--threads, torch and CPU, and at most 2 workers: a round sums its pushes in "
              "the order they arrive, and a floating-point sum of 3 or more depends on the "
              "order. A resumed run appends; under sync a round it applies again (lost with "
              "a killed server) has the digest it had.",
        "simulate": "Write the SHA-256 of the simulated server's parameters (float32 bytes) "
                    "after every version it applies into each parameter-server run's "
                    "directory (OUT/<mode>-r<k>/digests.jsonl), a JSON line each "
                    "({\"version\": 12, \"sha256\": ...}); the same seed and flags give "
                    "the same digests on the same torch and CPU. Other modes write none."})

LOG_TO = knob(
    "log_to", tuple, (),
    "Also log the run to MLflow or W&B; may be given twice for both (needs the extra: pip "
    "install 'asyncsgd[loggers]'). Each gets the settings as params/config, every "
    "evaluation's metrics at step = samples, and the summary. mlflow: a local file store "
    "mlruns/ beside the run directory (runs/mlruns by default; $MLFLOW_TRACKING_URI "
    "overrides), experiment 'asyncsgd', run named as the run directory. "
    "wandb: offline files in RUN_DIR/wandb (unless $WANDB_MODE is set), project 'asyncsgd'; "
    "upload later with 'wandb sync'. E.g. --log-to mlflow --log-to wandb.",
    type=click.Choice(["mlflow", "wandb"]), multiple=True, metavar="mlflow|wandb",
    show="neither", per_command={
        "compare": "Every run also logs to MLflow or W&B, as the training commands' "
                   "--log-to (mlflow: one store OUT/mlruns for every run; wandb: offline, "
                   "in each run directory OUT/<mode>-r<k>/wandb); may be given twice."})

RUN = (TASK, *DATA, MAX_SECONDS, TARGET, EVAL_EVERY, SEED, DEVICE, THREADS, OUT, RESUME,
       CHECKPOINT_EVERY, TENSORBOARD, PROGRESS, LOG_TO)

# How a run trains.
BATCH_SIZE = knob(
    "batch_size", Optional[int], None, "Samples per step in each process.",
    type=click.IntRange(min=1), show="task's default", per_command={
        "worker": "Samples per gradient. Under a server's --balance batch, the server sets "
                  "each worker's batch instead.",
        "ps": "--balance batch: each worker's batch until the first re-sizing; the global "
              "batch is this x --workers.",
        "ps-job": "Samples per gradient of each worker; with --balance batch, the global "
                  "batch is this x the workers, which the server re-cuts by their speed.",
        "compare": "Samples per step in each process or worker, single's one process "
                   "included (ddp then averages one such batch per rank into each update).",
        "simulate": "Samples per step of each simulated worker (ddp averages one such batch "
                    "per worker into each update); the profile's step time is measured at "
                    "this batch."})
LR = knob(
    "lr", Optional[float], None, "SGD learning rate (of every process).",
    type=click.FloatRange(min=0, min_open=True), show="task's default", per_command={
        "ps": "Learning rate of the shards' update rule.",
        "compare": "Learning rate of plain SGD in every mode (the parameter server applies "
                   "it with its 'sgd' rule).",
        "simulate": "Learning rate of plain SGD in every mode, as compare's --lr (the "
                    "simulated server applies it with the real 'sgd' rule)."})
MOMENTUM = knob(
    "momentum", float, 0.0,
    "SGD momentum (adam has its own: give it none). 0: plain SGD, the update every mode makes "
    "by default (the parameter server's default rule too), so that modes compare alike.",
    type=click.FloatRange(0, 1, max_open=True), per_command={
        "hogwild": "SGD momentum; each process keeps its own momentum buffer (only the "
                   "parameters are shared). 0: plain SGD, the update every mode makes by "
                   "default, so that modes compare alike.",
        "ps": dict(default=0.9, help="Momentum of --optimizer momentum, nesterov and "
                   "delayed-nesterov (sgd, adagrad and adam ignore it). 0.9, the usual value, "
                   "since choosing that rule asks for momentum; the default rule, sgd, is "
                   "plain SGD, as the other modes' default --momentum 0 is.")})
WEIGHT_DECAY = knob(
    "weight_decay", float, 0.0, "L2 weight decay.", type=click.FloatRange(min=0),
    per_command={"ps": "L2 weight decay of the update rule."})
DEFAULT_EPOCHS = 20  # --epochs of a run given no --target and no --max-seconds
NO_EPOCH_LIMIT = 1_000_000  # --epochs when another stop condition ends the run
_EPOCHS_SHOW = f"{DEFAULT_EPOCHS}; no limit with --target or --max-seconds"
EPOCHS = knob(
    "epochs", Optional[int], None,
    f"Passes over the training data. Not given: {DEFAULT_EPOCHS}, or no limit when --target "
    "or --max-seconds is given (the run goes on until that stops it).",
    type=click.IntRange(min=1), show=_EPOCHS_SHOW,
    per_command={
        "hogwild": f"Passes over the training data: each process passes over its own "
                   f"partition. Not given: {DEFAULT_EPOCHS}, or no limit when --target or "
                   "--max-seconds is given.",
        "ddp": f"Passes over the training data: each rank passes over its own partition. Not "
               f"given: {DEFAULT_EPOCHS}, or no limit when --target or --max-seconds is given.",
        "worker": dict(show="the server's --epochs; no limit with --max-seconds", help=(
            "Passes over this worker's partition (under the server's --data-dispatch "
            "dynamic: the server's --epochs end it, or this, whichever comes first). Not "
            "given: the server's --epochs (so its --target or --max-seconds ends the "
            "worker), or no limit when this worker has --max-seconds.")),
        "ps": f"Passes over the training data. --data-dispatch dynamic: the epochs of rows the "
              f"server hands out; static: each worker's --epochs over its partition decide "
              f"(a worker not given them takes these). Not given: {DEFAULT_EPOCHS}, or no "
              "limit when --target or --max-seconds is given.",
        "compare": dict(annotation=Optional[int], default=None, show="no limit: the budget "
                        "ends every run", help="Passes over the training data after which a "
                        "run ends early."),
        "simulate": dict(annotation=Optional[int], default=None, show="no limit: --target or "
                         "--budget ends every run", help="Passes over the training data (all "
                         "workers together) after which a run ends early.")})
DATA_DISPATCH = knob(
    "data_dispatch", str, "static",
    "How training rows reach the workers. static: each worker trains its fixed partition "
    "(a slow worker's share is trained less often). dynamic: the server hands out chunks of "
    "each epoch's permutation of all rows as workers ask (riding on its replies), so every "
    "row is trained once per epoch whatever the workers' speeds; summary.json's coverage "
    "and rehanded say how evenly. E.g. --data-dispatch dynamic.",
    type=click.Choice(["static", "dynamic"]), per_command={
        "hogwild": "How rows reach the processes: static, each its own partition (a slowed "
                   "process's rows are trained less often); dynamic, processes claim the next "
                   "batch of each epoch's shuffle of all rows from a shared counter, so every "
                   "row is trained exactly once an epoch whatever their speeds (an epoch ends "
                   "once its rows are all claimed). summary.json's coverage gives the spread "
                   "of how many times rows were trained (max over min: 1.0 is even)."})
PACING = (  # the stragglers of every mode that trains (core.pacing says how they work)
    knob("slowdown", Optional[str], None,
         "Make ranks stragglers: RANK:FACTOR[,...]; e.g. 1:4 has rank 1 wait 3x its step's "
         "compute time after each step, so it takes 4x as long.",
         type=CheckedText("RANK:FACTOR", parse_slowdown), metavar="RANK:FACTOR", show="none"),
    knob("delay", Optional[str], None,
         "Random per-step delays: KIND:MEAN[@RANKS], KIND exp or const, MEAN in ms or s; e.g. "
         "exp:20ms (every rank), exp:0.5s@1,2. Seeded by --seed and rank.",
         type=CheckedText("KIND:MEAN", parse_delay), metavar="KIND:MEAN[@RANKS]", show="none"),
)
LOCAL_STEPS = knob(
    "local_steps", Union[int, str], 1,
    "Local SGD / DiLoCo: train this many steps (H) with --inner-optimizer from the pulled "
    "parameters, then push the pseudo-gradient, pulled minus local parameters, for the "
    "server's rule to apply (DiLoCo: the server's --optimizer nesterov --lr 0.7 with "
    "--consistency sync; async: asynchronous Local SGD). The inner optimizer keeps its state "
    "across rounds. 1: push every gradient. auto:H (DyLU): shard 0 sizes each worker's H "
    "to its measured steps a second, the fastest running H, so sync rounds find every "
    "worker ready together and async pushes come at one rate (e.g. auto:8; plain auto: 8). "
    "Tables served by row: a worker pulls the rows of its next H batches with its push and "
    "steps them by plain SGD (--inner-optimizer sgd), pushing each row once a window.",
    type=LOCAL_STEPS_VALUE, metavar="H|auto[:H]", per_command={
        "ddp": "Post-local SGD with PyTorch's own pieces (post_localSGD_hook and the periodic "
               "model averager that PostLocalSGDOptimizer runs): after --local-warmup steps "
               "of ordinary DDP, ranks stop all-reducing gradients, train alone and average "
               "their parameters every this many steps. 1: plain DDP. auto is for the "
               "parameter server's workers only."})

# LB-BSP's batches sized to speed (core.balance has the rule); ddp here, the parameter
# server's sync modes too.
BALANCE = (
    knob("balance", str, "none",
         "Size each worker's batch to its measured speed: batch keeps the global batch (the "
         "batch size x the workers) and gives each worker a share in proportion to its "
         "samples a second of computing (a --slowdown counts as computing), gradients "
         "weighted by batch size so each update is the global batch's mean exactly; none: "
         "equal batches. E.g. --balance batch with --slowdown 1:4 gives rank 1 about a fifth "
         "of the global batch where compute time grows with the batch. One rank: an error; "
         "a --resume starts with equal batches again.", type=click.Choice(["none", "batch"]),
         per_command={
             "ps": "Load balancing of --consistency sync rounds: none, or batch (shard 0 "
                   "measures each worker's samples per second from its pushes and every "
                   "--balance-every rounds sets each worker's batch in proportion, keeping "
                   "the global batch, --batch-size x --workers; each round is the "
                   "samples-weighted mean of its pushes, the mean over the global batch). "
                   "Needs --consistency sync and --sync-reduce mean."}),
    knob("balance_every", int, 20,
         "With --balance batch: steps between re-sizings. Each measures the speeds over the "
         "steps since the last one and costs one small all-reduce, so a window of a few "
         "steps is noisy and a long one reacts late; e.g. 20.", type=click.IntRange(min=1),
         metavar="STEPS",
         per_command={
             "ps": "With --balance batch: rounds between re-sizings of the batches. The first "
                   "cut is equal; it is re-sized once every worker has been measured (after "
                   "its first step), then every this many rounds, and at the next round after "
                   "a worker joins or leaves. E.g. 20."}),
    knob("min_batch", Optional[int], None,
         "With --balance batch: no worker's batch goes below this many samples, however slow "
         "it is (the others share the rest in proportion to speed); e.g. 4.",
         type=click.IntRange(min=1), show="a quarter of --batch-size, at least 1"),
)


def min_batch(given: Optional[int], batch_size: int) -> int:
    """--min-batch, or its default: a quarter of the per-worker batch, at least 1."""
    return given if given is not None else max(1, batch_size // 4)


# How the lr changes over a run (core.schedule has the rule).
LR_SCHEDULE = knob(
    "lr_schedule", str, "constant",
    "How the lr changes over the run's steps, after --warmup: constant; cosine (half a cosine "
    "from --lr down to 0 at the run's end: its --epochs' steps) or cosine:STEPS (0 at step "
    "STEPS, e.g. cosine:5000); linear or linear:STEPS (a straight line down to 0); "
    "step:EVERY:GAMMA (multiply the lr by GAMMA every EVERY steps, e.g. step:1000:0.5). Steps "
    "count from the run's start, a --resume's included; each evaluation's lr is in "
    "metrics.jsonl.", type=CheckedText("SCHEDULE", parse_schedule),
    metavar="constant|cosine[:STEPS]|linear[:STEPS]|step:EVERY:GAMMA", per_command={
        "hogwild": "How the lr changes over the run, driven by the steps of all processes "
                   "together (one shared count, so every process follows one schedule), "
                   "after --warmup: constant; cosine (to 0 at the run's end: --epochs' steps "
                   "of all processes) or cosine:STEPS (e.g. cosine:5000); linear or "
                   "linear:STEPS; step:EVERY:GAMMA (x GAMMA every EVERY steps, e.g. "
                   "step:1000:0.5).",
        "ps": "How the shards' lr changes, driven by the updates each applies (its version, "
              "kept in its checkpoints, so a restarted shard and a --resume continue it), "
              "after --warmup: constant; cosine:UPDATES (half a cosine from --lr to 0 at "
              "that many updates, e.g. cosine:5000); linear:UPDATES; step:EVERY:GAMMA. "
              "cosine and linear need their length here: the server cannot know how many "
              "updates the workers will push. With --local-steps it is the outer lr; the "
              "workers' --local-lr stays constant.",
        "compare": "The lr schedule of every mode (as their --lr-schedule; a parameter "
                   "server's counts its updates): constant, cosine:STEPS, linear:STEPS or "
                   "step:EVERY:GAMMA, e.g. cosine:2000 (plain cosine/linear need a length "
                   "that every mode knows: give it).",
        "simulate": "The lr schedule of every simulated mode, as compare's --lr-schedule "
                    "(e.g. cosine:2000; a parameter server's counts its updates)."})
WARMUP = knob(
    "warmup", str, "0",
    "Linear warm-up before --lr-schedule: step k of the first N has lr x (k+1)/N (the first "
    "step lr/N, never 0), then the schedule starts. N steps (e.g. --warmup 500) or samples "
    "(--warmup 16000samples: the steps holding that many, rounded up). 0: none.",
    type=CheckedText("N|Nsamples", parse_warmup), metavar="N|Nsamples", per_command={
        "hogwild": "Linear warm-up before --lr-schedule over the steps of all processes "
                   "together: step k of the first N has lr x (k+1)/N. N steps (--warmup 500) "
                   "or samples (--warmup 16000samples). 0: none.",
        "ps": "Linear warm-up before --lr-schedule over the shards' first N updates: update "
              "k has lr x (k+1)/N, e.g. --warmup 100. In updates only (an update's samples "
              "vary with the workers). 0: none.",
        "compare": "Linear warm-up of every mode, in steps (a parameter server's: updates), "
                   "e.g. --warmup 100. 0: none.",
        "simulate": "Linear warm-up of every simulated mode, in steps (a parameter "
                    "server's: updates), e.g. --warmup 100. 0: none."})

# What each step does with its gradients (modes.gradients, modes.precision).
AMP = knob(
    "amp", str, "off",
    "Mixed precision: bf16 or fp16 autocast (fp16 adds a gradient scaler). fp16 needs "
    "--device cuda; bf16 also runs on CPUs (fast only where they have bf16 instructions).",
    type=click.Choice(["off", "bf16", "fp16"]), per_command={
        "hogwild": "Mixed precision of every process's forward: bf16 or fp16 autocast (fp16 "
                   "adds a gradient scaler per process; the shared parameters stay float32). "
                   "fp16 needs --device cuda; bf16 also runs on CPUs (fast only where they "
                   "have bf16 instructions).",
        "worker": "Mixed precision of this worker's forward: bf16 or fp16 autocast (fp16 "
                  "adds a gradient scaler; what is pushed is the unscaled float32 gradient, "
                  "and a step whose gradient overflowed is not pushed). fp16 needs --device "
                  "cuda; bf16 also runs on CPUs (fast only where they have bf16 "
                  "instructions)."})
CLIP_GRAD_NORM = knob(
    "clip_grad_norm", Optional[float], None,
    "Clip each step's gradient to this total 2-norm over all parameters, as "
    "torch.nn.utils.clip_grad_norm_ (gradients scaled by MAX / norm when the norm exceeds "
    "MAX), after fp16's unscaling and, under ddp, after the all-reduce; summary.json's "
    "clipping counts the steps clipped. E.g. --clip-grad-norm 1.0.",
    type=click.FloatRange(min=0, min_open=True), metavar="MAX", show="off", per_command={
        "worker": "Clip each step's gradient on this worker, before it is compressed and "
                  "pushed, to this total 2-norm over all parameters, as "
                  "torch.nn.utils.clip_grad_norm_; with --push-every or --local-steps each "
                  "local step's gradient (not the pushed sum or change). Unlike the server's "
                  "--max-grad-norm, a security limit that refuses a push above it, this "
                  "rescales and pushes. E.g. --clip-grad-norm 1.0.",
        "compare": "Every mode clips each step's gradient to this total 2-norm "
                   "(torch.nn.utils.clip_grad_norm_; the parameter server's workers before "
                   "they push). E.g. 1.0.",
        "simulate": "Every simulated worker clips each gradient it computes to this total "
                    "2-norm (torch.nn.utils.clip_grad_norm_), as a real worker before it "
                    "pushes. E.g. 1.0."})
ACCUMULATE = knob(
    "accumulate", int, 1,
    "Gradient accumulation: each step trains K micro-batches of --batch-size rows and "
    "applies the mean of their gradients, the gradient of one K x --batch-size batch (so "
    "--lr keeps its meaning) in the memory of one micro-batch. Checkpoints fall between "
    "steps, never inside one. E.g. --accumulate 4.",
    type=click.IntRange(min=1), metavar="K", per_command={
        "ddp": "Gradient accumulation: each step trains K micro-batches of --batch-size rows "
               "on every rank and applies the mean of their gradients (the first K-1 "
               "without an all-reduce, under no_sync), the gradient of one K x --batch-size "
               "batch per rank (so --lr keeps its meaning). Checkpoints fall between steps. "
               "E.g. --accumulate 4.",
        "worker": "Gradient accumulation: each push carries the mean gradient of K "
                  "micro-batches of --batch-size rows (one K x --batch-size batch; the "
                  "server's --lr keeps its meaning), one push per K micro-batches. "
                  "--push-every N pushes the sum of N gradients with local SGD steps "
                  "between them instead: give one or the other. With --local-steps each "
                  "local step accumulates K micro-batches. E.g. --accumulate 4.",
        "compare": "Every mode accumulates each step's (each push's) gradient over K "
                   "micro-batches of --batch-size rows, the mean gradient of one K x "
                   "--batch-size batch. E.g. 4.",
        "simulate": "Every simulated worker's gradient is the mean over K micro-batches of "
                    "--batch-size rows (one K x --batch-size batch), and its step takes K "
                    "times the profile's step time. Not with balanced modes. E.g. 4."})

TRAINING = (BATCH_SIZE, LR, MOMENTUM, WEIGHT_DECAY, EPOCHS, *PACING, LR_SCHEDULE, WARMUP,
            CLIP_GRAD_NORM, ACCUMULATE)

RunConfig = settings(
    "RunConfig", "run", "Settings of every run that evaluates a model and writes a run "
    "directory.", RUN, module=__name__)



def epochs_in_force(cfg) -> None:
    """--epochs not given: no limit when --target or --max-seconds ends the run (20
    epochs silently ended runs short of their target), else 20; a worker without
    --max-seconds keeps None and takes its server's."""
    if cfg.epochs is not None:
        return
    if getattr(cfg, "target", None) is not None or cfg.max_seconds is not None:
        cfg.epochs = NO_EPOCH_LIMIT
    elif hasattr(cfg, "target"):
        cfg.epochs = DEFAULT_EPOCHS


def _training_epochs(cfg) -> None:
    """``epochs_in_force``; a cosine or linear schedule without a length then needs one."""
    epochs_in_force(cfg)
    kind, steps, _, _ = parse_schedule(cfg.lr_schedule)
    if cfg.epochs >= NO_EPOCH_LIMIT and kind in ("cosine", "linear") and steps is None:
        raise ConfigError(f"--lr-schedule {kind} runs over the run's --epochs, and no --epochs "
                          f"was given (--target or --max-seconds ends this run): give its "
                          f"length, e.g. --lr-schedule {kind}:5000 (steps), or --epochs")


TrainConfig = settings(
    "TrainConfig", "train", "Settings of the modes that run the SGD loop themselves "
    "(Hogwild, single, DDP).", TRAINING, extends=RunConfig, finish=_training_epochs,
    module=__name__)
