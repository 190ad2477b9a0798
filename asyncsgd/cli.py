"""The ``asyncsgd`` command line. It only parses options and calls the library.

    asyncsgd tasks                                 # what can be trained
    asyncsgd hogwild --task mnist1d-cnn --procs 8  # Hogwild! on shared memory
    asyncsgd hogwild --resume runs/<dir> --epochs 40

Errors a user can fix are printed as one line, ``error: ...``. Exit codes (the table
is in docs/exit-codes.md): 0 done; 1 a failure, or compare's runs failed; 2 bad usage
(an option, a value, a config file, a run directory that does not exist); after saving
the run, 130 for Ctrl-C (SIGINT) and 143 for SIGTERM, as a shell reports a command killed
by that signal (128 + its number).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import click

from .config import (CompareConfig, DDPConfig, HogwildConfig, JobConfig, PlotConfig,
                     RayJobConfig, ServerConfig, SimulateConfig, SingleConfig, WorkerConfig,
                     click_options)
from .config.command import SettingsCommand, given_settings
from .errors import AsyncSGDError, ConfigError
from .run.lifetime import exit_now, start_command_clock
from .run.signals import defer_sigint, interrupted_exit_code, restore_sigint, sigint_now
from .version import __version__


# The module of Hogwild's workers (modes.hogwild._worker), for the fork server to preload.
HOGWILD_WORKERS = "asyncsgd.modes.hogwild"
COMMAND = "command"  # click's obj key: run as the installed command (main), not in-process


def _verbose(ctx: click.Context, param: click.Parameter, count: int) -> None:
    """-v/--verbose counts wherever it is given, before the command's name or after it:
    ``asyncsgd -v single -v`` is -vv."""
    total = ctx.meta.get("asyncsgd.verbose", 0) + count
    ctx.meta["asyncsgd.verbose"] = total
    level = logging.DEBUG if total > 1 else logging.INFO if total else logging.WARNING
    logging.basicConfig(format="%(name)s: %(message)s", stream=sys.stderr)  # once
    logging.getLogger().setLevel(level)


def _add_verbose(params: list) -> None:
    params.append(click.Option(["-v", "--verbose"], count=True, expose_value=False,
                               callback=_verbose,
                               help="More log output (-v info, -vv debug)."))


class _Command(SettingsCommand):
    """A command that takes -v/--verbose after its name too (and, made of settings, --config
    and --print-config)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _add_verbose(self.params)

    def effective(self, ctx: click.Context):
        """--print-config's settings: with --resume, over the saved run's as the run takes
        them (ps-job and ray-job take the server's saved settings as they start it)."""
        from .run.settings import MODES, configure
        if self.settings_class.mode in {cls.mode for cls, _, _ in MODES.values()}:
            return configure(self.settings_class, None, given_settings(ctx))
        return super().effective(ctx)


class _Group(click.Group):
    """A group that takes -v/--verbose, as do its commands and subgroups."""

    command_class = _Command
    group_class = type  # subgroups are _Groups

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _add_verbose(self.params)


def _import_torch(ctx: click.Context) -> None:
    """As the installed command, import torch first, the garbage collector paused, then
    freeze what it made (``run.lifetime.import_torch``); in this process, a test's or a
    caller's, the imports that need it import it as usual."""
    if (ctx.obj or {}).get(COMMAND):
        from .run.lifetime import import_torch
        import_torch()


def _report(summary: dict) -> None:
    from .core.scoring import Metric
    metric = Metric.described(summary.get("metric"))
    final, best = summary.get("final_metric"), summary.get("best_metric")
    # train_seconds counts from the command's start (run.lifetime), so the rate once every
    # process trains is the one that says how fast training went
    rate = summary.get("steady_samples_per_second") or summary.get("samples_per_second") or 0
    startup = summary.get("startup_seconds")
    if final is not None:
        click.echo(f"final test {metric.name}: {metric.format(final, True)} (best "
                   f"{metric.format(best, True)}) after {summary['train_seconds']:.1f} s"
                   + (f" ({startup:.1f} s of it starting)" if startup is not None else "")
                   + f", {rate:,.0f} samples/s while training")
    if summary.get("target") is not None:
        ttt = summary.get("time_to_target")
        click.echo(f"time to {metric.name} {metric.format(summary['target'])}: "
                   + (f"{ttt:.1f} s" if ttt is not None else "not reached"))
    if summary.get("bytes") is not None:
        to_target = summary.get("bytes_to_target")
        click.echo(f"on the network: {summary['bytes'] / 1e6:,.1f} MB"
                   + (f" ({to_target / 1e6:,.1f} MB to the target)" if to_target is not None
                      else "")
                   + (f"; {summary['shared_bytes'] / 1e6:,.1f} MB more through shared memory "
                      "on this host" if summary.get("shared_bytes") else ""))
    click.echo(f"stopped by: {summary['stopped_by']}")
    click.echo(f"run directory: {summary['run_dir']}")


