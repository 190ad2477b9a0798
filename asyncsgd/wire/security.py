"""Authenticated, encrypted transport: ZeroMQ CURVE keys, a ZAP handler, handshake accounting.

    asyncsgd keygen keys --clients 2
    asyncsgd ps-server --curve-secret keys/server.key_secret --allowed-clients keys/allowed_clients

A ``Gatekeeper`` thread in each serving process admits exactly the public keys in
``--allowed-clients`` (ZeroMQ RFC 27) and counts refused handshakes for the server's stats.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from ..errors import ConfigError, SecurityError
from .greeting import HangUps, misfit
from .waiting import Waiting

log = logging.getLogger(__name__)

MIN_LIBZMQ = (4, 3, 3)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27: libzmq asks whoever binds it
ZAP_DOMAIN = b"asyncsgd"
SERVER_NAME = "server"
ALLOWED_DIR = "allowed_clients"
CLIENT_SECRETS_DIR = "clients"
LOOPBACK = ("127.", "localhost", "::1", "[::1]")
GATE_POLL_MS = 100
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH |
                    zmq.EVENT_DISCONNECTED)
MECHANISM_MISMATCH = 0x11000002  # ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
PROBE_FAILURES = 10  # a NULL client often sees the socket closed before the mismatch


def curve_problem(version: Optional[tuple] = None, has_curve: Optional[bool] = None) -> str:
    """Why CURVE can't be used with this libzmq ("" when it can)."""
    version = zmq.zmq_version_info() if version is None else tuple(version)
    has_curve = zmq.has("curve") if has_curve is None else has_curve
    built = ".".join(map(str, version))
    if not has_curve:
        return (f"libzmq {built} was built without CURVE (libsodium); install a pyzmq wheel "
                "from PyPI, which bundles a libzmq with CURVE")
    if version < MIN_LIBZMQ:
        return (f"libzmq {built} is older than {'.'.join(map(str, MIN_LIBZMQ))} and has known "
                "CURVE vulnerabilities (CVE-2020-15166); upgrade pyzmq/libzmq")
    return ""


def require_curve() -> None:
    # libzmq before 4.3.3 has CURVE vulnerabilities (CVE-2020-15166 and others)
    problem = curve_problem()
    if problem:
        raise SecurityError(f"CURVE authentication is unavailable: {problem}")


def _check_secret_file(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s holds a secret key and is readable by other users; chmod 600 %s",
                    path, path)


