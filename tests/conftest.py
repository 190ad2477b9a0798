"""Shared helpers: run the installed CLI as a subprocess (or in this process, for what it
refuses) and read what it wrote, and start parameter servers and workers (plain and CURVE)
the way a user does. tiers.py sorts the tests into the fast tier and the rest."""

import contextlib
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from tiers import classify, guard

from asyncsgd import cli
from asyncsgd.config import ServerConfig
from asyncsgd.core.tasks import load_task
from asyncsgd.run.checkpoint import load_checkpoint
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import BYE, HELLO, STATS, WELCOME, Key, Message, decode, encode
from asyncsgd.wire.security import ClientKeys

TESTS = Path(__file__).parent
BIN = Path(sys.executable).parent

# Tests send SIGINT as a terminal's Ctrl-C does. A shell that starts the suite in the
# background (no job control) makes it ignore SIGINT, and an ignored signal stays ignored in
# every process started from it: the tests' own processes get Python's handling back.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(items):
    classify(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from guard(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from guard(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from guard(item))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")



def marked_processes(mark):
    """Live processes started under a test's marker $ASYNCSGD_TEST_MARK (children inherit
    the environment, through `ip netns exec` too)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("ASYNCSGD_TEST_MARK") == mark:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found

@pytest.fixture
def cli_env(cache_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["ASYNCSGD_CACHE"] = str(cache_dir)
    return env


def asyncsgd_cmd(*args):
    exe = BIN / "asyncsgd"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "asyncsgd"]
    return base + [str(a) for a in args]


@pytest.fixture
def run_cli(cli_env):
    def run(*args, timeout=240, **kw):
        return subprocess.run(asyncsgd_cmd(*args), env=cli_env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL, **kw)
    return run


@pytest.fixture
def run_cli_here(cache_dir, monkeypatch):
    """``run_cli`` without the subprocess: the command runs in this process (``cli._run``),
    for what the CLI refuses before it starts anything. The result holds what the installed
    command would print: its log lines, and its warnings under Python's default filters."""
    monkeypatch.setenv("ASYNCSGD_CACHE", str(cache_dir))
    monkeypatch.setenv("COLUMNS", "80")  # click wraps --help as it does for a pipe

    def run(*args, env=None):
        argv = [str(a) for a in args]
        out, err = io.StringIO(), io.StringIO()
        root, threads = logging.getLogger(), torch.get_num_threads()
        level, handler = root.level, logging.StreamHandler(err)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))  # cli._verbose's
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        with monkeypatch.context() as patch, warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            warnings.resetwarnings()  # Python's defaults, not pytest's
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                             ResourceWarning):
                warnings.simplefilter("ignore", category)
            root.addHandler(handler)
            try:
                code = cli._run(argv)
            finally:
                root.removeHandler(handler)
                root.setLevel(level)
                torch.set_num_threads(threads)
                for sig, was in handlers.items():
                    signal.signal(sig, was)
        for w in caught:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))
        return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    return run


def read_events(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_json(path):
    with open(path) as fh:
        return json.load(fh)


def start_training(cmd, out, env, wait=120):
    """Start a training command in its own session; return it once it has trained a step."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        if (out / "metrics.jsonl").exists() and any(
                e["event"] == "train" for e in read_events(out)):
            return proc
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    pytest.fail("training never started")


def signal_group(sig):
    """An ``act`` for ``stop_tree``: ``sig`` to the whole process group, as a terminal's
    Ctrl-C reaches it."""
    return lambda proc, children: os.killpg(proc.pid, sig)


def signal_parent(sig):
    """An ``act`` for ``stop_tree``: ``sig`` to the parent only, as ``kill`` sends it."""
    return lambda proc, children: proc.send_signal(sig)


def stop_tree(proc, act, timeout=60, orphan_wait=10):
    """Do ``act(proc, descendants)`` to a running process tree (started by
    ``start_training``) and wait for the parent to exit; the group is SIGKILLed if it does
    not. Asserts no descendant outlives it. Returns (stdout, stderr, seconds from the act
    to the exit, descendants)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        act(proc, children)
        acted = time.monotonic()
        stdout, stderr = proc.communicate(timeout=timeout)
        took = time.monotonic() - acted
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=orphan_wait)
    assert not alive, f"orphans left: {alive}"
    return stdout, stderr, took, children


