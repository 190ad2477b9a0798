"""Training through chaos: faults on a seeded schedule, and what they cost.

    python experiments/chaos.py --minutes 10 --mtbf 15 --modes ps-async,ps-backup:auto
    python experiments/chaos.py --minutes 2 --kinds worker,shard --no-twin --out /tmp/chaos

Per mode, one parameter server and --workers workers (each in a network namespace of its
own when this process may make them, so links can fail) train for --minutes while faults
come at exponential intervals of mean --mtbf seconds, each picked at random (--seed):

- worker:   SIGKILL a worker; it is restarted under the same id (a job's restart policy);
- shard:    SIGKILL a shard process; the server's supervisor restarts it from its checkpoint;
- server:   SIGKILL the server's whole process group, then start it again with --resume;
- link:     take a worker's link down for --link-seconds, then up (a network partition);
- throttle: shape a worker's link to --throttle-rate with tbf for --throttle-seconds.

The run's time and the schedule count from the first update applied (however long the
processes took to start); at its end the server is stopped as Ctrl-C would stop it (it
saves the run and tells the workers). A fault waits until the one before it has
recovered, and none comes in the last --quiet seconds. Recovery is read from the
exactly-once audit (``--audit-dir``) as it grows: a killed worker is back at its
restarted self's first applied push, a shard (or the whole server: every shard) at its
first update applied after the kill, a link at the worker's first applied push after
the link came up, a throttled one at its first applied push after the throttling began.
The audit (``asyncsgd.analysis.audit``) gives goodput and the pushes doubled, lost and
lost to checkpoints; the same run without faults (same seed and duration) gives the
final metric to compare. Writes experiments/results/chaos.md and .json (or into --out),
printing a line per fault injected and per recovery seen.

Covers the parameter-server modes a ps-server runs (ps-async, ps-backup:B, diloco:H,
...) and ps-job under torchrun --max-restarts, where torchrun restarts the job's
processes after a worker's or the server's death and links are not staged (its ranks
share one host), and ray-job on a Ray of its own, where Ray restarts a killed worker
actor (worker and shard faults: Ray never restarts the server actor).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from results import RESULTS  # noqa: E402

KINDS = ("worker", "shard", "server", "link", "throttle")
LINKED = ("link", "throttle")  # need hosts in network namespaces
PORT = 5555
POLL = 0.2  # seconds between looks at the audit and the processes
STOP_GRACE = 120.0  # seconds a run may take to stop after its end before it is forced
PYTHON = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() \
    else sys.executable
STARTUP = 300.0  # seconds the processes may take to start training, beside a busy machine


@dataclass
class Fault:
    """One fault: when it is due (seconds into the run), its kind and its target (a worker's
    rank, a shard's index, 0 for the server); what happened is filled in as it runs."""

    due: float
    kind: str
    target: int
    at: Optional[float] = None  # when it was injected
    healed: Optional[float] = None  # link and throttle: when the link was restored
    recovered: Optional[float] = None
    note: str = ""

    @property
    def recovery(self) -> Optional[float]:
        """Seconds from the fault (a link: from its healing) to the recovery seen."""
        if self.recovered is None or self.at is None:
            return None
        start = self.healed if self.kind == "link" else self.at
        return round(self.recovered - start, 3)


def schedule(mtbf: float, seconds: float, kinds: list, seed: int, workers: int,
             shards: int = 1, quiet: float = 0.0) -> List[Fault]:
    """Faults at exponential intervals of mean ``mtbf`` within [0, seconds - quiet), each of
    a kind and a target drawn at random; the same seed gives the same schedule."""
    rng = random.Random(seed)
    faults, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf)
        if t >= seconds - quiet:
            return faults
        kind = rng.choice(list(kinds))
        target = {"shard": rng.randrange(shards), "server": 0}.get(kind)
        faults.append(Fault(round(t, 3), kind, rng.randrange(workers) if target is None
                            else target))


def recovery_table(faults: List[Fault]) -> Dict[str, dict]:
    """Per kind: faults injected, recovered, and the median and max seconds to recover."""
    table = {}
    for kind in KINDS:
        mine = [f for f in faults if f.kind == kind and f.at is not None]
        if not mine:
            continue
        times = [f.recovery for f in mine if f.recovery is not None]
        table[kind] = {"faults": len(mine), "recovered": len(times),
                       "median_s": round(statistics.median(times), 2) if times else None,
                       "max_s": round(max(times), 2) if times else None}
    return table