@click.group(cls=_Group,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="asyncsgd")
def cli() -> None:
    """Asynchronous SGD on PyTorch: Hogwild!, a parameter server, and honest comparisons.

    Every training command writes a run directory (config.json, metrics.jsonl,
    summary.json, checkpoint.pt) and prints the final test metric. From Python:
    asyncsgd.hogwild(...), asyncsgd.ps.serve(...), asyncsgd.load_run(DIR) (see
    docs/python-api.md).
    """


@cli.command()
def tasks() -> None:
    """List the built-in tasks with their default learning rate and batch size."""
    from .core.tasks import BUILTIN_TASKS, task_options
    sigint_now()
    for name, factory in BUILTIN_TASKS.items():
        click.echo(f"{name:14s} {(factory.__doc__ or '').strip().splitlines()[0]}")
        options = task_options(factory)
        if options:
            click.echo(f"{'':14s} options: {', '.join(f'{k}={v}' for k, v in options.items())}"
                       f"  (e.g. --task {name}:{next(iter(options))}=...)")
    click.echo("\nyour own: --task package.module:function returning an asyncsgd.Task "
               "(see docs/tasks.md)")


@cli.command(epilog="Examples:\n\n\b\n  asyncsgd hogwild --task mnist1d-cnn --procs 8\n"
             "  asyncsgd hogwild --task sparse-logreg --procs 2 --lock\n"
             "  asyncsgd hogwild --resume runs/20260101-120000-hogwild --epochs 40")
@click_options(HogwildConfig)
@click.pass_context
def hogwild(ctx: click.Context, **_: object) -> None:
    """Hogwild!: processes share one model in memory and update it without locks.

    Each process trains on its own disjoint partition of the data with its own
    optimizer; the parent evaluates the shared model every --eval-every seconds
    without pausing them. --lock gives the locked baseline.
    """
    # The installed command starts the fork server before api imports torch, so that both
    # import it at once (in this process, a test's, the server would outlive the command)
    early = (ctx.obj or {}).get(COMMAND) and \
        ctx.params["start_method"] == "forkserver"  # (--resume may switch it: then unused)
    if early:
        from .run.fork_server import start_early
        start_early([HOGWILD_WORKERS])
    try:
        _import_torch(ctx)
        from . import api
        sigint_now()
        result = api.hogwild(**given_settings(ctx))
    finally:
        if early:  # its workers' group stopped it; not when the run failed before them
            from .run.fork_server import stop_fork_server
            stop_fork_server()
    _finish(ctx, "hogwild", result)


@cli.command("ps-server", epilog="Examples:\n\n\b\n"
             "  asyncsgd ps-server --task mnist1d-cnn   # workers on this host only\n"
             "  asyncsgd ps-server --task mnist1d-cnn --bind tcp://0.0.0.0:5555   # any host\n"
             "  asyncsgd ps-server --consistency ssp:2 --workers 4 --optimizer adam --lr 0.01\n"
             "  asyncsgd ps-server --consistency sync --workers 2")
@click_options(ServerConfig)
@click.pass_context
def ps_server(ctx: click.Context, **_: object) -> None:
    """Parameter server: shards own slices of the parameters and apply workers' pushes.

    Workers connect to --bind; the handshake checks their model and tells them
    where the shards listen. Training ends when every worker has left (or on
    --max-seconds, --target, Ctrl-C); the run directory has the same
    format as every mode's, with updates/s and staleness added.
    """
    from . import ps
    sigint_now()
    _finish(ctx, "ps-server", ps.serve(**given_settings(ctx)))


