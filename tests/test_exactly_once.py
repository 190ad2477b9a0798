"""Exactly once, through incarnations, far-apart sequence numbers and a shard SIGKILL in sync
mode; and peers that say a malformed or lying hello. A live ps-server and hand-made peers
written from PROTOCOL.md; SGD with lr 1 from zeros, so every weight must equal minus the sum
of exactly the pushes acknowledged as applied.
"""

import os
import signal
import time

import msgpack
import torch
import zmq

from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import (ACK, ERROR, HEARTBEAT, HELLO, PULL, PUSH, WELCOME, Key,
                                    VERSION, Message, Segment, decode, encode)
from conftest import shard_stats, wait_for
from faults import observe
from asyncsgd.servers.dedupe import DUPLICATE, FRESH, OUT_OF_WINDOW, STALE_AGAIN, SeqWindow
from tasks_for_tests import index_counter

TASK = "tasks_for_tests:index_counter"
SIZE = 16


def restarted(srv, port, pid) -> bool:
    """True once the shard on ``port`` answers from a process other than ``pid``."""
    try:
        return shard_stats(srv, port)["pid"] != pid
    except TimeoutError:
        return False


def kill_shard(srv, port, checkpointed_after: float = None) -> None:
    """SIGKILL the shard on ``port`` (once shard 0 has checkpointed after the time
    ``checkpointed_after``, when given) and wait until its restart answers there."""
    if checkpointed_after is not None:
        checkpoint = srv.out / "shard-0.pt"
        wait_for(lambda: checkpoint.exists() and
                 checkpoint.stat().st_mtime > checkpointed_after + 0.1, 60,
                 "a checkpoint of the state to restore")
    pid = shard_stats(srv, port)["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: restarted(srv, port, pid), 60, "the restarted shard", 0.2)


class Peer:
    """One DEALER to a shard (or the front), speaking for worker ``worker``: admitted by
    the front, as a worker is, the first time it speaks for a (worker, incarnation)."""

    def __init__(self, srv, port: int, worker: str = "w", incarnation: int = 1, shard: int = 0):
        self.srv, self.shard = srv, shard  # a push names the shard it is for
        self.sock = srv.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.worker, self.incarnation = worker, incarnation

    def token(self, incarnation: int) -> str:
        key = (self.worker, incarnation)
        if key not in self.srv.tokens:
            self.srv.tokens[key] = self.srv.admit(self.worker, incarnation)
        return self.srv.tokens[key]

    def send(self, kind: str, seq: int, grad=None, clock: int = 0, meta=None, incarnation=None,
             token=None):
        """``token``: the admitted one by default; a string sends that one instead."""
        incarnation = self.incarnation if incarnation is None else incarnation
        segments = [] if grad is None else [Segment(0, grad)]
        self.sock.send_multipart(encode(Message(
            type=kind, worker=self.worker, seq=seq, clock=clock, meta=meta or {},
            incarnation=incarnation, segments=segments, shard=self.shard,
            token=self.token(incarnation) if token is None and kind != HELLO else token or "")))

    def reply(self, timeout: float = 10.0):
        """The next reply, or None when none comes within ``timeout``."""
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return decode(self.sock.recv_multipart())

    def push(self, seq: int, grad, **kw) -> Message:
        self.send(PUSH, seq, grad, **kw)
        reply = self.reply()
        assert reply is not None, f"no answer to push {seq}"
        return reply

    def close(self):
        self.sock.close(0)


def grad(*values) -> torch.Tensor:
    g = torch.zeros(SIZE)
    g[:len(values)] = torch.tensor(values, dtype=torch.float32)
    return g


def applied(reply: Message) -> bool:
    assert reply.type in (ACK, ERROR), reply
    return reply.type == ACK and reply.meta[Key.APPLIED] is True


def test_an_older_incarnation_never_touches_the_newer_ones_window(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    new, old = Peer(srv, port, incarnation=3), Peer(srv, port, incarnation=2)
    g5, g9 = grad(1, 2, 3), grad(0, 0, 0, 7)
    assert applied(new.push(5, g5))
    again = new.push(5, g5)
    assert not applied(again) and again.meta[Key.DUPLICATE] is True
    refused = old.push(9, g9)  # the replaced process speaks: refused, and changes nothing
    assert refused.type == ERROR and refused.meta[Key.CODE] == "old-incarnation", refused
    assert "incarnation 2 was replaced by incarnation 3" in refused.meta[Key.ERROR]
    assert not applied(new.push(5, g5))  # on main this retry was applied a second time
    assert torch.equal(observe(srv, port, SIZE), -g5)
    assert shard_stats(srv, port)["updates"] == 1


def test_fresh_pushes_far_below_the_highest_number_are_applied_once(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port)
    pushes = {10: grad(1), 100_000: grad(0, 2), 11: grad(0, 0, 4), 3: grad(0, 0, 0, 8)}
    for seq, g in pushes.items():  # reordered and far apart: every one is fresh
        assert applied(peer.push(seq, g)), seq
    for seq, g in pushes.items():  # every retry is a duplicate
        reply = peer.push(seq, g)
        assert not applied(reply) and reply.meta[Key.DUPLICATE] is True, (seq, reply)
    assert torch.equal(observe(srv, port, SIZE), -sum(pushes.values()))


def test_the_window_says_fresh_duplicate_or_cannot_tell_never_guesses():
    window = SeqWindow(size=3)
    for seq in (10, 100_000, 11):
        assert window.classify(seq) == FRESH
        window.add(seq)
    assert window.classify(5) == FRESH  # above the floor (-1): never concluded
    window.add(5)  # four kept > 3: the smallest, 5, is forgotten and becomes the floor
    assert window.floor == 5 and window.classify(5) == OUT_OF_WINDOW
    assert window.classify(4) == OUT_OF_WINDOW and window.classify(6) == FRESH
    assert all(window.classify(s) == DUPLICATE for s in (10, 11, 100_000))
    restored = SeqWindow.from_state(3, window.state())
    assert (restored.floor, restored.seqs) == (window.floor, window.seqs)
    smaller = SeqWindow.from_state(2, window.state())  # a smaller --dedupe-window on resume
    assert smaller.floor == 10 and smaller.seqs == {11, 100_000}


def test_the_window_remembers_which_pushes_ended_stale_also_through_a_checkpoint():
    """A push acknowledged stale was never applied: its retry (the ack lost) hears stale
    again, not duplicate. A checkpoint keeps the stale ones; one saved before they were
    kept ([floor, seqs]) loads with none; the stale mark is forgotten with its number."""
    window = SeqWindow(size=2)
    window.add(7, stale=True)
    window.add(8)
    assert (window.classify(7), window.classify(8)) == (STALE_AGAIN, DUPLICATE)
    restored = SeqWindow.from_state(2, window.state())
    assert (restored.classify(7), restored.classify(8)) == (STALE_AGAIN, DUPLICATE)
    older = SeqWindow.from_state(2, window.state()[:2])
    assert (older.classify(7), older.classify(8)) == (DUPLICATE, DUPLICATE)
    window.add(9)  # 7 is forgotten: the floor
    assert window.classify(7) == OUT_OF_WINDOW and window.stale == set()


def test_no_lost_updates_without_a_restart(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port, worker="late")
    assert applied(peer.push(1, grad(1), clock=7))  # a new worker may carry any clock
    assert shard_stats(srv, port)["lost_updates"] == 0  # main reported 7


def test_a_sync_push_waiting_for_its_round_survives_a_shard_sigkill(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done", "--workers", 2,
                 "--consistency", "sync", "--checkpoint-every", 0.3, "--heartbeat-timeout", 120)
    port = srv.stats()["shard_ports"][0]
    a, b = Peer(srv, port, worker="a"), Peer(srv, port, worker="b")
    ga, gb = grad(2, 4), grad(0, 2, 6)
    a.send(PULL, 1)
    b.send(PULL, 1)
    assert a.reply().type == b.reply().type == "params"
    a.send(PUSH, 2, ga)
    assert a.reply(1.0) is None  # waits for b's push
    a.send(PUSH, 2, ga)  # a retry of the waiting push: held too (main said duplicate at once)
    assert a.reply(1.0) is None
    kill_shard(srv, port, checkpointed_after=time.time())  # a's push waits in the checkpoint
    a.close()
    a = Peer(srv, port, worker="a")  # the worker reconnects and re-sends what is outstanding
    a.send(PUSH, 2, ga)
    assert a.reply(1.0) is None  # fresh to the restored shard: in the new round, waiting
    b.send(PUSH, 2, gb)
    acks = [a.reply(), b.reply()]
    assert all(r is not None and applied(r) for r in acks), acks
    assert torch.equal(observe(srv, port, SIZE), -(ga + gb) / 2)
    stats = shard_stats(srv, port)
    assert stats["updates"] == 1 and stats["lost_updates"] == 0


def _hello(srv, signature, worker="h") -> Message:
    front = Peer(srv, srv.port, worker=worker)
    front.send(HELLO, 1, meta={Key.SIGNATURE: signature, Key.RANK: 0, Key.WORLD: 1})
    reply = front.reply()
    front.close()
    assert reply is not None, "the front did not answer"
    return reply


def test_malformed_and_lying_hellos_are_refused_and_the_server_goes_on(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    ours = Layout.of(index_counter(SIZE).build_model(0)).signature()
    malformed = [{"names": 7, "shapes": [], "dtypes": []},  # main's front died on this one
                 {**ours, "names": 7}, {**ours, "shapes": "x"}, {**ours, "dtypes": None},
                 {**ours, "names": [[1]], "shapes": [{}], "dtypes": [2.5]}, [], 7,
                 {**ours, "names": ours["names"] * 2}]
    for signature in malformed:
        reply = _hello(srv, signature)
        assert reply.type == ERROR and reply.meta[Key.CODE] == "signature-mismatch", reply
        assert srv.proc.poll() is None  # main exited 1 on the first of these
    lying = {  # the server's own digest, copied, over another model's fields
        "shape": {**ours, "shapes": [[SIZE + 1, 1]]},
        "float64": {**ours, "dtypes": ["float64"]},
        "'bias'": {**ours, "names": ["bias"]}}
    for what, signature in lying.items():
        reply = _hello(srv, signature)
        assert reply.type == ERROR and reply.meta[Key.CODE] == "signature-mismatch", reply
        assert what in reply.meta[Key.ERROR], reply.meta[Key.ERROR]
    no_digest = {k: v for k, v in ours.items() if k != "digest"}  # the same model: welcomed
    assert _hello(srv, no_digest).type == WELCOME
    assert srv.stats()["refused_handshakes"] == len(malformed) + len(lying)


def test_shards_serve_only_workers_the_front_admitted(server):
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done",
                 "--consistency", "sync", "--heartbeat-timeout", 120)
    port = srv.stats()["shard_ports"][0]
    ghost, member = Peer(srv, port, worker="ghost"), Peer(srv, port, worker="a")
    member.token(1)  # said hello: admitted
    forged = {"no token": "", "a made-up one": "0" * 32,
              "another worker's": member.token(1), "another incarnation's": member.token(7)}
    for what, token in forged.items():  # main applied such pushes and acknowledged them
        for kind, g in ((PUSH, grad(5)), (HEARTBEAT, None), (PULL, None)):
            ghost.send(kind, 3, g, token=token)
            refused = ghost.reply()
            assert refused.type == ERROR and refused.meta[Key.CODE] == "unknown-worker", (
                what, kind, refused)
            assert refused.seq == 3 and refused.shard == 0, refused
    # The member's own token under an incarnation the front never welcomed: the token is
    # bound to (id, incarnation), not to the id alone.
    for kind, g in ((PUSH, grad(5)), (HEARTBEAT, None), (PULL, None)):
        member.send(kind, 3, g, incarnation=2, token=member.token(1))
        refused = member.reply()
        assert refused.type == ERROR and refused.meta[Key.CODE] == "unknown-worker", (
            kind, refused)
    # A ghost heartbeating all along is no member of the sync barrier (main: every round
    # waited for it): the one admitted worker's push makes a round on its own.
    ghost.send(HEARTBEAT, 4, token="")
    member.send(PULL, 1)
    assert member.reply().type == "params"
    assert applied(member.push(2, grad(0, 3)))
    assert torch.equal(observe(srv, port, SIZE), -grad(0, 3))
    stats = shard_stats(srv, port)
    assert stats["updates"] == 1 and set(stats["workers"]) == {"a"}, stats


def test_error_replies_echo_the_request_and_name_the_shard(server):
    """Wherever a refused request's header could be read, its error names its ``s`` and
    ``w``, and a shard's error its ``sh`` (a worker matches answers by them)."""
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done")
    port = srv.stats()["shard_ports"][0]
    peer = Peer(srv, port, worker="echo")
    token = peer.token(1)
    header = {"v": VERSION, "t": PUSH, "w": "echo", "i": 1, "s": 42, "c": 0, "sh": 0,
              "m": {}, "k": token}
    bad = {"bad-dtype": ({**header, "d": [[0, "complex64", [1]]]}, b"\x00" * 8),
           "length-mismatch": ({**header, "d": [[0, "float32", [4]]]}, b"\x00" * 3),
           "bad-type": ({**header, "t": "reboot", "d": []}, None),
           "bad-field": ({**header, "c": -5, "d": []}, None)}
    for code, (head, frame) in bad.items():
        for to, shard in ((port, 0), (srv.port, -1)):
            frames = [msgpack.packb(head)] + ([frame] if frame is not None else [])
            reply = srv.request(frames, port=to)
            assert reply.type == ERROR and reply.meta[Key.CODE] == code, (code, reply)
            assert (reply.seq, reply.worker, reply.shard) == (42, "echo", shard), (code, reply)
    # Echoed whatever else is wrong (t as bytes); the form is checked before the token (none
    # here); a push naming no shard (sh -1) is refused, nothing applied.
    for code, head, frames in (
            ("bad-header", {**header, "t": b"push", "d": []}, []),
            ("bad-field", {**header, "k": "", "m": {"loss": "high"}, "d": []}, []),
            ("bad-field", {**header, "sh": -1, "d": [[0, "float32", [1]]]}, [b"\x00" * 4])):
        reply = srv.request([msgpack.packb(head), *frames], port=port)
        assert reply.type == ERROR and reply.meta[Key.CODE] == code, (code, reply)
        assert (reply.seq, reply.worker, reply.shard) == (42, "echo", 0), (code, reply)
    assert srv.request([b"\xc1"], port=port).seq == 0  # nothing readable: nothing to echo
    assert torch.equal(observe(srv, port, SIZE), torch.zeros(SIZE))


def test_a_forgotten_workers_retry_is_not_applied_again(server):
    """A worker pushes s=7 and goes silent; 300 other admitted ids fill the shard's 256
    records and its record is forgotten; once they are silent too, its retry of s=7 is
    refused, not applied a second time (the independent client's reproduction)."""
    timeout = 1.0
    srv = server("--task", TASK, "--samples", SIZE, "--no-exit-when-done",
                 "--heartbeat-timeout", timeout)
    port = srv.stats()["shard_ports"][0]
    victim, g7 = Peer(srv, port, worker="victim", incarnation=5), grad(1, 2)
    assert applied(victim.push(7, g7))
    time.sleep(timeout + 0.5)  # silent: dropped, and first in line to be forgotten
    flood = Peer(srv, port)
    for n in range(300):  # one pull per fresh id; past the cap the rest are refused
        flood.worker = f"other-{n}"
        flood.send(PULL, 1)
    replies = [flood.reply() for _ in range(300)]
    assert all(r is not None for r in replies)
    assert sum(r.type == "params" for r in replies) == 256, [r.meta for r in replies[-3:]]
    assert shard_stats(srv, port)["forgotten_workers"] == 1
    refused = victim.push(7, g7)  # every record is live: no room
    assert refused.type == ERROR and refused.meta[Key.CODE] == "too-many-workers", refused
    time.sleep(timeout + 0.5)  # the others fall silent too
    retry = victim.push(7, g7)  # main applied it again here (version 1 -> 2)
    assert retry.type == ERROR and retry.meta[Key.CODE] == "out-of-window", retry
    older = victim.push(9, grad(0, 0, 3), incarnation=4)  # an older incarnation: refused
    assert older.type == ERROR and older.meta[Key.CODE] == "old-incarnation", older
    assert applied(victim.push(8, grad(0, 0, 0, 4)))  # never concluded: fresh
    assert torch.equal(observe(srv, port, SIZE), -g7 - grad(0, 0, 0, 4))
    assert shard_stats(srv, port)["version"] == 2