def _read_cert(path: str, flag: str, need_secret: bool) -> tuple:
    """(public, secret) from a zmq.auth certificate, or a ConfigError naming the flag."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file; create keys with 'asyncsgd keygen DIR'")
    try:
        public, secret = zmq.auth.load_certificate(file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag} {path} is not a zmq certificate: {exc}") from None
    for key in (public, secret) if secret else (public,):
        if len(key) != 40 or len(z85.decode(key)) != 32:
            raise ConfigError(f"{flag} {path}: a key is not 40 z85 characters (32 bytes)")
    if need_secret and not secret:
        raise ConfigError(f"{flag} {path} holds no secret key; pass the .key_secret file "
                          "'asyncsgd keygen' wrote")
    if need_secret:
        _check_secret_file(file)
    return public, secret


def _both_or_neither(first: Optional[str], second: Optional[str], why: str) -> bool:
    """True when both flags of a pair are given (and CURVE is usable), False when neither."""
    if not first and not second:
        return False
    if not (first and second):
        raise ConfigError(why)
    require_curve()
    return True


@dataclass(frozen=True)
class ServerKeys:
    """The server's key pair and the client public keys it admits."""

    public: bytes
    secret: bytes
    allowed: frozenset

    @classmethod
    def load(cls, secret_file: Optional[str], allowed_dir: Optional[str]) -> Optional["ServerKeys"]:
        """Keys from ``--curve-secret`` and ``--allowed-clients``; None when neither is given."""
        if not _both_or_neither(secret_file, allowed_dir, "--curve-secret and --allowed-clients "
                                "go together: the server needs its own secret key and the "
                                "public keys of its workers"):
            return None
        public, secret = _read_cert(secret_file, "--curve-secret", need_secret=True)
        folder = Path(allowed_dir)
        if not folder.is_dir():
            raise ConfigError(f"--allowed-clients {allowed_dir}: not a directory of *.key files")
        allowed = set()
        for cert in sorted(folder.glob("*.key")):
            allowed.add(_read_cert(str(cert), "--allowed-clients", need_secret=False)[0])
        if not allowed:
            raise ConfigError(f"--allowed-clients {allowed_dir} holds no *.key public keys; "
                              "'asyncsgd keygen DIR --clients N' writes them")
        return cls(public, secret, frozenset(allowed | {public}))

    def apply(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, don't admit all
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def as_client(self) -> "ClientKeys":
        """The server's own processes (the evaluator) reach the shards with the server's key."""
        return ClientKeys(self.public, self.public, self.secret)


@dataclass(frozen=True)
class ClientKeys:
    """What a worker needs: the server's public key and its own key pair."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_key_file: Optional[str],
             secret_file: Optional[str]) -> Optional["ClientKeys"]:
        """Keys from ``--curve-server-key`` and ``--curve-secret``; None when neither is given."""
        if not _both_or_neither(server_key_file, secret_file, "--curve-server-key and "
                                "--curve-secret go together: the server's public key and this "
                                "worker's secret key"):
            return None
        server_public, _ = _read_cert(server_key_file, "--curve-server-key", need_secret=False)
        public, secret = _read_cert(secret_file, "--curve-secret", need_secret=True)
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


@contextlib.contextmanager
def _private_umask():
    old = os.umask(0o077)  # secret files are never readable by others, not even briefly
    try:
        yield
    finally:
        os.umask(old)


def keygen(directory: str, clients: Iterable[str], force: bool = False) -> dict:
    """Write a server key pair (kept if present) and one key pair per client name.

    Layout (the paths the flags take)::

        DIR/server.key                      public: every worker's --curve-server-key
        DIR/server.key_secret               the server's --curve-secret
        DIR/allowed_clients/NAME.key        public: the server's --allowed-clients DIR
        DIR/clients/NAME.key_secret         that worker's --curve-secret
    """
    require_curve()
    root = Path(directory)
    allowed, secrets = root / ALLOWED_DIR, root / CLIENT_SECRETS_DIR
    names = list(clients)
    bad = [n for n in names if not n or "/" in n or n.startswith(".")]
    if bad:
        raise ConfigError(f"client name(s) {bad} are not plain file names")
    written = {"server": None, "clients": []}
    with _private_umask():
        for folder in (root, allowed, secrets):
            folder.mkdir(parents=True, exist_ok=True)
        server_secret = root / f"{SERVER_NAME}.key_secret"
        if force or not server_secret.exists():
            zmq.auth.create_certificates(root, SERVER_NAME)
            written["server"] = str(server_secret)
        for name in names:
            if (allowed / f"{name}.key").exists() and not force:
                raise ConfigError(f"a key for client {name!r} exists in {allowed}; choose "
                                  "another name or pass --force to replace it")
            public, _ = zmq.auth.create_certificates(secrets, name)
            os.replace(public, allowed / f"{name}.key")
            written["clients"].append(str(secrets / f"{name}.key_secret"))
    for public in [root / f"{SERVER_NAME}.key", *allowed.glob("*.key")]:
        public.chmod(0o644)  # public keys are meant to be handed out
    return written


def exposed_warning(host: str, keys: Optional[ServerKeys]) -> str:
    """The start-up warning for a server that anyone on the network may use ("" if none)."""
    if keys is not None or host.startswith(LOOPBACK):
        return ""
    return (f"WARNING: this server listens on {host} WITHOUT authentication or encryption: "
            "anyone who can reach it can read the parameters and push gradients. Use it only "
            "on a trusted network, or turn on CURVE: 'asyncsgd keygen keys', then "
            "--curve-secret keys/server.key_secret --allowed-clients keys/allowed_clients")


class Gatekeeper:
    """A thread that admits CURVE clients (ZAP) and counts handshakes on watched sockets.

    It admits the keys in ``--allowed-clients`` and the server's own (for its
    evaluator). The sockets set ZAP_ENFORCE_DOMAIN, so if this handler were ever gone
    libzmq would refuse every client rather than let them all in. The same thread reads
    the sockets' monitor events and counts refused handshakes (unknown key, wrong server
    key, no key, garbage).

    Create it before binding any socket of ``ctx`` (libzmq asks the ZAP handler
    bound at connection time); ``watch`` a socket after binding it; ``close``
    before closing the watched sockets and terminating the context.
    """

    def __init__(self, ctx: zmq.Context, keys: Optional[ServerKeys]):
        self.ctx, self.keys = ctx, keys
        self.counts = {"authenticated": keys is not None, "handshakes": 0,
                       "refused_unknown_key": 0, "refused_protocol": 0,
                       "refused_incomplete": 0, "disconnects": 0}
        self._watched: list = []
        self._monitors: list = []  # appended by the owner's thread, read by the gate's
        self._stop = threading.Event()
        self._zap = None
        if keys is not None:
            self._zap = ctx.socket(zmq.ROUTER)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, daemon=True, name="asyncsgd-gatekeeper")
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        address = f"inproc://asyncsgd-monitor-{id(self)}-{len(self._watched)}"
        sock.monitor(address, HANDSHAKE_EVENTS)
        pair = self.ctx.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(address)
        self._watched.append(sock)
        self._monitors.append(pair)

    def stats(self) -> dict:
        refused = sum(self.counts[k] for k in ("refused_unknown_key", "refused_protocol",
                                               "refused_incomplete"))
        return {**self.counts, "refused": refused}

    def _run(self) -> None:
        poller, registered = zmq.Poller(), 0
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        while not self._stop.is_set():
            while registered < len(self._monitors):
                poller.register(self._monitors[registered], zmq.POLLIN)
                registered += 1
            if not poller.sockets:  # an empty Poller returns at once: no busy loop meanwhile
                self._stop.wait(GATE_POLL_MS / 1000)
                continue
            for sock, _ in poller.poll(GATE_POLL_MS):
                if sock is self._zap:
                    self._answer_zap()
                else:
                    self._count(sock)

    def _answer_zap(self) -> None:
        frames = self._zap.recv_multipart()
        # [routing id, empty, version, request id, domain, address, identity, mechanism, creds...]
        if len(frames) < 8 or frames[2] != b"1.0":
            return  # not a ZAP request libzmq would send; nothing sensible to answer
        peer, request_id, address, mechanism = frames[0], frames[3], frames[5], frames[7]
        key = z85.encode(frames[8]) if mechanism == b"CURVE" and len(frames) > 8 else None
        admitted = key is not None and key in self.keys.allowed
        if not admitted:
            log.warning("refused a client from %s: %s", address.decode(errors="replace"),
                        "unknown CURVE key" if key else f"mechanism {mechanism!r}")
        status, text = (b"200", b"OK") if admitted else (b"400", b"unknown client key")
        self._zap.send_multipart([peer, b"", b"1.0", request_id, status, text,
                                  key or b"", b""])

    def _count(self, pair: zmq.Socket) -> None:
        event = parse_monitor_message(pair.recv_multipart())["event"]
        key = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "handshakes",
               zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused_unknown_key",
               zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "refused_protocol",
               zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "refused_incomplete",
               zmq.EVENT_DISCONNECTED: "disconnects"}.get(event)
        if key:
            self.counts[key] += 1  # only this thread writes; readers copy

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self._watched:
            if not sock.closed:
                sock.disable_monitor()
        for sock in [*self._monitors, self._zap]:
            if sock is not None:
                sock.close(0)


def await_handshake(ctx: zmq.Context, endpoint: str, keys: Optional[ClientKeys],
                    timeout: float) -> bool:
    """Connect a probe to ``endpoint`` and wait for the ZMTP handshake.

    True once it succeeds; False when nothing answered within ``timeout`` (the
    server may not be up yet: the caller's retries handle that). Raises
    ``SecurityError`` with the fix when the server refuses us, so a worker with
    the wrong keys fails in a second with a clear message instead of retrying
    until --server-timeout.
    """
    from .transport import dealer
    probe = dealer(ctx, endpoint, curve=keys, connect_now=False)
    monitor = probe.get_monitor_socket(HANDSHAKE_EVENTS)
    probe.connect(endpoint)
    mismatch = f"the server at {endpoint} " + (
        "does not use CURVE but this worker does: drop --curve-server-key and "
        "--curve-secret, or start the server with --curve-secret" if keys else
        "requires CURVE authentication: pass --curve-server-key SERVER.key and "
        "--curve-secret WORKER.key_secret (from 'asyncsgd keygen')")
    deadline = time.monotonic() + timeout
    hang_ups = HangUps(endpoint, deadline)
    waiting = Waiting(endpoint, timeout, time.monotonic())
    try:
        while True:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return False
            line = waiting.due(now) if waiting else None
            if line:
                log.warning(line)
            wait = min(left, waiting.until_due(now)) if waiting else left
            if not monitor.poll(int(wait * 1000) + 1):
                continue
            event = parse_monitor_message(monitor.recv_multipart())
            waiting = None  # something answers there: what it says decides, not the wait
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return True
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise SecurityError(
                    f"the server at {endpoint} refused this worker's key (CURVE status {value}): "
                    "add its public key (allowed_clients/NAME.key from 'asyncsgd keygen') to the "
                    "server's --allowed-clients directory and restart the server")
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == MECHANISM_MISMATCH:
                raise SecurityError(mismatch)
            if kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                # libzmq may show a mismatch only as hang-ups (under load, every time:
                # greeting.py); the server's greeting names its mechanism
                if hang_ups.hung_up() == misfit(keys is not None):
                    raise SecurityError(mismatch)
                if hang_ups.count >= PROBE_FAILURES:
                    raise SecurityError(
                        f"the server at {endpoint} closes the connection during the handshake"
                        + (": --curve-server-key is probably not this server's public key "
                           "(server.key from 'asyncsgd keygen')" if keys else
                           ": it probably requires CURVE authentication (pass --curve-server-key "
                           "and --curve-secret), or it is not an asyncsgd server"))
    finally:
        probe.disable_monitor()
        monitor.close(0)
        probe.close(0)