@cli.command(epilog="Examples:\n\n\b\n"
             "  asyncsgd worker --server tcp://10.0.0.1:5555 --rank 0 --world 2\n"
             "  RANK=1 WORLD_SIZE=2 asyncsgd worker --server tcp://10.0.0.1:5555")
@click_options(WorkerConfig)
@click.pass_context
def worker(ctx: click.Context, **_: object) -> None:
    """A parameter-server worker: pull, compute gradients on its partition, push.

    Its partition of the training data follows from --rank and --world (or the
    RANK/WORLD_SIZE that torchrun sets, or SLURM_PROCID/SLURM_NTASKS).
    """
    _import_torch(ctx)
    from . import ps
    sigint_now()
    _worker_report(ps.work(**given_settings(ctx)))


def _worker_report(result) -> None:
    if result.stats.get("ended_by_server"):
        click.echo("the server ended training")
    click.echo(f"worker {result.worker}: {result.steps} steps, {result.pushes} pushes, "
               f"{result.samples:,} samples in {result.seconds:.1f} s "
               f"(retries {result.stats['retries']}, duplicate acks "
               f"{result.stats['duplicate_acks']}; {result.stats['bytes_sent']:,} bytes sent, "
               f"{result.stats['bytes_received']:,} received)")
    if "rows_pulled" in result.stats and result.steps:  # embedding tables served by row
        pulled, pushed = (result.stats[k] / result.steps for k in ("rows_pulled", "rows_pushed"))
        click.echo(f"worker {result.worker}: rows per step {pulled:.1f} pulled, {pushed:.1f} "
                   "pushed (the batches' unique ids, all tables)")
    if result.stats["waited_seconds"]:
        click.echo(f"worker {result.worker}: {result.stats['compute_seconds']:.1f} s computing "
                   f"gradients, {result.stats['waited_seconds']:.1f} s waited on purpose "
                   "(--slowdown, --delay)")
    clipping = result.stats.get("clipping")
    if clipping:
        click.echo(f"worker {result.worker}: --clip-grad-norm {clipping['max_norm']:g} clipped "
                   f"{clipping['clipped_steps']} of {clipping['steps']} steps' gradients")
    if result.stats.get("overflowed_steps"):
        click.echo(f"worker {result.worker}: --amp fp16 dropped {result.stats['overflowed_steps']} "
                   "steps whose gradients overflowed")


@cli.command("ps-job", epilog="Examples:\n\n\b\n"
             "  torchrun --nproc-per-node 4 -m asyncsgd ps-job --task mnist1d-cnn --target 0.85\n"
             "  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\\n"
             "      --rdzv-endpoint HEAD:29500 --max-restarts 2 -m asyncsgd ps-job --shards 2\n"
             "  sbatch examples/slurm/ps-job.sbatch      # the same on Slurm")
@click_options(JobConfig)
@click.pass_context
def ps_job(ctx: click.Context, **_: object) -> None:
    """A whole parameter-server job under torchrun: rank 0 serves, the rest are workers.

    Every process of the job runs this same command; torchrun's RANK and WORLD_SIZE
    say which role it takes, and the server's address reaches the workers through
    torchrun's rendezvous store. With torchrun --max-restarts, a failed process
    restarts the job's processes: the server resumes its run directory, workers
    rejoin. Options are those of ps-server and worker (not CURVE: the store is
    unauthenticated); --device is the workers'.
    """
    from . import ps
    from .run.recorder import RunResult
    sigint_now()
    result = ps.job(**given_settings(ctx))
    if isinstance(result, RunResult):  # the server's rank: it reports the run
        _finish(ctx, "ps-job", result, how="torchrun starts it again while it has "
                "--max-restarts left; otherwise ")
    else:
        _worker_report(result)


@cli.command("ray-job", epilog="Examples:\n\n\b\n"
             "  asyncsgd ray-job --task mnist1d-cnn --workers 2 --target 0.85 --epochs 1000\n"
             "  asyncsgd ray-job --address HEAD:6379 --workers 8 --cpus-per-worker 2 --shards 2\n"
             "  ray job submit -- asyncsgd ray-job --workers 4     # RAY_ADDRESS set by Ray")
