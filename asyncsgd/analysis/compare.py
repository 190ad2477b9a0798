"""``asyncsgd compare``: every mode on the same task, seeds and budget, one after another.

    asyncsgd compare --task mnist1d-cnn --procs 2 --budget 60 --target 0.9
    asyncsgd compare --task lm --modes single,ps-async,ddp --budget 120   # its perplexity target
    asyncsgd compare --modes hogwild,ps-async,ps-sync --repeats 3 --out runs/cmp
    asyncsgd compare --link 100mbit --modes ps-async,ddp      # hosts on shaped links (root)

Each run is the installed CLI in subprocesses (``asyncsgd hogwild ...``;
``asyncsgd ps-server`` and N ``asyncsgd worker`` for the ps-* modes), so modes
are isolated and a failing one is recorded and skipped (``--link``: each of a
ps-* or ddp run's processes on a host of its own, ``analysis.linked``). Runs never overlap:
they would steal each other's cores. Every run gets the same task and data,
the same seed (repeat r: seed + r, hence the same model initialisation and
data order), the same batch size per process, plain SGD with the same
learning rate, and the same budget of seconds (``--max-seconds``), counted from
each command's start: what a mode spends starting (importing torch, spawning
processes, joining a group) is time its user waits too. Every time a run records
counts from there (``run.recorder.clock_origin``: its first process's start, which
compare launched; the parameter server's, started before its workers), so the
report's start-up and times to target include it.
"The same batch per process" holds for single too: it steps on B samples like
each Hogwild process or PS worker, so every mode computes gradients of the
same size and only how they are combined differs. DDP with N ranks averages
N of them into one update (``single --batch-size N*B`` would make the same
update); Hogwild and the PS apply each one on its own. single also gets the
torch threads of one parallel process (cores // procs): it is one of the N
processes alone, so a speed-up over it is what the other N - 1 buy. (More
intra-op threads do not help a model this small, and on a busy machine they
collapse: single with 2 threads on 2 shared cores ran 250-2,700 samples/s
against 10,000-17,000 with 1. ``--mode-args 'single=--threads N'`` overrides.)
A run still going ``--grace`` seconds past its budget is stopped and marked
failed. The result is one directory:

    OUT/report.md           the table, failed runs with their errors, the plots
    OUT/results.json        the same numbers unrounded, and every run's status
    OUT/*.png               the task's metric and loss vs time, loss vs samples, throughput
    OUT/<mode>-r<k>/        each run's own run directory (--tensorboard: its
                            tensorboard/ too; tensorboard --logdir OUT shows them all)
    OUT/logs/<mode>-r<k>/   each process's stdout and stderr
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from ..config import CompareConfig, parse_compress
from ..core.pacing import Pacing
from ..errors import AsyncSGDError, ConfigError
from ..run.process_group import available_cores
from ..run.progress import Progress, fmt_time
from ..run.hosts import Hosts
from ..run.link import Link
from ..run.rundir import RunDir, environment
from ..run.signals import sigterm_as_interrupt
from . import linked
from .cli_launcher import Child, free_port, stop_all
from .publish import publish
from .report import Attempt, Goal, Run

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
SHOW_SECONDS = 1.0
PORT_ATTEMPTS = 3
LINGER_SECONDS = 15.0
NO_EPOCH_LIMIT = 1_000_000  # the budget ends the run
SSP_DEFAULT = 2


@dataclass(frozen=True)
class ModeSpec:
    """A mode as --modes names it, and the command that runs it."""

    name: str
    command: str  # single | hogwild | ddp | ps-server
    consistency: Optional[str] = None
    backup_workers: int = 0  # ps-backup:B: sync rounds that do not wait for B workers
    optimizer: str = "sgd"  # the shards' rule: nesterov / delayed-nesterov for Local SGD
    flags: tuple = ()  # of its command (ps-server's, or single/hogwild/ddp's)
    worker_flags: tuple = ()  # of each parameter-server worker

    @property
    def slug(self) -> str:
        return self.name.replace(":", "-")


# DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov, lr 0.7, momentum 0.9
OUTER = ("--lr", "0.7", "--momentum", "0.9")
LOCAL_STEPS_DEFAULT = 8
# What a parameter-server mode's +SUFFIX adds to its workers (topk:RATIO too)
WIRE_FLAGS = {"bf16": ("--push-dtype", "bf16", "--pull-dtype", "bf16"),
              "fp16": ("--push-dtype", "fp16", "--pull-dtype", "fp16"),
              "int8": ("--compress", "int8")}


def parse_modes(text: str) -> list:
    """``single,hogwild,ps-async,ps-ssp,ps-ssp:4,ps-sync,ps-backup:1,ddp,diloco:8,...``
    -> [ModeSpec]."""
    specs, seen = [], set()
    for name in (m.strip() for m in text.split(",")):
        if not name:
            continue
        spec = _mode(name)
        if spec is None:
            raise ConfigError(f"--modes: unknown mode {name!r}; choose from single, hogwild, "
                              "ps-async, ps-ssp (or ps-ssp:K), ps-sync, ps-backup (or "
                              "ps-backup:B), ddp, diloco (or diloco:H), async-diloco (or "
                              "async-diloco:H), ddp+fp16, ddp+bf16, ddp+powersgd (or "
                              "ddp+powersgd:RANK), ddp-local (or ddp-local:H); a "
                              "parameter-server mode +bf16, +fp16, +int8 or +topk:RATIO "
                              "(ps-async+int8)")
        if name in seen:
            raise ConfigError(f"--modes: {name} is listed twice; use --repeats to run it again")
        seen.add(name)
        specs.append(spec)
    if not specs:
        raise ConfigError("--modes is empty; name at least one mode, e.g. --modes hogwild")
    return specs


def _mode(name: str) -> Optional[ModeSpec]:
    """The mode ``name`` means, or None."""
    def number(pattern: str, default: int) -> Optional[int]:
        found = re.fullmatch(pattern + r"(?::(\d+))?", name)
        return None if found is None else int(found.group(1) or default)

    if "+" in name and not name.startswith("ddp"):  # a PS mode, compressed: ps-async+int8
        base, _, wire = name.partition("+")
        spec, flags = _mode(base), WIRE_FLAGS.get(wire)
        if flags is None and wire.startswith("topk:"):
            try:
                flags = ("--compress", wire) if parse_compress(wire) else None
            except ConfigError:
                flags = None
        if spec is None or spec.command != "ps-server" or flags is None:
            return None
        return dataclasses.replace(spec, name=name, worker_flags=spec.worker_flags + flags)
    if name in ("single", "hogwild", "ddp"):
        return ModeSpec(name, name)
    if name in ("ps-async", "ps-sync"):
        return ModeSpec(name, "ps-server", name[3:])
    if number("ps-ssp", SSP_DEFAULT) is not None:
        return ModeSpec(name, "ps-server", f"ssp:{number('ps-ssp', SSP_DEFAULT)}")
    if number("ps-backup", 1):
        return ModeSpec(name, "ps-server", "sync", number("ps-backup", 1))
    if name in ("ddp+fp16", "ddp+bf16") or number("ddp\\+powersgd", 1):
        return ModeSpec(name, "ddp", flags=("--comm-hook", name[4:]))
    if number("ddp-local", LOCAL_STEPS_DEFAULT):
        return ModeSpec(name, "ddp", flags=(
            "--local-steps", str(number("ddp-local", LOCAL_STEPS_DEFAULT))))
    for prefix, consistency, rule in (("diloco", "sync", "nesterov"),
                                      ("async-diloco", "async", "delayed-nesterov")):
        steps = number(prefix, LOCAL_STEPS_DEFAULT)
        if steps:
            return ModeSpec(name, "ps-server", consistency, optimizer=rule, flags=OUTER,
                            worker_flags=("--local-steps", str(steps)))
    return None


def parse_mode_args(items: tuple, specs: list) -> dict:
    """``('hogwild=--lock', 'worker=--push-every 4')`` -> {name: [flags]}."""
    known = {s.name for s in specs} | {"worker"}
    extra: dict = {}
    for item in items:
        name, sep, flags = item.partition("=")
        name = name.strip()
        if not sep or name not in known:
            raise ConfigError(f"--mode-args {item!r}: use MODE=FLAGS with MODE one of "
                              f"{', '.join(sorted(known))}, e.g. 'hogwild=--lock'")
        try:
            extra.setdefault(name, []).extend(shlex.split(flags))
        except ValueError as exc:
            raise ConfigError(f"--mode-args {item!r}: {exc}") from exc
    return extra


def _present(flags: dict) -> list:
    """``{'--lr': None, '--seed': 3}`` -> ['--seed', '3']: only the flags that are set."""
    return [str(part) for name, value in flags.items() if value is not None
            for part in (name, value)]


class ModeRun:
    """One run of one mode: starts its processes, watches them, returns an Attempt."""

    def __init__(self, cfg: CompareConfig, spec: ModeSpec, repeat: int, out: Path,
                 extra: dict, shown: Optional["CompareProgress"], goal: Optional[Goal] = None):
        """``goal``: the task's metric and target (None: no target to stop at)."""
        self.cfg, self.spec, self.repeat, self.extra, self.shown = cfg, spec, repeat, extra, shown
        self.goal = goal
        self.seed = cfg.seed + repeat
        self.procs = cfg.procs or available_cores()
        self.threads = max(1, available_cores() // self.procs)
        self.run_dir = out / f"{spec.slug}-r{repeat + 1}"
        self.logs = out / "logs" / f"{spec.slug}-r{repeat + 1}"
        self.children: list = []
        # --link: this run's hosts (ps-* and ddp), and what crossed their links
        self.link = Link.parse(cfg.link) if spec.command in linked.SHAPED_COMMANDS else None
        self.hosts: Optional[Hosts] = None
        self.traffic: Optional[dict] = None
        self.started = time.monotonic()
        self.deadline = self.started + cfg.budget + cfg.grace
        # when its first process was launched (monotonic, Unix time): the origin of the
        # run's clock, as that process's start is (run.recorder.clock_origin)
        self.launched: Optional[float] = None
        self.launched_wall: Optional[float] = None
        self.attempt = Attempt(spec.name, repeat, self.seed, run_dir=str(self.run_dir),
                               logs=str(self.logs))

    # -- command lines -------------------------------------------------------------------
    def _data_flags(self) -> list:
        c = self.cfg
        return _present({"--task": c.task, "--samples": c.samples, "--data-dir": c.data_dir,
                         "--cache-dir": c.cache_dir})

    def _run_flags(self) -> list:
        """What every run-directory-writing command takes (RunConfig)."""
        c = self.cfg
        return self._data_flags() + _present({
            "--seed": self.seed, "--max-seconds": c.budget, "--eval-every": c.eval_every,
            "--target": self.goal.target if c.stop_at_target and self.goal else None,
            "--out": self.run_dir, "--progress": "off", "--checkpoint-every": 0}) + (
                ["--tensorboard"] if c.tensorboard else [])

    def _train_flags(self, world: int) -> list:
        """What every training process takes; ``world``: its mode's processes (stragglers
        are named by rank: single, one process, is rank 0)."""
        c = self.cfg
        return _present({"--epochs": c.epochs or NO_EPOCH_LIMIT, "--batch-size": c.batch_size}
                        ) + Pacing.parse(c.slowdown, c.delay).flags(world)

    def command(self) -> list:
        """Flags of the mode's (first) command."""
        spec, c = self.spec, self.cfg
        if spec.command == "ps-server":
            flags = self._run_flags() + _present({
                "--workers": self.procs, "--shards": c.shards, "--consistency": spec.consistency,
                "--backup-workers": spec.backup_workers or None, "--optimizer": spec.optimizer,
                "--lr": c.lr if spec.optimizer == "sgd" else None})
        else:
            world = 1 if spec.command == "single" else self.procs
            flags = self._run_flags() + self._train_flags(world) + _present({"--lr": c.lr})
            flags += ["--threads", str(self.threads)]
            if spec.command != "single":
                flags += ["--procs", str(self.procs)]
                if spec.command == "ddp":  # across namespaces, only gloo crosses the link
                    flags += ["--backend", "gloo" if self.link else c.ddp_backend]
        return flags + list(spec.flags) + self.extra.get(spec.name, [])

    def worker_command(self, server: str, rank: int) -> list:
        """No --max-seconds: the server's budget ends the run and it tells the workers
        (their own clocks would end them at other moments)."""
        # with --local-steps, --lr is the workers' inner lr (the server's is DiLoCo's)
        local_lr = self.cfg.lr if self.spec.worker_flags else None
        return self._data_flags() + self._train_flags(self.procs) + _present({
            "--server": server, "--rank": rank, "--world": self.procs, "--seed": self.seed,
            "--threads": self.threads, "--progress": "off", "--local-lr": local_lr,
        }) + list(self.spec.worker_flags) + self.extra.get("worker", [])

    # -- running -------------------------------------------------------------------------
    def run(self) -> Attempt:
        """Run it to the end; ``self.attempt`` holds the outcome even if interrupted."""
        attempt, error = self.attempt, None
        try:
            if self.link is not None:
                self.hosts = linked.hosts_for(self.spec.command, self.procs, self.link)
            error = (self._run_ps() if self.spec.command == "ps-server" else
                     self._run_ranks() if self.hosts is not None else self._run_one())
        except (OSError, linked.HostsError) as exc:  # this run fails, not the comparison
            error = f"could not run {self.spec.command}: {exc}"
        except KeyboardInterrupt:
            attempt.status, attempt.error = "interrupted", "interrupted by the user"
            raise
        finally:
            stop_all(self.children)
            if self.hosts is not None:
                self.traffic = linked.finish(self.hosts)
            attempt.seconds = time.monotonic() - self.started
            if attempt.status == "ok":
                attempt.status, attempt.error = ("failed", error) if error else ("ok", None)
            if (self.run_dir / "config.json").is_file():
                try:
                    attempt.run = Run.read(self.run_dir)
                except AsyncSGDError as exc:
                    attempt.status, attempt.error = "failed", str(exc)
            elif attempt.status == "ok":
                attempt.status, attempt.error = "failed", "it wrote no run directory"
            self.shown.finished(attempt)
        return attempt

    def _start(self, command: str, flags: list, name: str, host: Optional[str] = None,
               env: Optional[dict] = None) -> Child:
        """``host``: where it runs with --link (a network namespace), else here."""
        where = self.hosts.command(host) if self.hosts is not None and host else []
        if not self.children:  # its first process (again, when a retry starts it anew)
            self.launched, self.launched_wall = time.monotonic(), time.time()
        child = Child.start(command, flags, self.logs, name=name, env=env, where=where)
        self.children.append(child)
        return child

    def _run_one(self) -> Optional[str]:
        self.shown.starting(self, f"{self.spec.command} with {self._processes()}")
        self._start(self.spec.command, self.command(), self.spec.slug)
        return self._watch()

    def _run_ranks(self) -> Optional[str]:
        """ddp with --link: one ``asyncsgd ddp`` per rank, each on its own host, started
        as torchrun starts them (rank 0 hosts the rendezvous and writes the run)."""
        self.shown.starting(self, f"ddp with {self._processes()}, one per host on "
                                  f"{self.link.text} links")
        port = free_port()  # any: nothing else listens in rank 0's fresh namespace
        for rank in range(self.procs):
            self._start("ddp", self.command(), f"rank-{rank}", host=f"rank{rank}",
                        env=linked.rank_env(self.hosts, rank, self.procs, port))
        return self._watch()

    def _processes(self) -> str:
        if self.spec.command == "single":
            return f"1 process x {self.threads} thread(s)"
        return f"{self.procs} processes x {self.threads} thread(s)"

    def _run_ps(self) -> Optional[str]:
        self.shown.starting(self, f"ps-server --consistency {self.spec.consistency} "
                                  f"--shards {self.cfg.shards} + {self.procs} workers x "
                                  f"{self.threads} thread(s)" + (
                                      f", each on its own host on {self.link.text} links"
                                      if self.hosts is not None else ""))
        for attempt in range(PORT_ATTEMPTS):
            host = self.hosts.address("server") if self.hosts is not None else "127.0.0.1"
            address = f"tcp://{host}:{free_port()}"
            # Workers start beside the server, not after it: each spends seconds importing
            # torch and loading the task, time the server's clock would otherwise count.
            # Their hello waits in the socket until the server listens and serves.
            server = self._start("ps-server", ["--bind", address] + self.command(), "server",
                                 host="server")
            for rank in range(self.procs):
                self._start("worker", self.worker_command(address, rank), f"worker-{rank}",
                            host=f"worker{rank}")
            error = self._watch(server)
            if not (error and server.failed() and "cannot listen on --bind" in error
                    and attempt + 1 < PORT_ATTEMPTS):
                return error
            log.info("port of %s was taken meanwhile; retrying with another", address)
            stop_all(self.children)
            self.children.clear()
            shutil.rmtree(self.run_dir, ignore_errors=True)  # ours, from the failed start
        return error

    def _overrun(self) -> str:
        return (f"still running {self.cfg.budget + self.cfg.grace:g} s after it started "
                f"(--budget {self.cfg.budget:g} + --grace {self.cfg.grace:g}); stopped")

    def _watch(self, main: Optional[Child] = None) -> Optional[str]:
        """Wait for every process: None when all ended cleanly, else the first error.

        Once ``main`` (the server) has ended, the others get ``LINGER_SECONDS`` to
        follow: a worker that never reached it would otherwise retry for a minute. When
        the server ended cleanly (its run met its stop condition and is saved), a worker
        still running then is stopped and the run stands: on a 50 Mbit link a sync
        worker whose round was cut short by the server's stop kept retrying the server
        it had lost, and the run was once marked failed for it.
        """
        main_ended: Optional[float] = None
        while True:
            self.shown.tick(self)
            failed = [c for c in self.children if c.failed()]
            if failed:
                return failed[0].error()
            running = [c for c in self.children if c.returncode is None]
            if not running:
                return None
            now = time.monotonic()
            if main is not None and main.returncode is not None:
                main_ended = main_ended or now
                if now - main_ended > LINGER_SECONDS:
                    late = (f"{running[0].name} was still running {LINGER_SECONDS:g} s after "
                            f"the {main.name} ended; stopped. Its last words: "
                            f"{running[0].last_line() or '(none)'}")
                    self.shown.say(f"note: {late}")
                    stop_all(running)
                    return None
            if now > self.deadline:
                return self._overrun()
            time.sleep(POLL_SECONDS)


class CompareProgress:
    """Which run is on, how long it has run since its launch, its ETA and the
    comparison's, and its latest evaluation (``run.progress``: a bar or log lines)."""

    def __init__(self, total: int, style: str, stream: TextIO, goal: "Goal",
                 train_samples: Optional[int] = None):
        """``train_samples``: the task's, for the samples budget of ``--epochs``."""
        if style == "auto":
            style = "bar" if getattr(stream, "isatty", lambda: False)() else "log"
        self.total, self.style, self.stream, self.goal = total, style, stream, goal
        self.train_samples = train_samples
        self.index = 0
        self._bar: Optional[Progress] = None
        self._next_show = 0.0
        self._budget = 0.0  # of the run on
        self._overheads: list = []  # seconds each finished run took beyond its budget

    def say(self, text: str) -> None:
        if self.style != "off":
            self.stream.write(text + "\n")
            self.stream.flush()

    def starting(self, run: ModeRun, what: str) -> None:
        self.index += 1
        reps = run.cfg.repeats
        self.say(f"[{self.index}/{self.total}] {run.spec.name}"
                 + (f", repeat {run.repeat + 1}/{reps}" if reps > 1 else "")
                 + f" (seed {run.seed}): {what}, budget {run.cfg.budget:g} s")
        epochs, self._budget = run.cfg.epochs, run.cfg.budget
        self._bar = Progress(f"{self.index}/{self.total} {run.spec.name}",
                             epochs * self.train_samples if epochs and self.train_samples
                             else None, self.style, self.stream, seconds=run.cfg.budget)
        self._next_show = 0.0

    def tick(self, run: ModeRun) -> None:
        now = time.monotonic()
        if self._bar is None or self.style == "off" or now < self._next_show:
            return
        self._next_show = now + SHOW_SECONDS
        events = list(RunDir(run.run_dir).events())
        last = events[-1] if events else {"t": 0.0, "samples": 0}
        evals = [e for e in events if e.get("event") == "eval"]
        metric = self.goal.metric
        if evals and evals[-1].get(metric.name) is not None:
            self._bar.evaluated(metric, evals[-1][metric.name], evals[-1]["loss"])
        rate = last["samples"] / last["t"] if last.get("t") else 0.0
        t = now - (run.launched or run.started)  # the run's clock: from its launch
        samples = last.get("samples", 0)
        self._bar.note(self.compare_eta(self._bar.eta(t, samples, rate)))
        self._bar.update(t, samples, rate)

    def compare_eta(self, run_eta: Optional[float]) -> str:
        """'compare ETA mm:ss' while runs remain after this one: what this one has left,
        then each of the others' budget, each run (this one too) plus the mean of what the
        finished ones took beyond their budget (final evaluation, exits, the report's
        reading)."""
        left = self.total - self.index
        if not left or run_eta is None:
            return ""
        overhead = sum(self._overheads) / len(self._overheads) if self._overheads else 0.0
        return f"compare ETA {fmt_time(run_eta + overhead + left * (self._budget + overhead))}"

    def finished(self, attempt: Attempt) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        took = f"in {attempt.seconds:.1f} s"
        if attempt.ok and attempt.seconds is not None:
            self._overheads.append(max(0.0, attempt.seconds - self._budget))
        if attempt.ok:
            numbers, metric = attempt.run.numbers(self.goal), self.goal.metric
            score = ("" if numbers["final_metric"] is None else
                     f": final test {metric.name} {metric.format(numbers['final_metric'])} "
                     f"(best {metric.format(numbers['best_metric'])})")
            self.say(f"[{self.index}/{self.total}] {attempt.label} done {took}{score}")
        else:
            self.say(f"[{self.index}/{self.total}] {attempt.label} {attempt.status.upper()} "
                     f"{took}: {attempt.error}")


@dataclass
class CompareResult:
    out: Path
    table: str
    attempts: list

    @property
    def failed(self) -> list:
        return [a for a in self.attempts if not a.ok]


def _compare_dir(out: Optional[str]) -> Path:
    if out is not None and Path(out).exists() and any(Path(out).iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new directory")
    return RunDir.create(out, "compare").path


def compare(cfg: CompareConfig, argv: Optional[list] = None,
            stream: TextIO = sys.stderr) -> CompareResult:
    """Run every mode of ``cfg.modes`` ``cfg.repeats`` times and write the report."""
    specs = parse_modes(cfg.modes)
    extra = parse_mode_args(cfg.mode_args, specs)
    Pacing.parse(cfg.slowdown, cfg.delay).check_ranks(cfg.procs or available_cores(), "--procs")
    Link.parse(cfg.link)
    if any(s.command in linked.SHAPED_COMMANDS for s in specs):  # else nothing to shape
        linked.check_link(cfg.link, cfg.ddp_backend)
    from ..core.tasks import task_of  # torch: only once the options are known to be good
    # Fails early on a bad task, and generates and caches its data outside every budget.
    task = task_of(cfg)
    goal = Goal(task.metric, cfg.target if cfg.target is not None else task.default_target)
    try:
        task.metric.check_target(goal.target)
    except ValueError as exc:
        raise ConfigError(f"{exc} (task {task.name} scores {task.metric.name})") from None
    if cfg.stop_at_target and goal.target is None:
        raise ConfigError(f"--stop-at-target needs --target: task {task.name} has no default "
                          f"target (its metric: {task.metric.name})")
    if cfg.tensorboard:
        _check_tensorboard()
    out = _compare_dir(cfg.out)
    header = {"command": argv if argv is not None else sys.argv, "config": dataclasses.asdict(cfg),
              "task": {"name": cfg.task, "train_samples": len(task.train),
                       "test_samples": len(task.test), "lr": cfg.lr or task.lr,
                       "batch_size": cfg.batch_size or task.batch_size,
                       "metric": task.metric.describe(), "target": goal.target},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **environment()}
    if cfg.link is not None:  # runs: each ps-*/ddp run's hosts and their links' byte counts
        header["link"] = {"rate": cfg.link, "tbf": Link.parse(cfg.link).tbf(), "runs": {}}
    # each run's directory -> the Unix time its first process was launched: its clock's origin
    header["launched"] = {}
    (out / "compare.json").write_text(json.dumps(header, indent=2, default=str) + "\n")
    total = len(specs) * cfg.repeats
    shown = CompareProgress(total, cfg.progress, stream, goal, len(task.train))
    shown.say(f"compare: {len(specs)} mode(s) x {cfg.repeats} repeat(s) = {total} run(s) of "
              f"{cfg.budget:g} s each on {task.name}, one after another; writing {out}")
    if cfg.tensorboard:
        shown.say(f"TensorBoard: each run writes {out}/<mode>-r<k>/tensorboard; view them "
                  f"together with: tensorboard --logdir {out}")
    attempts: list = []
    interrupted = False
    try:
        with sigterm_as_interrupt():
            # Repeats interleave (all modes, then all modes again): drift of a shared
            # machine then spreads over every mode instead of favouring one.
            for repeat in range(cfg.repeats):
                for spec in specs:
                    run = ModeRun(cfg, spec, repeat, out, extra, shown, goal)
                    attempts.append(run.attempt)
                    try:
                        run.run()
                    finally:
                        if run.traffic is not None:
                            header["link"]["runs"][f"{spec.name} r{repeat + 1}"] = run.traffic
                        if run.launched_wall is not None:
                            header["launched"][run.run_dir.name] = round(run.launched_wall, 3)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:  # also after Ctrl-C or SIGTERM: report what ran
        if attempts:
            table = publish(out, _title(cfg, cfg.task), _intro(cfg, header), attempts,
                            goal, header)
        if interrupted:
            shown.say(f"interrupted; the report of the runs so far: {out / 'report.md'}")
    return CompareResult(out, table, attempts)


def _check_tensorboard() -> None:
    """--tensorboard: fail before the first run rather than in every run."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install "
                          "tensorboard (or drop --tensorboard)") from exc


def _title(cfg: CompareConfig, task: str) -> str:
    pacing = Pacing.parse(cfg.slowdown, cfg.delay)
    return (f"asyncsgd compare: {task}, {cfg.procs or available_cores()} processes"
            + (f", {pacing.describe()}" if pacing.active else "")
            + (f", {cfg.link} links" if cfg.link else ""))


def _intro(cfg: CompareConfig, header: dict) -> list:
    versions, host = header["versions"], header["host"]
    task = header["task"]
    return [
        f"Every mode trained `{task['name']}` ({task['train_samples']:,} training / "
        f"{task['test_samples']:,} test samples) for a budget of {cfg.budget:g} s (start-up "
        f"included), one run after another, with plain SGD (lr {task['lr']:g}, batch "
        f"{task['batch_size']} per process), seeds {cfg.seed}..{cfg.seed + cfg.repeats - 1} "
        f"(same model initialisation and data order in every mode), evaluating every "
        f"{cfg.eval_every:g} s. single steps on the same batch as each process; ddp averages "
        f"one per rank into each update "
        f"(global batch {task['batch_size']} x ranks), Hogwild and the PS apply every "
        f"process's gradient on its own. Every process, single's too, runs "
        f"{max(1, available_cores() // (cfg.procs or available_cores()))} torch thread(s)."
        + _stragglers(cfg),
        "",
        f"Host: {host['hostname']}, {host['cpus']} CPUs, "
        f"{'GPUs: ' + ', '.join(host['gpus']) if host.get('gpus') else 'no GPU'}; "
        f"torch {versions['torch']}, asyncsgd {versions['asyncsgd']}.",
        "",
        "Command: `" + " ".join(shlex.quote(str(a)) for a in header["command"]) + "`",
    ] + (["", linked.describe(Link.parse(cfg.link), header["link"]["runs"])]
         if cfg.link else [])


def _stragglers(cfg: CompareConfig) -> str:
    pacing = Pacing.parse(cfg.slowdown, cfg.delay)
    if not pacing.active:
        return ""
    return (f" Stragglers staged in every parallel mode: {pacing.describe()} (a slowed rank "
            "waits after computing each gradient; single, rank 0 alone, gets what rank 0 is "
            "given).")