SHARD_FILE = re.compile(r"shard-(\d+)-(\d+)\.jsonl")
WORKER_FILE = re.compile(r"worker-(.*)-r(\d+)-([^-]+)\.jsonl")


class AuditWatch:
    """The audit folder as it grows: updates each shard applied and pushes each worker rank
    got acknowledged as applied, counted over all their processes' files."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.offsets: Dict[str, int] = {}
        self.shard_updates: Dict[int, int] = {}
        self.acked: Dict[int, int] = {}
        self.file_acks: Dict[str, int] = {}  # worker file -> pushes acknowledged as applied
        self.shard_pids: Dict[int, int] = {}  # index -> pid of its newest file

    def poll(self) -> None:
        for path in sorted(self.folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
            shard, worker = SHARD_FILE.fullmatch(path.name), WORKER_FILE.fullmatch(path.name)
            if shard is None and worker is None:
                continue
            if shard is not None and path.name not in self.offsets:
                self.shard_pids[int(shard.group(1))] = int(shard.group(2))
            for record in self._new_lines(path):
                if shard is not None and "w" in record:
                    index = int(shard.group(1))
                    self.shard_updates[index] = self.shard_updates.get(index, 0) + 1
                elif worker is not None and record.get("applied"):
                    rank = int(worker.group(2))
                    self.acked[rank] = self.acked.get(rank, 0) + 1
                    self.file_acks[path.name] = self.file_acks.get(path.name, 0) + 1

    def _new_lines(self, path: Path) -> list:
        with open(path, "rb") as fh:
            fh.seek(self.offsets.get(path.name, 0))
            data = fh.read()
        whole = data[:data.rfind(b"\n") + 1]  # a line being written waits for the next look
        self.offsets[path.name] = self.offsets.get(path.name, 0) + len(whole)
        records = []
        for line in whole.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a SIGKILL
        return records

    def mark(self, fault: Fault) -> dict:
        """What must grow for ``fault`` to count as recovered (read right after it)."""
        self.poll()
        if fault.kind == "server":
            return {("shard", i): n for i, n in self.shard_updates.items()}
        if fault.kind == "shard":
            return {("shard", fault.target): self.shard_updates.get(fault.target, 0)}
        return {("worker", fault.target): self.acked.get(fault.target, 0)}

    def mark_new_incarnation(self) -> dict:
        """For a worker killed without knowing its rank (a Ray actor): recovered once a
        worker file not seen yet (a new incarnation) has a push acknowledged as applied."""
        self.poll()
        return {("new", tuple(sorted(p.name for p in self.folder.glob("worker-*.jsonl")))): 0}

    def grown(self, marks: dict) -> bool:
        for (kind, known), _ in marks.items():
            if kind == "new":
                return any(n > 0 for name, n in self.file_acks.items() if name not in known)
        now = {"shard": self.shard_updates, "worker": self.acked}
        return all(now[kind].get(key, 0) > n for (kind, key), n in marks.items())


@dataclass
class Cluster:
    """The server and workers of one run, started, killed and restarted here."""

    args: argparse.Namespace
    mode: object  # asyncsgd.config.modes.ModeSpec
    out: Path
    hosts: object = None  # asyncsgd.run.hosts.Hosts, or None: everything on 127.0.0.1
    server: Optional[subprocess.Popen] = None
    workers: Dict[int, subprocess.Popen] = field(default_factory=dict)
    restarts: Dict[str, int] = field(default_factory=dict)
    deadline: float = 0.0
    port: int = PORT

    @property
    def audit(self) -> Path:
        return self.out / "audit"

    @property
    def run_dir(self) -> Path:
        return self.out / "run"

    def audit_flags(self) -> list:
        return ["--audit-dir", self.audit]

    def address(self) -> str:
        host = self.hosts.address("server") if self.hosts else "127.0.0.1"
        return f"tcp://{host}:{self.port}"

    def _popen(self, host: str, argv: list, log: str, group: bool = False) -> subprocess.Popen:
        argv = [PYTHON, "-m", "asyncsgd"] + [str(a) for a in argv]
        if self.hosts is not None:
            argv = self.hosts.command(host, argv)
        fh = open(self.out / log, "ab")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh,
                                    start_new_session=group, cwd=self.out,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                     signal.SIG_DFL))
        finally:
            fh.close()
        return proc

    def start_server(self, resume: bool = False) -> None:
        m, a = self.mode, self.args
        where = ["--resume", self.run_dir] if resume else ["--out", self.run_dir]
        flags = ["--task", a.task, "--workers", a.workers, "--shards", a.shards,
                 "--consistency", m.consistency, "--backup-workers", m.backup_workers,
                 "--optimizer", m.optimizer, *m.flags,
                 "--checkpoint-every", a.checkpoint_every, "--heartbeat-timeout",
                 a.heartbeat_timeout, "--threads", 1, "--seed", a.seed,
                 "--shard-restarts", 1_000_000]
        # No --max-seconds: the run ends when this script stops the server (SIGTERM), its
        # time counted from the first update, however long the processes took to start.
        self.server = self._popen("server", [
            "ps-server", "--bind", self.address(), *where, *([] if resume else flags),
            "--progress", "log", "--no-exit-when-done", *self.audit_flags()],
            "server.log", group=True)

    def start_worker(self, rank: int) -> None:
        a = self.args
        self.workers[rank] = self._popen(f"w{rank}", [
            "worker", "--server", self.address(), "--task", a.task, "--rank", rank,
            "--world", a.workers, "--epochs", 100_000, "--threads", 1, "--seed", a.seed,
            "--heartbeat", 0.5, "--server-timeout", 300, "--progress", "off",
            *self.audit_flags(), *self.mode.worker_flags], f"worker-{rank}.log")

    def start(self) -> None:
        self.audit.mkdir(parents=True, exist_ok=True)
        self.deadline = float("inf")
        self.start_server()
        for rank in range(self.args.workers):
            self.start_worker(rank)

    def _count(self, what: str) -> None:
        self.restarts[what] = self.restarts.get(what, 0) + 1

    def tend(self, say) -> None:
        """Restart what stopped before the end: a worker that exited (a job's restart
        policy); a server that exited on its own before its time ends the run."""
        if self.server.poll() is not None and time.monotonic() < self.deadline:
            raise RuntimeError(f"the server exited ({self.server.returncode}) before the end; "
                               f"see {self.out / 'server.log'}")
        for rank, proc in self.workers.items():
            if proc.poll() is not None and time.monotonic() < self.deadline:
                say(f"worker {rank} exited ({proc.returncode}): restarted")
                self._count("worker exits")
                self.start_worker(rank)

    def kill_worker(self, rank: int) -> None:
        proc = self.workers[rank]
        proc.kill()
        proc.wait()
        self.start_worker(rank)

    def kill_shard(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_gone(pid)

    def kill_server(self) -> None:
        import psutil
        tree = [self.server.pid] + [p.pid for p in psutil.Process(self.server.pid)
                                    .children(recursive=True)]
        try:
            os.killpg(self.server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.server.wait()
        for pid in tree:
            _wait_gone(pid)
        self.start_server(resume=True)

    def link(self, rank: int, up: bool) -> None:
        from asyncsgd.run.namespaces import ip
        ip("-n", self.hosts.namespace(f"w{rank}"), "link", "set", "eth0",
           "up" if up else "down")

    def throttle(self, rank: int, on: bool) -> None:
        from asyncsgd.run.link import Link
        from asyncsgd.run.namespaces import tc
        ns = self.hosts.namespace(f"w{rank}")
        if on:
            tc("-n", ns, "qdisc", "replace", "dev", "eth0", "root",
               *Link.parse(self.args.throttle_rate).tbf())
        else:
            tc("-n", ns, "qdisc", "del", "dev", "eth0", "root")

    def kill_all(self) -> None:
        """After a failure of this script: SIGKILL every process it started."""
        for proc in [self.server, *self.workers.values()]:
            if proc is not None and proc.poll() is None:
                try:
                    if proc is self.server:  # with its shards (or torchrun's ranks)
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
                except ProcessLookupError:
                    pass
                proc.wait()

    def finish(self, say) -> dict:
        """Stop the server as Ctrl-C would (it saves the run and tells the workers), wait
        for everyone; force what does not stop within STOP_GRACE, and say so."""
        self.deadline = time.monotonic()
        self.server.send_signal(signal.SIGTERM)
        forced = []
        procs = [("server", self.server)] + [(f"worker {r}", p) for r, p in self.workers.items()]
        for name, proc in procs:
            try:
                proc.wait(max(1.0, self.deadline + STOP_GRACE - time.monotonic()))
            except subprocess.TimeoutExpired:
                forced.append(name)
                proc.kill()
                proc.wait()
        if forced:
            say(f"forced to stop: {', '.join(forced)}")
        return {"forced": forced, "server_exit": self.server.returncode}


class JobCluster(Cluster):
    """ps-job under torchrun --max-restarts on 127.0.0.1: a worker's or the server's death
    makes torchrun restart the job's processes (the server resumes its run); a shard's is
    the server's supervisor's to restart. Links are not staged: the ranks share one host."""

    def start(self) -> None:
        a, m = self.args, self.mode
        self.audit.mkdir(parents=True, exist_ok=True)
        self.deadline = float("inf")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        argv = ["-m", "torch.distributed.run", "--nnodes", 1, "--nproc-per-node",
                a.workers + 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-id", f"chaos-{os.getpid()}",
                "--max-restarts", 1_000_000, "-m", "asyncsgd", "ps-job", "--servers", 1,
                "--task", a.task, "--shards", a.shards, "--consistency", m.consistency,
                "--checkpoint-every", a.checkpoint_every, "--heartbeat-timeout",
                a.heartbeat_timeout, "--threads", 1, "--seed", a.seed,
                "--shard-restarts", 1_000_000, "--epochs", 100_000, "--heartbeat", 0.5,
                "--server-timeout", 300, "--out", self.run_dir, "--progress", "log",
                "--no-exit-when-done", *self.audit_flags()]
        with open(self.out / "job.log", "ab") as fh:
            self.server = subprocess.Popen(
                [PYTHON, *map(str, argv)], stdin=subprocess.DEVNULL, stdout=fh, stderr=fh,
                start_new_session=True, cwd=self.out,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def _rank(self, rank: int):
        """The job's process of torchrun rank ``rank`` (0 serves), once torchrun runs one."""
        import psutil
        deadline = time.monotonic() + STARTUP
        while time.monotonic() < deadline:
            for child in psutil.Process(self.server.pid).children():
                try:
                    if child.environ().get("RANK") == str(rank):
                        return child
                except psutil.Error:
                    pass
            time.sleep(POLL)
        raise RuntimeError(f"torchrun ran no rank {rank} within {STARTUP:.0f} s")

    def tend(self, say) -> None:
        if self.server.poll() is not None and time.monotonic() < self.deadline:
            raise RuntimeError(f"torchrun exited ({self.server.returncode}) before the end; "
                               f"see {self.out / 'job.log'}")

    def kill_worker(self, rank: int) -> None:
        victim = self._rank(rank + 1)
        victim.kill()
        _wait_gone(victim.pid)

    def kill_server(self) -> None:
        victim = self._rank(0)
        victim.kill()
        _wait_gone(victim.pid)


