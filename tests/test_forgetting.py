"""Exactly once through forgetting: a shard that forgot a worker's record still refuses its
old pushes and its older incarnations, in bounded memory, across a checkpoint. Pure
``ShardState`` and ``Forgotten``, no sockets."""

import torch

from asyncsgd.servers.dedupe import Forgotten, SeqWindow
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.wire.protocol import ERROR, PULL, PUSH, Message, Segment

SIZE, CAP = 4, 4


def _state(cap=CAP):
    cfg = ShardConfig(index=0, start=0, end=SIZE, lr=1.0, heartbeat_timeout=1.0,
                      max_workers=cap)
    return ShardState(cfg, torch.zeros(SIZE))


def _push(state, worker, seq, values, now, inc=1):
    msg = Message(type=PUSH, shard=0, worker=worker, incarnation=inc, seq=seq,
                  segments=[Segment(0, torch.tensor(values, dtype=torch.float32))])
    (_, reply), *_ = state.handle(b"p", msg, now)
    return reply


def _outcome(reply):
    return reply.meta["code"] if reply.type == ERROR else reply.meta["applied"]


def _flood(state, names, now):
    for name in names:
        state.handle(b"f", Message(type=PULL, worker=name, incarnation=1, seq=1), now)


def _forget_victim(state):
    """The victim pushes s=7 at t=0 and falls silent; CAP fresh ids fill the records at
    t=2 (forgetting it), and fall silent too by t=4."""
    assert _outcome(_push(state, "victim", 7, [1, 2, 0, 0], 0.0, inc=5)) is True
    state.tick(2.0)
    _flood(state, [f"other-{n}" for n in range(CAP)], 2.0)
    assert state.counters["forgotten_workers"] == 1 and "victim" not in state.workers
    state.tick(4.0)


def test_a_forgotten_workers_retry_and_older_incarnation_are_refused_and_new_pushes_apply():
    state = _state()
    _forget_victim(state)
    assert _outcome(_push(state, "victim", 7, [1, 2, 0, 0], 5.0, inc=5)) == "out-of-window"
    assert _outcome(_push(state, "victim", 9, [0, 0, 3, 0], 5.0, inc=4)) == "old-incarnation"
    assert _outcome(_push(state, "victim", 8, [0, 0, 0, 4], 5.0, inc=5)) is True
    assert _outcome(_push(state, "victim", 8, [0, 0, 0, 4], 5.0, inc=5)) is False  # duplicate
    assert _outcome(_push(state, "victim", 7, [1, 2, 0, 0], 5.0, inc=6)) is True  # a restart
    assert torch.equal(state.params, -torch.tensor([2.0, 4, 0, 4])) and state.version == 3


def test_what_forgotten_records_leave_stays_bounded_under_a_flood_of_fresh_ids():
    state = _state()
    for n in range(2000):  # each id pulls once and is silent by the next one's turn
        state.tick(2.0 * n)
        _flood(state, [f"id-{n}"], 2.0 * n)
    assert len(state.workers) <= CAP and len(state.forgotten.entries) == 16 * CAP
    assert state.forgotten.watermark == (1, -1)  # every flooder's incarnation 1, no push


def test_an_id_whose_entry_went_into_the_watermark_is_still_refused():
    forgotten = Forgotten(size=2)
    window = SeqWindow(8)
    for seq in (3, 7):
        window.add(seq)
    forgotten.remember("a", 10, window)  # highest concluded: 7
    forgotten.remember("b", 4, SeqWindow(8, floor=50))
    forgotten.remember("c", 12, SeqWindow(8))
    assert list(forgotten.entries) == ["b", "c"] and forgotten.watermark == (10, 7)
    assert forgotten.bound("a") == (10, 7) and forgotten.bound("b") == (4, 50)
    forgotten.remember("d", 9, SeqWindow(8, floor=99))  # b goes in: older, the mark stays
    assert forgotten.watermark == (10, 7)
    forgotten.remember("e", 10, SeqWindow(8, floor=20))  # c goes in: newer, the mark rises
    assert forgotten.watermark == (12, -1)
    assert forgotten.bound("never-seen") == (12, -1)
    forgotten.readmit("d")
    assert list(forgotten.entries) == ["e"]


def test_the_checkpoint_keeps_what_forgotten_records_left_and_an_older_one_still_loads(tmp_path):
    state = _state()
    _forget_victim(state)
    torch.save(state.state_dict(), tmp_path / "shard-0.pt")
    saved = torch.load(tmp_path / "shard-0.pt", weights_only=True)  # as a shard loads it
    restored = _state()
    restored.load_state_dict(saved)
    assert restored.forgotten.state() == state.forgotten.state()
    assert _outcome(_push(restored, "victim", 7, [1, 2, 0, 0], 5.0, inc=5)) == "out-of-window"
    assert _outcome(_push(restored, "victim", 9, [0, 0, 3, 0], 5.0, inc=4)) == "old-incarnation"
    older = {k: v for k, v in saved.items() if k != "forgotten"}  # written before this key
    restored = _state()
    restored.load_state_dict(older)
    assert restored.forgotten.entries == {} and restored.forgotten.watermark is None
    assert _outcome(_push(restored, "victim", 8, [0, 0, 0, 4], 5.0, inc=5)) is True