@click_options(RayJobConfig)
@click.pass_context
def ray_job(ctx: click.Context, **_: object) -> None:
    """A whole parameter-server job on Ray: a server actor and --workers worker actors.

    Starts a Ray of its own on this host (stopped after the job), or joins --address
    (or $RAY_ADDRESS). The server's actor runs on this node and writes the run
    directory here; Ray places the workers. A worker whose process dies is restarted
    by Ray (--max-restarts) and rejoins; pushes still apply exactly once. Ctrl-C
    stops every actor, and the server saves its run (continue with --resume). Needs
    the ray extra: pip install 'asyncsgd[ray]'.
    """
    from . import ray as ray_api
    sigint_now()
    result = ray_api.run(**given_settings(ctx))
    restarted = ", ".join(f"worker {rank} {n}x" for rank, n in result.restarts.items() if n)
    click.echo(f"{len(result.workers)} worker(s), {result.total_restarts} restarted by Ray"
               + (f" ({restarted})" if restarted else "")
               + f"; {result.summary.get('lost_updates', 0)} lost update(s)")
    _finish(ctx, "ray-job", result)


@cli.command("ps-stats", epilog="Examples:\n\n\b\n"
             "  asyncsgd ps-stats                                  # the server on this host\n"
             "  asyncsgd ps-stats --server tcp://10.0.0.5:5555\n"
             "  asyncsgd ps-stats --server tcp://10.0.0.5:5555 --json | jq .updates\n"
             "  asyncsgd ps-stats --curve-server-key keys/server.key "
             "--curve-secret keys/clients/worker-0.key_secret")
@click.option("--server", default="tcp://127.0.0.1:5555", show_default=True,
              metavar="tcp://HOST:PORT", help="The server's address (its --bind).")