class RayCluster(Cluster):
    """ray-job on a Ray of its own (127.0.0.1): Ray restarts a killed worker actor as a new
    incarnation (--max-restarts), the server's supervisor a killed shard. Ray never
    restarts the server actor, and links are not staged: worker and shard faults only."""

    def start(self) -> None:
        a, m = self.args, self.mode
        self.audit.mkdir(parents=True, exist_ok=True)
        self.deadline = float("inf")
        self.server = self._popen("server", [
            "ray-job", "--workers", a.workers, "--max-restarts", 1_000_000, "--task", a.task,
            "--shards", a.shards, "--consistency", m.consistency, "--checkpoint-every",
            a.checkpoint_every, "--heartbeat-timeout", a.heartbeat_timeout, "--threads", 1,
            "--seed", a.seed, "--shard-restarts", 1_000_000, "--epochs", 100_000,
            "--heartbeat", 0.5, "--server-timeout", 300, "--out", self.run_dir,
            "--progress", "log", "--no-exit-when-done", *self.audit_flags()],
            "job.log", group=True)

    def tend(self, say) -> None:
        if self.server.poll() is not None and time.monotonic() < self.deadline:
            raise RuntimeError(f"ray-job exited ({self.server.returncode}) before the end; "
                               f"see {self.out / 'job.log'}")

    def kill_worker(self, rank: int) -> None:
        """SIGKILL one worker actor's process: the ``rank``-th by pid (Ray names no rank)."""
        import psutil
        actors = []
        for p in psutil.Process(self.server.pid).children(recursive=True):
            try:
                if "AsyncSGDWorker" in " ".join(p.cmdline()):
                    actors.append(p)
            except psutil.Error:
                pass
        if not actors:
            raise RuntimeError("no worker actor process found")
        victim = sorted(actors, key=lambda p: p.pid)[rank % len(actors)]
        victim.kill()
        _wait_gone(victim.pid)


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    import psutil
    try:
        psutil.Process(pid).wait(timeout)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass


class Chaos:
    """One mode's run: its cluster, its schedule applied, its recoveries watched."""

    def __init__(self, args, mode, out: Path, faults: List[Fault], hosts=None):
        self.args, self.mode, self.faults = args, mode, faults
        self.cluster = {"ps-job": JobCluster, "ray-job": RayCluster}.get(
            mode.command, Cluster)(args, mode, out, hosts)
        self.watch = AuditWatch(self.cluster.audit)
        self.started = 0.0
        self.log = open(out / "chaos.log", "a")

    def say(self, text: str) -> None:
        line = f"[{self.mode.name} {time.monotonic() - self.started:7.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def now(self) -> float:
        return time.monotonic() - self.started

    def run(self, seconds: float) -> dict:
        try:
            return self._run(seconds)
        except BaseException:
            self.cluster.kill_all()
            raise

    def _run(self, seconds: float) -> dict:
        self.started = time.monotonic()
        self.cluster.start()
        while not self.watch.shard_updates:  # the clock starts with training
            if self.now() > STARTUP:
                raise RuntimeError(f"{self.mode.name}: no update applied within {STARTUP:.0f} "
                                   f"s of the start; see the logs in {self.cluster.out}")
            time.sleep(POLL)
            self.cluster.tend(self.say)
            self.watch.poll()
        self.say(f"training began: the run's {seconds:.0f} s and {len(self.faults)} "
                 "scheduled fault(s) count from here")
        self.started = time.monotonic()
        self.cluster.deadline = self.started + seconds
        pending: Optional[tuple] = None  # (fault, marks) waiting to recover
        healing: Optional[tuple] = None  # (fault, when to restore its link)
        queue = list(self.faults)
        while self.now() < seconds:
            time.sleep(POLL)
            self.cluster.tend(self.say)
            self.watch.poll()
            if healing is not None and self.now() >= healing[1]:
                fault = healing[0]
                (self.cluster.link if fault.kind == "link" else self.cluster.throttle)(
                    fault.target, True if fault.kind == "link" else False)
                fault.healed = self.now()
                if fault.kind == "link":
                    pending = (fault, self.watch.mark(fault))
                self.say(f"{fault.kind} of worker {fault.target} restored")
                healing = None
            if pending is not None and self.watch.grown(pending[1]):
                fault = pending[0]
                fault.recovered = self.now()
                self.say(f"recovered from {fault.kind} {fault.target} in {fault.recovery:.2f} s")
                pending = None
            if queue and pending is None and healing is None and \
                    queue[0].due <= self.now() < seconds - self.args.quiet:
                pending, healing = self.inject(queue.pop(0))
        for fault in queue:
            fault.note = "not injected: an earlier fault was still recovering"
        if pending is not None:
            self.say(f"not recovered by the end: {pending[0].kind} {pending[0].target}")
        return self.cluster.finish(self.say)

    def inject(self, fault: Fault) -> tuple:
        """Apply ``fault`` now: (pending recovery, pending healing), either may be None."""
        fault.at = self.now()
        c = self.cluster
        if fault.kind == "worker" and self.mode.command == "ray-job":
            marks = self.watch.mark_new_incarnation()
            c.kill_worker(fault.target)
            self.say(f"SIGKILL a worker actor, restarted by Ray (injected at {fault.at:.1f} s)")
            return (fault, marks), None
        if fault.kind == "worker":
            c.kill_worker(fault.target)
            what = f"SIGKILL worker {fault.target}, restarted" + (
                " by torchrun" if self.mode.command == "ps-job" else "")
        elif fault.kind == "shard":
            pid = self.watch.shard_pids.get(fault.target)
            if pid is None:
                fault.at, fault.note = None, "no shard pid known yet"
                return None, None
            c.kill_shard(pid)
            what = f"SIGKILL shard {fault.target} (pid {pid})"
        elif fault.kind == "server":
            c.kill_server()
            what = "SIGKILL the server's rank, torchrun restarts the job" \
                if self.mode.command == "ps-job" else \
                "SIGKILL the server's process group, restarted with --resume"
        elif fault.kind == "link":
            c.link(fault.target, False)
            self.say(f"link of worker {fault.target} down for {self.args.link_seconds} s")
            return None, (fault, self.now() + self.args.link_seconds)
        else:
            marks = self.watch.mark(fault)
            c.throttle(fault.target, True)
            self.say(f"link of worker {fault.target} throttled to {self.args.throttle_rate} "
                     f"for {self.args.throttle_seconds} s")
            return (fault, marks), (fault, self.now() + self.args.throttle_seconds)
        self.say(f"{what} (injected at {fault.at:.1f} s)")
        return (fault, self.watch.mark(fault)), None


