"""``asyncsgd ray-job`` (``asyncsgd.ray``): a whole parameter-server job on Ray, with Ray placing
and restarting the workers.

    asyncsgd ray-job --task mnist1d-cnn --workers 2 --target 0.85       # a Ray of its own

This process is the driver and owns every actor: one server actor (``serve`` as
``ps-server`` runs it, pinned to the driver's node where the run directory is written, its
shards its own children, so its supervisor restarts them; never restarted by Ray), one
worker actor each (``--max-restarts``: Ray starts a dead one again as a new incarnation),
and a ledger actor holding the server's address and each worker's starts and last shard
versions, from which a restored shard counts the updates it lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Optional

from .. import errors
from ..config import RayJobConfig, ServerConfig, make_config
from ..errors import AsyncSGDError, ConfigError
from ..run.given_task import task_named
from ..run.lifetime import command_started_at, pid_alive, start_command_clock
from ..run.process_group import available_cores
from ..run.recorder import RunResult
from ..run.rundir import RunDir
from ..run.settings import configure
from ..run.signals import sigterm_as_interrupt
from ..servers.supervisor import SHARD_READY_SECONDS
from ..wire.transport import parse_endpoint
from .ray_env import DriverOutput
from .roles import server_settings, worker_settings

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
LEDGER_EVERY = 1.0  # how often the driver looks for restarted workers, to log them
WORKER_GRACE = 20.0  # after the server ended: a worker is told at its next push; one that
#                      was restarting would wait --server-timeout for a server that is gone
STOP_SECONDS = 90.0  # SIGTERM to a saved run: shards save and drain (1.5-8 s), a last
#                      evaluation, summary.json; slow under load
GONE_SECONDS = 15.0
NOTE_SECONDS = 30.0  # how often a slow start is noted
# Ray starts its worker processes at nice 15, and under load the job's actors and the
# server's shards then starve (experiments/README.md, "Ray's worker niceness"). Ray's own
# job supervisor asks for 0 the same way.
UNNICED = {"env_vars": {"RAY_worker_niceness": "0"}}
REQUIREMENT = "ray>=2.9"
# Settings a resumed job decides anew rather than taking from the run's config.json.
_NOT_RESUMED = {"bind", "threads", "out", "resume", "advertise"}


@dataclass
class RayJobResult:
    """What a Ray job returns: the server's run (``run_dir``, ``summary``: summary.json),
    each worker's last ``WorkerResult`` by rank (None for one the driver stopped after the
    server had ended), and how often Ray restarted each worker's actor."""

    run_dir: str
    summary: dict
    workers: dict
    restarts: dict

    @property
    def total_restarts(self) -> int:
        return sum(self.restarts.values())


def run(config: Optional[RayJobConfig] = None, /, **settings: Any) -> RayJobResult:
    """``asyncsgd ray-job``: start the job (``start``), wait for its end and clean up.
    SIGTERM stops it as Ctrl-C does (in the main thread)."""
    with sigterm_as_interrupt(), start(config, **settings) as job:
        return job.wait()


def start(config: Optional[RayJobConfig] = None, /, **settings: Any) -> "RayJob":
    """Start a job; return once every worker has begun: ``job.address`` is the server's;
    ``job.wait()`` waits for the end (``with start(...) as job:`` cleans up whatever
    happens). Settings as ``RayJobConfig``'s fields, or the dataclass, or both; with
    ``resume``, the run's saved settings under the ones given."""
    return RayJob(_settings(config, settings))


def _settings(config: Optional[RayJobConfig], settings: dict) -> RayJobConfig:
    config, settings = task_named(config, settings, "the Ray job's actors")
    job = make_config(RayJobConfig, config, settings)
    if job.device == "cuda" and not job.gpus_per_worker:
        raise ConfigError("--device cuda needs --gpus-per-worker (e.g. 1): Ray shows an actor "
                          "only the GPUs it reserved")
    if job.gpus_per_worker and job.device != "cuda":
        raise ConfigError(f"--gpus-per-worker {job.gpus_per_worker:g} reserves GPUs that "
                          "--device cpu workers would not use; add --device cuda")
    if job.address and job.address.startswith("ray://"):
        raise ConfigError(f"--address {job.address}: Ray Client is not supported; the driver "
                          "runs on a node of the cluster (the server writes the run directory "
                          "beside it): run it on the head node, or with 'ray job submit -- "
                          "asyncsgd ray-job ...'")
    if not job.resume:
        return job
    return configure(RayJobConfig, config, settings, saved_as=ServerConfig, anew=_NOT_RESUMED)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(f"asyncsgd ray-job needs Ray: pip install 'asyncsgd[ray]' (or "
                          f"'{REQUIREMENT}')") from None
    return ray


