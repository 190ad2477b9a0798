"""One run of one compare mode: its command lines, its processes, their watch.

Each mode runs as the installed CLI in subprocesses (``cli_launcher``), so a failing mode
is recorded and the comparison goes on; with ``--link`` its processes stand on hosts of
their own (``linked``).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Optional

from ..analysis.report import Attempt, Goal
from ..config import NO_EPOCH_LIMIT, CompareConfig
from ..core.pacing import Pacing
from ..run.hosts import Hosts
from ..run.link import Link
from ..run.process_group import available_cores
from . import linked
from .cli_launcher import Child, free_port, stop_all
from ..config.modes import ModeSpec
from .progress import CompareProgress

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
PORT_ATTEMPTS = 3
LINGER_SECONDS = 15.0


def _present(flags: dict) -> list:
    """``{'--lr': None, '--seed': 3}`` -> ['--seed', '3']: only the flags that are set."""
    return [str(part) for name, value in flags.items() if value is not None
            for part in (name, value)]


class ModeRun:
    """One run of one mode: starts its processes, watches them, returns an Attempt."""

    def __init__(self, cfg: CompareConfig, spec: ModeSpec, repeat: int, out: Path,
                 extra: dict, shown: Optional[CompareProgress], goal: Optional[Goal] = None,
                 lr: Optional[float] = None, name: Optional[str] = None):
        """``goal``: the task's metric and target (None: no target to stop at); ``lr``: this
        mode's (--tune lr), else ``cfg.lr``; ``name``: of its run and logs directories
        (default ``<mode>-r<repeat>``)."""
        self.cfg, self.spec, self.repeat, self.extra, self.shown = cfg, spec, repeat, extra, shown
        self.goal = goal
        self.lr = lr if lr is not None else cfg.lr
        self.seed = cfg.seed + repeat
        self.procs = cfg.procs or available_cores()
        # single too: it is one of the N processes alone, and more threads collapse on a
        # busy machine (experiments/README.md, "Async vs sync")
        self.threads = max(1, available_cores() // self.procs)
        name = name or f"{spec.slug}-r{repeat + 1}"
        self.run_dir, self.logs = out / name, out / "logs" / name
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
                ["--tensorboard"] if c.tensorboard else []) + [
                    flag for name in c.log_to for flag in ("--log-to", name)]

    def _train_flags(self, world: int) -> list:
        """What every training process takes; ``world``: its mode's processes (stragglers
        are named by rank: single, one process, is rank 0)."""
        c = self.cfg
        return _present({"--epochs": c.epochs or NO_EPOCH_LIMIT, "--batch-size": c.batch_size,
                         "--clip-grad-norm": c.clip_grad_norm,
                         "--accumulate": c.accumulate if c.accumulate > 1 else None}
                        ) + Pacing.parse(c.slowdown, c.delay).flags(world)

    def _schedule_flags(self) -> list:
        """--lr-schedule and --warmup, of the command that owns the lr (not the PS workers)."""
        c = self.cfg
        return _present({"--lr-schedule": c.lr_schedule if c.lr_schedule != "constant" else None,
                         "--warmup": c.warmup if str(c.warmup) != "0" else None})

    def command(self) -> list:
        """Flags of the mode's (first) command."""
        spec, c = self.spec, self.cfg
        if spec.command == "ps-server":
            flags = self._run_flags() + _present({
                "--workers": self.procs, "--shards": c.shards, "--consistency": spec.consistency,
                "--backup-workers": spec.backup_workers or None, "--optimizer": spec.optimizer,
                "--lr": self.lr if spec.optimizer == "sgd" else None,
                "--batch-size": c.batch_size,  # --balance batch: the global batch's share
                "--epochs": c.epochs or NO_EPOCH_LIMIT}) + self._schedule_flags()  # +dynamic's
        else:
            world = 1 if spec.command == "single" else self.procs
            flags = self._run_flags() + self._train_flags(world) + _present({"--lr": self.lr})
            flags += self._schedule_flags()
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
        local_lr = self.lr if self.spec.worker_flags else None
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
            attempt.read_back()
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