def final_metric(run_dir: Path) -> Optional[float]:
    """The last evaluation's metric of the run (the resumed server's, after a restart); None
    when the server left no summary (it had to be forced to stop)."""
    if not (run_dir / "summary.json").is_file():
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("final_metric", "final_accuracy"):
        if summary.get(key) is not None:
            return summary[key]
    return None


def run_mode(args, mode, out: Path, faulty: bool, seconds: float) -> dict:
    """One mode's run (with the schedule, or its fault-free twin) and its figures."""
    from asyncsgd.analysis.audit import read_audit
    out.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.kinds.split(",") if mode.command == "ps-server" or (
        k not in LINKED and (mode.command != "ray-job" or k != "server"))]
    faults = schedule(args.mtbf, seconds, kinds, args.seed, args.workers, args.shards,
                      args.quiet) if faulty else []
    hosts = None
    if args.namespaces and mode.command == "ps-server":
        from asyncsgd.run.hosts import Hosts
        hosts = Hosts(["server", *(f"w{r}" for r in range(args.workers))])
        hosts.__enter__()
    try:
        chaos = Chaos(args, mode, out, faults, hosts)
        stopped = chaos.run(seconds)
    finally:
        if hosts is not None:
            hosts.close()
    audit = read_audit(chaos.cluster.audit)
    injected = [f for f in faults if f.at is not None]
    return {"mode": mode.name, "faults": faulty, "seconds": seconds,
            "goodput": None if audit.goodput is None else round(audit.goodput, 4),
            "compute_seconds": round(audit.compute_seconds, 1), "applied": audit.applied,
            "doubled": audit.doubled, "lost": audit.lost,
            "lost_to_checkpoint": audit.lost_to_checkpoint, "lost_resent": audit.lost_resent,
            "violations": [list(v) for v in audit.violations][:20],
            "final_metric": final_metric(chaos.cluster.run_dir),
            "injected": len(injected),
            "recovered": sum(f.recovered is not None for f in injected),
            "recovery": recovery_table(faults), "schedule": [asdict(f) for f in faults],
            "worker_exits": chaos.cluster.restarts.get("worker exits", 0), **stopped}