class RayJob:
    """A running job: its actors, the Ray it runs on, and what they returned."""

    def __init__(self, job: RayJobConfig):
        self.config = job
        self.address: Optional[str] = None
        self.run_dir: Optional[str] = None
        self.server_place: Optional[dict] = None  # where the server's actor runs: node, ip, pid
        self._ray = _import_ray()
        self._ours = False  # this process called ray.init: it calls ray.shutdown
        self._output: Optional[DriverOutput] = None
        self._closed = False
        self._server = self._ledger = None
        self._workers: list = []
        self._places: dict = {}  # "server" or rank -> where its actor runs
        self._serve_ref = None
        self._trains: dict = {}  # ObjectRef -> rank
        self._server_result: Optional[RunResult] = None
        self._results: dict = {}
        self._starts: dict = {}  # rank -> [place of each incarnation]
        origin = command_started_at()  # the command's start, else this call's
        self._origin = time.time() - (time.monotonic() - origin if origin else 0.0)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    # ---- start -------------------------------------------------------------------------

    def _start(self) -> None:
        ray, job = self._ray, self.config
        self._connect()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        level = logging.getLogger().getEffectiveLevel()
        self._ledger = ray.remote(AsyncSGDLedger).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=here, runtime_env=UNNICED).remote()
        self._server = ray.remote(AsyncSGDServer).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=here, runtime_env=UNNICED).remote(
                os.getcwd(), level, self._origin)
        worker = ray.remote(AsyncSGDWorker).options(
            num_cpus=job.cpus_per_worker, num_gpus=job.gpus_per_worker,
            max_restarts=job.max_restarts, max_task_retries=job.max_restarts,
            runtime_env=UNNICED)
        self._workers = [worker.remote(rank, level, self._origin)
                         for rank in range(job.workers)]
        self._place_actors()
        self._serve()
        self._trains = {self._workers[rank].train.remote(self._worker_settings(rank),
                                                         self._ledger): rank
                        for rank in range(job.workers)}
        self._await_workers()
        nodes = {p["node"] for p in self._places.values()}
        log.info("ray-job: %d worker actor(s) on %d node(s) train with the server at %s; "
                 "run directory %s", job.workers, len(nodes), self.address, self.run_dir)

    def _connect(self) -> None:
        ray, job = self._ray, self.config
        level = logging.getLogger().getEffectiveLevel()
        if ray.is_initialized():
            if job.address:
                raise ConfigError(f"address={job.address!r}, but this process is connected "
                                  "to Ray already: leave address out to run there, or call "
                                  "ray.shutdown() first")
            return
        address = job.address or os.environ.get("RAY_ADDRESS") or None
        began = time.monotonic()
        self._ours = True
        self._output = DriverOutput()
        if address:
            _check_reachable(address)
            try:
                ray.init(address=address, logging_level=level, log_to_driver=True)
            except ConnectionError as exc:
                raise AsyncSGDError(f"cannot join the Ray cluster at {address} (--address, "
                                    f"$RAY_ADDRESS): {exc}") from None
            log.info("ray-job: joined the Ray cluster at %s in %.1f s", address,
                     time.monotonic() - began)
            return
        cpus = max(available_cores(), math.ceil(job.workers * job.cpus_per_worker))
        ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                 logging_level=level, log_to_driver=True)
        log.info("ray-job: started a local Ray with %d CPU(s) in %.1f s", cpus,
                 time.monotonic() - began)
        gpus = ray.cluster_resources().get("GPU", 0)
        if job.gpus_per_worker * job.workers > gpus:
            raise ConfigError(f"{job.workers} worker(s) x --gpus-per-worker "
                              f"{job.gpus_per_worker:g} need {job.gpus_per_worker * job.workers:g} "
                              f"GPU(s); this host has {gpus:g}")

    def _place_actors(self) -> None:
        """Wait until Ray has placed and started every actor; note where each runs."""
        ray, job = self._ray, self.config
        actors = {"server": self._server, **dict(enumerate(self._workers))}
        refs = {key: actor.where.remote() for key, actor in actors.items()}
        try:
            places = ray.get(list(refs.values()), timeout=job.start_timeout)
        except ray.exceptions.GetTimeoutError:
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=0)
            waiting = [key for key, ref in refs.items() if ref not in ready]
            raise AsyncSGDError(
                f"Ray did not start the job's actors within {job.start_timeout:g} s "
                f"(--start-timeout); still waiting: {', '.join(map(_name, waiting))}. Each "
                f"worker asks for {_resources(job)}; the cluster has "
                f"{_describe(ray.cluster_resources())}, of which "
                f"{_describe(ray.available_resources())} free: lower --workers, "
                "--cpus-per-worker or --gpus-per-worker, or add nodes") from None
        self._places = dict(zip(refs, places))
        self.server_place = self._places["server"]

    def _serve(self) -> None:
        """Start the server; return once it listens (its address is in the ledger)."""
        ray, job = self._ray, self.config
        server = self._places["server"]
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        bind = job.bind or ("tcp://127.0.0.1:0" if len(nodes) == 1 else "tcp://0.0.0.0:0")
        host, _ = parse_endpoint(bind, "--bind")
        advertise = job.advertise or (host if host not in ("0.0.0.0", "::", "*")
                                      else server["ip"])
        here = sum(1 for key, p in self._places.items()
                   if key != "server" and p["node"] == server["node"])
        # --threads 0: the server divides the node's cores among its shards (their count,
        # with --shards auto, known once it has built the model), its front and these
        cfg = server_settings(dataclasses.replace(job, bind=bind), job.workers,
                              resume=job.resume)
        self._serve_ref = self._server.serve.remote(cfg, self._ledger, advertise, here)
        # Its shards start as its children, importing torch: slow on a busy machine (over
        # 60 s beside 4 busy processes on 2 cores), and bounded by the server itself, which
        # fails once one has not started in SHARD_READY_SECONDS; this waits for that
        began = time.monotonic()
        deadline = began + job.start_timeout + SHARD_READY_SECONDS
        noted = began
        while True:
            ready, _ = ray.wait([self._serve_ref], timeout=POLL_SECONDS)
            if ready:
                result = self._server_outcome()
                raise AsyncSGDError(f"the server ended before it listened "
                                    f"({result.summary.get('stopped_by')}); see "
                                    f"{result.run_dir}")
            published = ray.get(self._ledger.server.remote())
            if published:
                self.address, self.run_dir = published
                return
            now = time.monotonic()
            if now > deadline:
                raise AsyncSGDError(f"the server did not listen within {now - began:.0f} s")
            if now - noted > NOTE_SECONDS:
                noted = now
                log.warning("ray-job: the server is still starting after %.0f s (a busy "
                            "machine?); waiting", now - began)

    def _await_workers(self) -> None:
        """Return once every worker has begun training (or one has ended already: ``wait``
        tells how)."""
        ray, job = self._ray, self.config
        deadline = time.monotonic() + job.start_timeout
        while len(self.incarnations()) < job.workers:
            ready, _ = ray.wait(list(self._trains), timeout=POLL_SECONDS)
            if ready:
                return
            if time.monotonic() > deadline:
                raise AsyncSGDError(f"the workers did not begin within {job.start_timeout:g} s "
                                    "(--start-timeout)")

    def _worker_settings(self, rank: int):
        job = self.config
        node = self._places[rank]["node"]
        local = sum(1 for key, p in self._places.items() if key != "server" and p["node"] == node)
        cfg = worker_settings(job, self.address, rank, job.workers)
        return dataclasses.replace(cfg, local_workers=local)

    # ---- while it runs -----------------------------------------------------------------

    def incarnations(self) -> dict:
        """Each worker's starts so far, by rank: [{"pid", "node", "ip", "at"}, ...], the
        latest last (``at``: its wall-clock time)."""
        if self._ledger is not None and not self._closed:
            self._starts = self._ray.get(self._ledger.starts.remote())
        return {rank: list(starts) for rank, starts in self._starts.items()}

    def restarts(self) -> dict:
        """How often Ray restarted each worker's actor so far, by rank."""
        starts = self.incarnations()
        return {rank: max(0, len(starts.get(rank, [])) - 1)
                for rank in range(self.config.workers)}

    def wait(self) -> RayJobResult:
        """Wait for the job's end (the server's stop condition: --target, --max-seconds,
        every worker done), then clean up (``close``). On Ctrl-C (or SIGTERM, when called in
        the main thread) the workers are killed and the server saves its run, whose
        summary says ``interrupted``. A worker or server that failed for good raises
        ``AsyncSGDError`` (Ray's own error for a bug, with the actor's traceback)."""
        try:
            try:
                with sigterm_as_interrupt():
                    self._watch()
            except KeyboardInterrupt:
                log.warning("ray-job: interrupted; stopping the workers, and the server, which "
                            "saves its run")
                self._stop()
            if self._server_result is None:
                raise AsyncSGDError(f"the server's actor ended without its run; see "
                                    f"{self.run_dir}")
            restarts = self.restarts()
            return RayJobResult(self._server_result.run_dir, self._server_result.summary,
                                {rank: self._results.get(rank)
                                 for rank in range(self.config.workers)}, restarts)
        finally:
            self.close()

    def _watch(self) -> None:
        ray = self._ray
        pending = dict(self._trains)
        ended = None  # when the server's call returned
        looked = time.monotonic()
        while pending or self._server_result is None:
            refs = list(pending) + ([self._serve_ref] if self._server_result is None else [])
            ready, _ = ray.wait(refs, num_returns=1, timeout=POLL_SECONDS)
            for ref in ready:
                if ref == self._serve_ref:
                    try:
                        self._server_outcome()
                    except Exception as exc:
                        self._kill_workers()
                        raise self._stopped(exc) from None
                    ended = time.monotonic()
                else:
                    self._worker_outcome(pending.pop(ref), ref, ended is not None)
            if ended is not None and pending and time.monotonic() - ended > WORKER_GRACE:
                for rank in pending.values():
                    log.warning("ray-job: worker %d did not end within %.0f s of the server; "
                                "stopping it", rank, WORKER_GRACE)
                self._kill_workers()
                pending.clear()
            if time.monotonic() - looked > LEDGER_EVERY and self._server_result is None:
                looked = time.monotonic()
                self._log_restarts()

    def _log_restarts(self) -> None:
        before = {rank: len(s) for rank, s in self._starts.items()}
        for rank, starts in self.incarnations().items():
            for n in range(max(1, before.get(rank, 0)), len(starts)):
                log.warning("ray-job: Ray restarted worker %d (pid %d on %s): incarnation %d",
                            rank, starts[n]["pid"], starts[n]["ip"], n + 1)

    def _server_outcome(self) -> RunResult:
        try:
            self._server_result = self._ray.get(self._serve_ref)
        except Exception as exc:  # noqa: BLE001 - whatever Ray raises for a failed call
            raise self._failure(exc, "the server") from None
        return self._server_result

    def _worker_outcome(self, rank: int, ref, server_ended: bool) -> None:
        try:
            self._results[rank] = self._ray.get(ref)
            return
        except Exception as exc:  # noqa: BLE001 - whatever Ray raises for a failed call
            failure = self._failure(exc, f"worker {rank}", dead=(
                f"worker {rank}'s actor died and Ray restarted it {self.restarts()[rank]} "
                f"time(s) of --max-restarts {self.config.max_restarts}"))
        if server_ended:  # it could not reach the server that had just ended: nothing lost
            log.warning("ray-job: after the server ended: %s", failure)
            return
        self._stop()
        raise self._stopped(failure) from None

    def _failure(self, exc: Exception, who: str, dead: Optional[str] = None) -> Exception:
        """What to raise for ``who``'s failed call: its ``AsyncSGDError`` (a message for the
        user), a dead actor in one line, or else Ray's own error, which holds the actor's
        traceback (a bug)."""
        cause = getattr(exc, "cause", None)
        if isinstance(cause, _Carried):
            kind, message, code = cause.args
            cls = getattr(errors, kind, None)
            if isinstance(cls, type) and issubclass(cls, AsyncSGDError) and kind != "WorkerError":
                return cls(f"{who}: {message}")
            error = AsyncSGDError(f"{who}: {message}")
            error.exit_code = code
            return error
        if isinstance(exc, self._ray.exceptions.RayActorError):
            reason = (str(exc).strip().splitlines() or ["no reason given"])[0].rstrip(".")
            return AsyncSGDError(f"{dead or who + ' died'} ({reason})")
        return exc

    def _stopped(self, failure: Exception) -> Exception:
        """``failure``, saying that the job stopped and how to continue its run."""
        said = "the job stopped"
        if self.run_dir and RunDir(self.run_dir).checkpoint.is_file():
            said += f"; continue its run with: asyncsgd ray-job --resume {self.run_dir}"
        if isinstance(failure, AsyncSGDError):
            failure.args = (f"{failure}; {said}",)
        else:
            log.error("ray-job: %s", said)
        return failure

    # ---- stopping ----------------------------------------------------------------------

    def _stop(self) -> None:
        """Stop the server with SIGTERM: it tells the live workers to end, drains and saves
        its run, which the job keeps. Then kill what is left of the workers."""
        try:
            self._stop_server()
        finally:
            self._kill_workers()

    def _stop_server(self) -> None:
        if self._serve_ref is None or self._server_result is not None:
            return
        ray = self._ray
        ready, _ = ray.wait([self._serve_ref], timeout=0)
        if not ready:
            try:
                os.kill(self._places["server"]["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
            ready, _ = ray.wait([self._serve_ref], timeout=STOP_SECONDS)
        if not ready:
            log.warning("ray-job: the server did not stop within %.0f s of SIGTERM; killing "
                        "it", STOP_SECONDS)
            return
        try:
            self._server_outcome()
        except Exception as exc:  # noqa: BLE001 - stopping already: say it, stop the rest
            log.warning("ray-job: while stopping: %s", exc)

    def _kill_workers(self) -> None:
        for actor in self._workers:
            _kill(self._ray, actor)

    def close(self) -> None:
        """Kill every actor of the job, wait for their processes on this node to be gone,
        and shut down Ray if this job started it (or connected to it). Idempotent."""
        if self._closed:
            return
        ray = self._ray
        try:
            if ray.is_initialized():
                try:
                    if self._ledger is not None:
                        self.incarnations()  # the pids of restarted workers, to await
                except Exception as exc:  # noqa: BLE001 - the ledger may be gone
                    log.debug("ray-job: no ledger to read: %s", exc)
                self._closed = True
                for actor in (*self._workers, self._server, self._ledger):
                    _kill(ray, actor)
                _await_gone(self._local_pids())
        finally:
            self._closed = True
            if self._ours:
                ray.shutdown()
            if self._output is not None:
                self._output.restore()

    def _local_pids(self) -> list:
        server = self._places.get("server")
        if server is None:
            return []
        places = list(self._places.values()) + [p for starts in self._starts.values()
                                                for p in starts]
        return sorted({p["pid"] for p in places if p["node"] == server["node"]})

    def __enter__(self) -> "RayJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- the actors (made remote by the driver: this module imports without Ray) ------------

def _prepare(level: int, origin: float) -> None:
    """An actor logs as the driver does, counts --max-seconds from the job's start, and
    leaves Ctrl-C to the driver: a terminal's reaches every process of its group, which
    the actors are in with some Ray versions (2.9; 2.60 gives each its own group), and the
    driver stops the job in order (a server interrupted while it saves would lose its run
    to the SIGTERM the driver sends next)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger().setLevel(level)
    start_command_clock(time.monotonic() - max(0.0, time.time() - origin))


def _place() -> dict:
    import ray
    return {"node": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "cores": available_cores()}


class AsyncSGDLedger:
    def __init__(self):
        self._server = None
        self._starts: dict = {}
        self._seen: dict = {}

    def publish(self, address: str, run_dir: str) -> None:
        self._server = (address, run_dir)

    def server(self) -> Optional[tuple]:
        return self._server

    def started(self, rank: int, place: dict) -> Optional[list]:
        """Worker ``rank`` starts (again): the shard versions its previous incarnation saw."""
        self._starts.setdefault(rank, []).append({**place, "at": time.time()})
        return self._seen.get(rank)

    def saw(self, rank: int, versions: list) -> None:
        self._seen[rank] = [int(v) for v in versions]

    def starts(self) -> dict:
        return self._starts


class AsyncSGDServer:
    def __init__(self, cwd: str, level: int, origin: float):
        _prepare(level, origin)
        os.chdir(cwd)  # on the driver's node: the run directory lands beside the driver

    def where(self) -> dict:
        return _place()

    def serve(self, cfg: ServerConfig, ledger, advertise: str, beside: int) -> RunResult:
        import ray

        from ..servers.server import serve

        def publish(endpoint: str, run_dir: str) -> None:
            _, port = parse_endpoint(endpoint, "--bind")
            ray.get(ledger.publish.remote(f"tcp://{advertise}:{port}", run_dir))

        with _carried():
            return serve(cfg, on_listening=publish, beside=beside)


class AsyncSGDWorker:
    def __init__(self, rank: int, level: int, origin: float):
        _prepare(level, origin)
        self.rank = rank

    def where(self) -> dict:
        return _place()

    def train(self, cfg, ledger):
        import ray

        from ..workers.worker import run_worker
        seen = ray.get(ledger.started.remote(self.rank, _place()))

        def saw(versions: list) -> None:
            try:
                ray.get(ledger.saw.remote(self.rank, versions), timeout=10)
            except Exception as exc:  # noqa: BLE001 - best effort, as torchrun's store is
                log.warning("could not record worker %d's shard versions: %s", self.rank, exc)

        with _carried():
            return run_worker(cfg, seen=seen, on_exit=saw)


class _Carried(Exception):
    """An ``AsyncSGDError`` crossing from an actor to the driver as plain values (not every
    such error can be pickled as it is: ``WorkerError`` takes two arguments)."""

    def __init__(self, kind: str, message: str, exit_code: int):
        super().__init__(kind, message, exit_code)


@contextlib.contextmanager
def _carried():
    try:
        yield
    except AsyncSGDError as exc:
        raise _Carried(type(exc).__name__, str(exc), exc.exit_code) from None


def _kill(ray, actor) -> None:
    if actor is None:
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # noqa: BLE001 - already dead, or Ray is going
        log.debug("ray-job: kill: %s", exc)


def _await_gone(pids: list, timeout: float = GONE_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if pid_alive(pid)]
        if alive:
            time.sleep(0.05)
    if alive:
        log.warning("ray-job: actor process(es) %s still running %.0f s after being killed",
                    alive, timeout)


def _check_reachable(address: str, timeout: float = 10.0) -> None:
    """Fail at once for a head ``HOST:PORT`` that does not answer: Ray itself would retry
    for minutes (``--address 127.0.0.1:1`` still waited after 2 minutes here)."""
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit()):
        return  # 'auto' and the like: Ray looks for the cluster itself
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise AsyncSGDError(f"cannot reach the Ray cluster at {address} (--address, "
                            f"$RAY_ADDRESS): {exc}; is Ray running there ('ray start "
                            "--head')?") from None


def _name(key) -> str:
    return "the server" if key == "server" else f"worker {key}"


def _resources(job: RayJobConfig) -> str:
    gpus = f" and {job.gpus_per_worker:g} GPU(s)" if job.gpus_per_worker else ""
    return f"{job.cpus_per_worker:g} CPU(s){gpus}"


def _describe(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU")}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items())) or "nothing"