@click.option("--timeout", default=5.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds to wait for the answer.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the whole reply as JSON (every counter, per shard), for scripts.")
@click.option("--curve-server-key", metavar="FILE", default=None,
              help="The server's public key, for a server with CURVE on.")
@click.option("--curve-secret", metavar="FILE", default=None,
              help="A secret key the server admits (a worker's).")
def ps_stats(server: str, timeout: float, as_json: bool, curve_server_key: Optional[str],
             curve_secret: Optional[str]) -> None:
    """Print a running server's counters: updates, live workers, staleness, refusals.

    A summary of a dozen lines by default; --json prints the whole reply.
    """
    import json

    from . import ps
    from .analysis.ps_stats import summary
    sigint_now()
    stats = ps.stats(server, timeout, curve_server_key, curve_secret)
    click.echo(json.dumps(stats, indent=2, sort_keys=True) if as_json else summary(stats, server))


@cli.command(epilog="Examples:\n\n\b\n"
             "  asyncsgd keygen keys --clients 4\n"
             "  asyncsgd keygen keys --name gpu-node-7     # add a worker key later\n"
             "  asyncsgd ps-server --curve-secret keys/server.key_secret "
             "--allowed-clients keys/allowed_clients\n"
             "  asyncsgd worker --curve-server-key keys/server.key "
             "--curve-secret keys/clients/worker-0.key_secret")
@click.argument("directory", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--clients", default=0, show_default=True, type=click.IntRange(min=0),
              help="Worker key pairs to write, named worker-0, worker-1, ...")
@click.option("--name", "names", multiple=True, metavar="NAME",
              help="A worker key pair with this name (repeatable).")
@click.option("--force", is_flag=True, help="Replace keys that exist (old keys stop working).")
def keygen(directory: str, clients: int, names: tuple, force: bool) -> None:
    """Write CURVE keys for an authenticated, encrypted parameter server.

    DIR gets the server's key pair (kept if it exists; --force replaces it) and
    one key pair per worker: the public halves go to DIR/allowed_clients (the
    server's --allowed-clients), the secret halves to DIR/clients (each
    worker's --curve-secret; keep them private, mode 600). Every worker also
    needs DIR/server.key (--curve-server-key). Keys are pyzmq zmq.auth
    certificates.
    """
    from .wire.security import keygen as write_keys
    sigint_now()
    wanted = [f"worker-{i}" for i in range(clients)] + list(names)
    if not wanted and not force and (Path(directory) / "server.key_secret").exists():
        raise ConfigError(f"{directory} has a server key already; add workers with --name "
                          "NAME or --clients N, or replace every key with --force")
    written = write_keys(directory, wanted, force=force)
    if written["server"]:
        click.echo(f"server secret key: {written['server']}  (ps-server --curve-secret)")
    click.echo(f"server public key: {Path(directory) / 'server.key'}  "
               "(worker --curve-server-key)")
    for path in written["clients"]:
        click.echo(f"worker secret key: {path}  (worker --curve-secret)")
    click.echo(f"allowed workers:   {Path(directory) / 'allowed_clients'}  "
               "(ps-server --allowed-clients)")


@cli.command(epilog="Examples:\n\n\b\n"
             "  asyncsgd single --task mnist1d-cnn --epochs 20\n"
             "  asyncsgd single --batch-size 64     # the update of ddp --procs 2 --batch-size 32\n"
             "  asyncsgd single --device cuda --amp bf16\n"
             "  asyncsgd single --resume runs/20260101-120000-single --epochs 40")
@click_options(SingleConfig)
@click.pass_context
def single(ctx: click.Context, **_: object) -> None:
    """Plain SGD in one process: the baseline every speed-up is measured against.

    Same task, data order, SGD and run directory as the parallel modes, with
    every core's threads (--threads) in one process.
    """
    from . import api
    sigint_now()
    _finish(ctx, "single", api.single(**given_settings(ctx)))


@cli.command(epilog="Examples:\n\n\b\n"
             "  asyncsgd ddp --procs 2 --task mnist1d-cnn\n"
             "  asyncsgd ddp --device cuda --amp bf16           # one process per GPU, nccl\n"
             "  torchrun --nproc-per-node 2 -m asyncsgd ddp --task mnist1d-cnn\n"
             "  asyncsgd ddp --resume runs/20260101-120000-ddp --epochs 40")
@click_options(DDPConfig)
@click.pass_context
def ddp(ctx: click.Context, **_: object) -> None:
    """Synchronous data-parallel SGD (DistributedDataParallel): the synchronous baseline.

    Spawns --procs ranks here (gloo on CPU, nccl with one GPU per rank), or runs
    as one rank under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), where
    rank 0 writes the run directory. Each rank trains on its own partition of the
    data; DDP averages the gradients, so N ranks with --batch-size B make the
    update of 'single --batch-size N*B'. Rank 0 evaluates every --eval-every
    seconds between steps, and all ranks stop together.
    """
    from . import api
    sigint_now()
    result = api.ddp(**given_settings(ctx))
    if result is not None:  # None: a rank other than 0 under torchrun; rank 0 reports
        _finish(ctx, "ddp", result)


def _finish(ctx: click.Context, command: str, result, how: str = "") -> None:
    _report(result.summary)
    if result.summary["status"] == "interrupted":
        click.echo(f"interrupted; {how}continue with: "
                   f"{'torchrun ... -m ' if command == 'ps-job' else ''}asyncsgd {command} "
                   f"--resume {result.run_dir}", err=True)
        ctx.exit(interrupted_exit_code())


def _tabled(result) -> None:
    """A comparison's table and report; exit status 1 when any of its runs failed."""
    click.echo(result.table)
    click.echo(f"report: {result.out / 'report.md'}")
    if result.failed:
        raise AsyncSGDError(f"{len(result.failed)} of {len(result.attempts)} run(s) failed: "
                            + "; ".join(f"{a.label} (repeat {a.repeat + 1}): {a.error}"
                                        for a in result.failed))


@cli.command(epilog="Examples:\n\n\b\n"
             "  asyncsgd compare --task mnist1d-cnn --procs 2 --budget 60 --target 0.9\n"
             "  asyncsgd compare --task lm --modes single,ps-async,ddp --budget 120\n"
             "  asyncsgd compare --modes hogwild,ps-async,ps-sync --repeats 3 --out runs/cmp\n"
             "  asyncsgd compare --modes ddp,ps-sync,ps-async --procs 2 --tune lr --target 0.85\n"
             "  asyncsgd compare --modes hogwild,ps-async --mode-args 'ps-async=--optimizer adam'\n"
             "  asyncsgd compare --tensorboard --out runs/cmp && tensorboard --logdir runs/cmp\n"
             "  asyncsgd compare --link 100mbit --modes ps-async,ddp --procs 2   # as root\n"
             "  asyncsgd compare --clock virtual --procs 64 --modes ps-async,ps-sync,ddp")
@click_options(CompareConfig)
@click.pass_context
def compare(ctx: click.Context, **_: object) -> None:
    """Run every mode on the same task, data, seeds and time budget, and report.

    Runs go one after another (never overlapping) as subprocesses of this
    command: single and hogwild and ddp as one command each, ps-* as a
    parameter server and --procs workers on 127.0.0.1. With --link RATE the
    server and each worker, and each ddp rank (one 'asyncsgd ddp' per rank, as
    torchrun starts them), run on hosts of their own: network namespaces whose
    links to one switch are limited to RATE each way. A failed run is
    recorded with its error and the comparison goes on. OUT gets report.md
    (table and plots), results.json, PNGs, and every run's directory and logs.
    Exits 1 when any run failed.

    Every time (start-up, time to --target, the plots' time axes) is counted
    from the launch of the run's first process: starting Python and torch and
    loading the task are part of it. With --tensorboard each run writes its
    TensorBoard events into its own directory: tensorboard --logdir OUT shows
    them all. With --clock virtual the comparison runs in this process on the
    simulator's virtual clock instead ('asyncsgd simulate').
    """
    from . import api
    sigint_now()
    result = api.compare(**given_settings(ctx))
    _tabled(result)


@cli.command(epilog="Examples:\n\n\b\n"
             "  asyncsgd simulate --task mnist1d-cnn --modes ps-async,ps-sync,ps-backup:4,ddp "
             "--workers 64 --step-time lognormal:2ms:0.5 --target 0.85\n"
             "  asyncsgd simulate --modes ddp,diloco:8,ps-async --workers 16 --step-time 120ms "
             "--gradient-bytes 100MB --link 25gbit --latency 20us --target 0.85\n"
             "  asyncsgd simulate --modes ps-async,ps-sync --slow-workers 0.25:4 --repeats 3\n"
             "  asyncsgd simulate --modes ps-sync,ps-backup:2 --leave 5:3 --join 10 "
             "--target 0.85\n"
             "  asyncsgd compare --clock virtual --procs 64 --modes ps-async,ddp --target 0.85")
@click_options(SimulateConfig)
@click.pass_context
def simulate(ctx: click.Context, **_: object) -> None:
    """Run compare's modes on a virtual clock: real learning, simulated time.

    Every mode runs in this process under a discrete-event scheduler: each
    simulated worker's gradient is computed for real from the parameters it
    pulled, and the real update rules and consistency apply them in the order
    the events decide. Time is simulated: a step takes --step-time, a transfer
    --latency + bytes / --link, the server applies at a cost per byte measured
    here. What is not given is the task's profile, measured on this machine as
    the command starts. No process is started and no socket opened.

    OUT gets the same report as compare (report.md, results.json, PNGs) and
    every run's directory, in the run-directory format with t in virtual
    seconds and clock: virtual; 'asyncsgd plot' reads them. Exits 1 when any
    run failed. See docs/simulate.md.
    """
    from . import api
    sigint_now()
    result = api.simulate(**given_settings(ctx))
    _tabled(result)


@cli.command(epilog="Examples:\n\n\b\n"
             "  asyncsgd plot runs/20261122-101500-hogwild runs/20261122-103000-ps\n"
             "  asyncsgd plot runs/20261122-110000-compare --out figures --target 0.9")
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click_options(PlotConfig)
def plot(run_dirs: tuple, **params: object) -> None:
    """Plot and tabulate any run directories (of any mode, or of a compare).

    Writes the compare plots (the task's test metric and training loss vs time, loss vs
    samples, throughput, the metric vs megabytes sent where runs counted them) and
    report.md into --out, and prints the table. Each run is
    given once; runs of different tasks are refused unless --allow-mixed; settings that
    differ between runs of one task (batch size, learning rate, budget) are warned about;
    a run that failed (at start, too) is counted and named as failed.
    """
    from . import api
    sigint_now()
    cfg = PlotConfig(**params)
    out = Path(cfg.out)
    result = api.plot(*run_dirs, config=cfg)
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    for a in result.failed:
        click.echo(f"warning: {a.run_dir or a.label} is not counted as a result ({a.status}): "
                   f"{a.error or 'no error recorded'}", err=True)
    click.echo(result.text)
    click.echo(f"report: {out / 'report.md'}")


@cli.group(epilog="Examples (as root):\n\n\b\n"
           "  asyncsgd hosts up server w0 w1 --link 100mbit\n"
           "  ip netns exec asgd-server asyncsgd ps-server --bind tcp://10.213.50.1:5555 "
           "--workers 2\n"
           "  ip netns exec asgd-w0 asyncsgd worker --server tcp://10.213.50.1:5555 "
           "--rank 0 --world 2\n"
           "  ip netns exec asgd-w1 asyncsgd worker --server tcp://10.213.50.1:5555 "
           "--rank 1 --world 2\n"
           "  asyncsgd hosts list\n"
           "  asyncsgd hosts down")
def hosts() -> None:
    """Hosts on one machine for runs started by hand: network namespaces on one switch.

    'up' makes one network namespace (asgd-NAME) per NAME, each with an eth0 at
    10.213.50.N on a switch, its link shaped to --link each way (tbf, as compare
    --link does), and prints the 'ip netns exec' commands that run a parameter
    server, its workers or DDP ranks in them. They stand until 'down'. Needs root.
    """


@hosts.command("up")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--link", metavar="RATE", default=None, show_default="none: unshaped",
              help="Each host's link rate, each way: e.g. 100mbit, 1gbit, 500kbit.")