def _share(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1%}"


def table(rows: list, args) -> str:
    lines = [f"# Training through chaos ({args.minutes:g} min per run, {args.workers} workers, "
             f"{args.task}, mtbf {args.mtbf:g} s, kinds {args.kinds}, seed {args.seed}, "
             f"{os.cpu_count()} cores)", "",
             "| mode | faults injected / recovered | goodput | pushes applied | doubled | lost "
             "| lost to checkpoints (re-sent) | final metric "
             "| fault-free: goodput, metric |",
             "|---|---|---|---|---|---|---|---|---|"]
    twins = {r["mode"]: r for r in rows if not r["faults"]}
    for r in (r for r in rows if r["faults"]):
        twin = twins.get(r["mode"], {})
        lines.append(f"| {r['mode']} | {r['injected']} / {r['recovered']} | "
                     f"{_share(r['goodput'])} | {r['applied']} | {r['doubled']} | {r['lost']} | "
                     f"{r['lost_to_checkpoint']} "
                     f"({r['lost_resent']}) | {r['final_metric']} | "
                     f"{_share(twin.get('goodput'))}, {twin.get('final_metric', '—')} |")
    lines += ["", "Time to recover (seconds; a link from when it came back up):", "",
              "| mode | kind | faults | recovered | median | max |", "|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["faults"]):
        for kind, t in r["recovery"].items():
            lines.append(f"| {r['mode']} | {kind} | {t['faults']} | {t['recovered']} | "
                         f"{t['median_s']} | {t['max_s']} |")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0,
                   help="length of each run in minutes, e.g. 2 (default 10)")
    p.add_argument("--mtbf", type=float, default=15.0,
                   help="mean seconds between faults (exponential intervals; default 15)")
    p.add_argument("--modes", default="ps-async,ps-backup:auto",
                   help="parameter-server modes as compare names them: ps-async, "
                        "ps-backup:auto (sync, rounds closed at an adaptive deadline), "
                        "ps-backup:1 (sync with one backup worker), diloco:8; or ps-job "
                        "(async, under torchrun --max-restarts; worker, shard and server "
                        "faults only) or ray-job (async, Ray restarts worker actors; worker "
                        "and shard faults only) (default ps-async,ps-backup:auto)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"fault kinds to draw from, of {', '.join(KINDS)} (default all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the schedule and the runs")
    p.add_argument("--workers", type=int, default=4, help="workers (default 4)")
    p.add_argument("--shards", type=int, default=1, help="shard processes (default 1)")
    p.add_argument("--task", default="mnist1d-cnn", help="task (default mnist1d-cnn)")
    p.add_argument("--checkpoint-every", type=float, default=1.0,
                   help="seconds between the server's checkpoints (default 1)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds of silence before a worker leaves sync rounds (default 5)")
    p.add_argument("--link-seconds", type=float, default=3.0,
                   help="how long a link stays down (default 3)")
    p.add_argument("--throttle-seconds", type=float, default=5.0,
                   help="how long a link stays throttled (default 5)")
    p.add_argument("--throttle-rate", default="5mbit",
                   help="a throttled link's rate, as --link takes it (default 5mbit)")
    p.add_argument("--quiet", type=float, default=20.0,
                   help="seconds at the end of a run without new faults (default 20)")
    p.add_argument("--no-twin", action="store_true",
                   help="skip the fault-free run of each mode (no metric to compare)")
    p.add_argument("--out", default=None,
                   help="folder for the runs and the results (default: a temporary folder, "
                        "results into experiments/results/chaos.md and .json)")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        p.error(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    from asyncsgd.run.namespaces import can_make_namespaces
    args.namespaces, why = can_make_namespaces()
    if not args.namespaces and set(kinds) & set(LINKED):
        p.error(f"--kinds {','.join(set(kinds) & set(LINKED))}: {why}")
    return args


def main(argv=None) -> list:
    args = parse(argv)
    from asyncsgd.config.modes import ModeSpec, parse_modes
    names = [m for m in args.modes.split(",") if m]
    specs = [ModeSpec(name, name, "async") if name in ("ps-job", "ray-job") else
             parse_modes(name)[0] for name in names]
    wrong = [s.name for s in specs if s.command not in ("ps-server", "ps-job", "ray-job")]
    if wrong:
        sys.exit(f"--modes {','.join(wrong)}: chaos runs parameter-server modes, ps-job "
                 "and ray-job")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="chaos-"))
    seconds = args.minutes * 60
    rows = []
    for spec in specs:
        for faulty in (True, False) if not args.no_twin else (True,):
            where = base / f"{spec.slug}-{'chaos' if faulty else 'calm'}"
            rows.append(run_mode(args, spec, where, faulty, seconds))
            r = rows[-1]
            print(f"[{spec.name}] {'with faults' if faulty else 'fault-free'}: goodput "
                  f"{_share(r['goodput'])}, doubled {r['doubled']}, lost {r['lost']}, lost to "
                  f"checkpoints {r['lost_to_checkpoint']}, final metric {r['final_metric']}",
                  flush=True)
    text = table(rows, args)
    results = base if args.out else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    (results / "chaos.md").write_text(text + "\n")
    (results / "chaos.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items()}, "host": socket.gethostname(),
         "runs": rows}, indent=2) + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    main()