def shm_entries() -> set:
    """Names in /dev/shm now (POSIX shared memory and named semaphores, ``sem.*``)."""
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def _mapped_shm() -> set:
    """/dev/shm entries some live process maps: in use, not leaked."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            names.update(line.split("/dev/shm/", 1)[1].split()[0]
                         for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except OSError:  # the process ended, or is not ours to read
            pass
    return names


def assert_no_shm_leak(before: set) -> None:
    """Nothing new in /dev/shm (since ``shm_entries()`` gave ``before``) that no process
    maps. Other test runs on this machine create entries of their own meanwhile; those
    are mapped by their live processes."""
    def leaked():
        new = shm_entries() - before
        return new - _mapped_shm() if new else set()

    deadline = time.monotonic() + 10
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.2)  # the resource tracker unlinks what a dead process held
    assert leaked() == set()


def one_line_error(res, *fragments):
    """A command that failed with exactly one ``error: ...`` line holding every fragment."""
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


# ---- parameter servers and workers ----------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cli_env, out, *args, port=None, own_group=False):
        """``port``: the front's (a free one by default); ``own_group``: the server and its
        shards in a process group of their own, which a test may kill whole."""
        self.port = port or free_port()
        self.args = [str(a) for a in args]
        self.tokens: dict = {}  # (worker, incarnation) -> session token, for hand-made peers
        self._signature = None
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.out = out
        where = [] if "--resume" in args else ["--out", out]
        self.proc = subprocess.Popen(
            asyncsgd_cmd("ps-server", "--bind", self.address, *where, "--progress", "off",
                         "--eval-every", 0.5, *args),
            env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL, start_new_session=own_group)
        self.ctx = zmq.Context()
        # One socket, asked again every 0.5 s: a socket closed mid-handshake is counted by the
        # server as a refused connection (ps-stats failed in CI on 1 refusal where 0 was due).
        sock = self._dealer()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.proc.communicate()
                sock.send_multipart(encode(Message(type=STATS, seq=1)))
                if sock.poll(500):
                    return
            raise AssertionError("server did not come up")
        finally:
            sock.close()

    def _dealer(self, port=None) -> zmq.Socket:
        """A DEALER to the front (or to ``port``), with this server's keys where it has any."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if getattr(self, "curve", None) is not None:  # a CURVE server (test_security.py)
            self.curve.apply(sock)
        sock.connect(f"tcp://127.0.0.1:{port or self.port}")
        return sock

    def request(self, frames, port=None, timeout=5.0):
        sock = self._dealer(port)
        try:
            sock.send_multipart(frames)
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError
            return decode(sock.recv_multipart())
        finally:
            sock.close()

    def signature(self) -> dict:
        """The model signature of the task this server was started with."""
        if self._signature is not None:
            return self._signature

        def arg(flag, default=None):
            return self.args[self.args.index(flag) + 1] if flag in self.args else default
        samples = arg("--samples")
        task = load_task(arg("--task", ServerConfig().task),
                         samples=int(samples) if samples else None)
        model = task.build_model(0)
        self._signature = Layout.of(model, task.served_tables(
            model, arg("--embeddings", "sparse"))).signature()
        return self._signature

    def admit(self, worker: str, incarnation: int = 1) -> str:
        """Say hello to the front as ``worker``/``incarnation``, as a worker does: the
        session token its welcome hands out, which the shards ask for."""
        reply = self.request(encode(Message(type=HELLO, worker=worker, incarnation=incarnation,
                                            seq=1, meta={Key.SIGNATURE: self.signature()})))
        assert reply.type == WELCOME, reply
        return reply.meta[Key.TOKEN]

    def stats(self, timeout=5.0):
        return self.request(encode(Message(type=STATS, seq=1)), timeout=timeout).meta

    def wait(self, timeout=120):
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def goodbyes(self, timeout: float = 2.0) -> None:
        """Each hand-made peer admitted through ``admit`` says bye to every shard (as its
        newest incarnation) and to the front, as a worker does when it ends: a stopping
        shard tells every worker it still counts that the run is over, and waits up to 8 s
        for one that never asks again (the teardown of 21 tests took 8.4 s each, against
        1.9 s); and it answers stragglers for 1.5 s unless every worker the front welcomed
        has left."""
        if not self.tokens or self.proc.poll() is not None:
            return
        try:
            ports = self.stats(timeout=timeout)["shard_ports"]
        except TimeoutError:
            return
        newest = {}
        for (worker, incarnation), token in sorted(self.tokens.items()):
            newest[worker] = (incarnation, token)
        deadline = time.monotonic() + timeout
        for port in [*ports, None]:  # None: the front
            sock = self._dealer(port)
            try:
                for seq, (worker, (incarnation, token)) in enumerate(newest.items(), 1):
                    sock.send_multipart(encode(Message(type=BYE, worker=worker, seq=seq,
                                                       incarnation=incarnation, token=token)))
                for _ in newest:  # an answer each, or the time is up
                    if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                        break
                    sock.recv_multipart()
            finally:
                sock.close()

    def close(self):
        self.goodbyes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # destroy, not term: it closes the sockets a test left open (term would wait on them)
        self.ctx.destroy(linger=0)


@pytest.fixture
def server(cli_env, tmp_path):
    started = []

    def start(*args):
        started.append(Server(cli_env, tmp_path / f"server{len(started)}", *args))
        return started[-1]

    yield start
    for s in started:
        s.close()


def worker(cli_env, address, rank, world, *args):
    return subprocess.Popen(
        asyncsgd_cmd("worker", "--server", address, "--rank", rank, "--world", world,
                     "--threads", 1, "--progress", "off", *args),
        env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL)


def finish(procs, timeout=180):
    results = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        results.append((p.returncode, out, err))
    return results


class CurveServer(Server):
    """A ps-server with CURVE on; the test's own requests use worker-0's key."""

    def __init__(self, cli_env, out, keys, *args, **kw):
        self.curve = ClientKeys.load(keys / "server.key", keys / "clients" / "worker-0.key_secret")
        super().__init__(cli_env, out, "--curve-secret", keys / "server.key_secret",
                         "--allowed-clients", keys / "allowed_clients", *args, **kw)


@pytest.fixture
def keys(run_cli_here, tmp_path):
    """Two independent key sets: ours and a stranger's."""
    made = []
    for name in ("keys", "stranger"):
        res = run_cli_here("keygen", tmp_path / name, "--clients", 1)
        assert res.returncode == 0, res.stderr
        assert "worker --curve-secret" in res.stdout
        made.append(tmp_path / name)
    return made


def periodic_checkpoint(run_dir, index: int = 0) -> bool:
    """Shard ``index`` of the server in ``run_dir`` saved a checkpoint after updates (each
    saves version 0 as it starts serving; a later one has a version above 0)."""
    path = Path(run_dir) / f"shard-{index}.pt"
    return path.exists() and load_checkpoint(path)["shard"]["version"] > 0


def shard_stats(srv, port: int) -> dict:
    return srv.request(encode(Message(type=STATS, seq=1)), port=port).meta


def wait_for(predicate, timeout: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