def hosts_up(names: tuple, link: Optional[str]) -> None:
    """Make a host (network namespace asgd-NAME) per NAME and print how to use them."""
    from .run.standing_hosts import guide, up
    sigint_now()
    click.echo("\n".join(guide(up(list(names), link))))


@hosts.command("down")
def hosts_down() -> None:
    """Kill whatever runs in the hosts 'up' made and delete them."""
    from .run.standing_hosts import down
    sigint_now()
    gone = down()
    click.echo(f"deleted {', '.join(gone)}" if gone else "no hosts were up")


@hosts.command("list")
def hosts_list() -> None:
    """The hosts 'up' made: name, address, link rate, namespace."""
    from .run.standing_hosts import listing
    sigint_now()
    click.echo("\n".join(listing()) or "no hosts are up (make some with 'asyncsgd hosts up')")


def main(argv: Optional[list] = None) -> None:
    """Console entry point: one clear line for every error a user can fix. It ends the
    process once the command is done (``run.lifetime.exit_now`` says why): from Python,
    call what the commands call (``asyncsgd.hogwild``, ``asyncsgd.ps.serve``...: the
    ``asyncsgd.api`` and ``asyncsgd.ps`` modules), not this."""
    start_command_clock()  # --max-seconds counts the start-up a user waits for
    defer_sigint()  # until a command's imports are done (run.signals says why)
    try:
        code = _run(argv, command=True)
    finally:
        restore_sigint()
    exit_now(code)


def _run(argv: Optional[list], command: bool = False) -> int:
    """The command's exit status. ``command``: this process is the installed command's, and
    ends with it (``main``)."""
    try:
        code = cli.main(args=argv, prog_name="asyncsgd", standalone_mode=False,
                        obj={COMMAND: command})
        return code if isinstance(code, int) else 0  # click returns ctx.exit(code) here
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort as exc:
        if isinstance(exc.__cause__, EOFError):  # click's name for an EOFError: a fault, not ^C
            raise exc.__cause__ from None
        click.echo("interrupted", err=True)
        return interrupted_exit_code()
    except click.ClickException as exc:
        hint = ""
        if isinstance(exc, click.UsageError) and exc.ctx is not None:
            hint = f" (see '{exc.ctx.command_path} --help')"
        click.echo(f"error: {exc.format_message()}{hint}", err=True)
        return exc.exit_code
    except AsyncSGDError as exc:
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        return interrupted_exit_code()
