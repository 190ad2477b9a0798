"""What an independent client found the code and PROTOCOL.md disagreeing on, settled: push
dtypes and shapes, a push's shard, the type of every ``m`` field, errors that echo ``s``,
sync's ack and params, ``pull_dtype`` in stats, the order errors are checked in, and the
byte recipes (digests, the same-host area) computed from the spec alone."""

import hashlib
import mmap
import struct

import msgpack
import pytest
import torch

from asyncsgd.core.signature import data_signature
from asyncsgd.core.tasks import Split, Task
from asyncsgd.servers.shard import ShardConfig, ShardState
from asyncsgd.wire import shared
from asyncsgd.wire.layout import Layout
from asyncsgd.wire.protocol import (ACK, ERROR, PARAMS, PULL, PUSH, VERSION, Message, ProtocolError,
                                    Segment, decode)

SIZE = 6


def _state(mode="async", workers=1):
    cfg = ShardConfig(index=0, start=0, end=SIZE, lr=1.0, consistency=mode,
                      expected_workers=workers, heartbeat_timeout=5.0)
    return ShardState(cfg, torch.arange(SIZE, dtype=torch.float32))


def _header(**fields):
    return {"v": VERSION, "t": PUSH, "w": "w", "i": 1, "s": 42, "c": 0, "sh": 0, "m": {},
            "d": [], "k": "", **fields}


def _raw(header, *frames):
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _code(frames):
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    return err.value


def _answer(state, frames, peer=b"a"):
    """The shard's replies to raw frames, as a live shard makes them: decoded, then handled."""
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        return [(peer, Message(type=ERROR, seq=exc.seq, worker=exc.worker,
                               meta={"code": exc.code}))]
    return state.handle(peer, msg, 0.0)


@pytest.mark.parametrize("dtype", ["float64", "int64", "int32"])
def test_a_push_of_a_known_dtype_that_is_no_gradient_is_bad_dtype_and_changes_nothing(dtype):
    state = _state()
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    (_, reply), = _answer(state, _raw(_header(d=[[0, dtype, [SIZE]]]), b"\x00" * SIZE * itemsize))
    assert reply.type == ERROR and reply.meta["code"] == "bad-dtype", reply
    assert torch.equal(state.params, torch.arange(SIZE, dtype=torch.float32))
    assert state.version == 0


def test_a_push_of_up_to_8_sizes_is_placed_flat_in_c_order():
    state = _state()
    grad = torch.arange(6, dtype=torch.float32).view(1, 1, 1, 1, 1, 1, 2, 3)
    frames = _raw(_header(d=[[0, "float32", list(grad.shape)]]), grad.numpy().tobytes())
    (_, reply), = _answer(state, frames)
    assert reply.type == ACK and reply.meta["applied"], reply
    assert torch.equal(state.params, torch.zeros(SIZE)), "arange - arange, value by value"
    nine = _raw(_header(d=[[0, "float32", [1] * 7 + [2, 3]]]), grad.numpy().tobytes())
    assert _code(nine).code == "bad-descriptor"


@pytest.mark.parametrize("sh", [-1, 1])
def test_a_push_must_name_the_shard_it_reaches(sh):
    state = _state()
    frames = _raw(_header(sh=sh, d=[[0, "float32", [SIZE]]]), torch.ones(SIZE).numpy().tobytes())
    (_, reply), = _answer(state, frames)
    assert reply.type == ERROR and reply.meta["code"] == "bad-field" and reply.seq == 42
    assert state.version == 0 and not state.workers, "nothing applied, nobody recorded"


META = [
    (PUSH, "loss", "high"), (PUSH, "loss", True), (PUSH, "samples", -1), (PUSH, "samples", 1.5),
    (PUSH, "traffic", [1]), (PUSH, "traffic", [1, "2"]), (PUSH, "pull", "yes"),
    (PUSH, "pull", 1), (PUSH, "pull_dtype", 16), (PUSH, "part", "0"), (PUSH, "parts", 2.0),
    (PULL, "observer", 1), (PULL, "pull_dtype", None), ("hello", "rank", "0"),
    ("hello", "world", -1), ("hello", "rejoin", "yes"), ("hello", "host", 7),
]


@pytest.mark.parametrize("kind,key,value", META)
def test_every_documented_m_field_of_a_request_has_its_type_checked(kind, key, value):
    err = _code(_raw(_header(t=kind, m={key: value})))
    assert err.code == "bad-field" and f"'m.{key}'" in str(err) and err.seq == 42


def test_m_fields_of_their_types_and_unknown_keys_pass():
    meta = {"loss": 0.5, "samples": 8, "traffic": [10, 20], "pull": True,
            "pull_dtype": "float16", "part": 0, "parts": 1, "later-addition": {"any": [1]}}
    assert decode(_raw(_header(m=meta))).meta == meta
    assert decode(_raw(_header(m={"loss": 2}))).meta == {"loss": 2}  # an int is a number


@pytest.mark.parametrize("broken", [{"t": b"push"}, {"d": b"\x00"},
                                    {"m": msgpack.ExtType(3, b"x")}, {"m": {1: 2}}])
def test_an_error_echoes_s_and_w_whenever_they_can_be_read(broken):
    err = _code(_raw(_header(w="echo", **broken)))
    assert (err.code, err.seq, err.worker) == ("bad-header", 42, "echo")
    err = _code(_raw(_header(w=b"echo", t=b"push")))
    assert (err.seq, err.worker) == (42, ""), "s is read, a w that is no string is not"


def test_under_sync_the_push_that_completes_the_round_gets_an_ack_then_params():
    state = _state("sync", workers=2)
    grads = {b"a": torch.ones(SIZE), b"b": 3 * torch.ones(SIZE)}

    def push(peer, seq):
        return state.handle(peer, Message(type=PUSH, worker=peer.decode(), incarnation=1,
                                          seq=seq, shard=0, meta={"pull": True},
                                          segments=[Segment(0, grads[peer])]), 0.0)

    assert push(b"a", 1) == []  # held until the round is applied
    replies = push(b"b", 5)
    for peer, seq in ((b"a", 1), (b"b", 5)):
        mine = [(r.type, r.seq) for p, r in replies if p == peer]
        assert mine == [(ACK, seq), (PARAMS, seq)], (peer, replies)
    assert all("ack" not in r.meta for _, r in replies if r.type == PARAMS)
    assert torch.equal(state.params, torch.arange(SIZE, dtype=torch.float32) - 2)


def test_under_ssp_a_push_whose_pull_is_held_gets_its_ack_at_once_and_params_later():
    state = _state("ssp:0", workers=2)

    def send(kind, peer, seq, meta=None):
        segments = [Segment(0, torch.ones(SIZE))] if kind == PUSH else []
        return [(p, r.type, "ack" in r.meta) for p, r in state.handle(peer, Message(
            type=kind, worker=peer.decode(), incarnation=1, seq=seq, shard=0,
            meta=meta or {}, segments=segments), 0.0)]

    assert send(PUSH, b"a", 1, {"pull": True}) == [(b"a", ACK, False)]
    # The second worker comes (at the first one's clock): both may read now.
    assert sorted(send(PULL, b"b", 1)) == [(b"a", PARAMS, False), (b"b", PARAMS, False)]


def test_ps_stats_pull_dtype_follows_pulls_as_well_as_pushes():
    state = _state()

    def dtype():
        return state.stats(0.0)["workers"]["w"]["pull_dtype"]

    state.handle(b"a", Message(type=PULL, worker="w", incarnation=1, seq=1,
                               meta={"pull_dtype": "bfloat16"}), 0.0)
    assert dtype() == "bfloat16"
    state.handle(b"a", Message(type=PUSH, worker="w", incarnation=1, seq=2, shard=0,
                               segments=[Segment(0, torch.ones(SIZE))]), 0.0)
    assert dtype() == "bfloat16", "a push that does not pull says nothing of its pulls"
    state.handle(b"a", Message(type=PULL, worker="w", incarnation=1, seq=3), 0.0)
    assert dtype() == "float32"
    state.handle(b"a", Message(type=PUSH, worker="w", incarnation=1, seq=4, shard=0,
                               meta={"pull": True, "pull_dtype": "float16"},
                               segments=[Segment(0, torch.ones(SIZE))]), 0.0)
    assert dtype() == "float16"


# ---- error precedence (PROTOCOL.md, Errors) ------------------------------------------------

def test_the_message_form_is_checked_before_admission_and_in_a_fixed_order():
    # No token and a malformed m: the decoder refuses it; admission never sees it.
    assert _code(_raw(_header(k="", m={"loss": "high"}))).code == "bad-field"
    # The header's fields in order: v, then t, then w, m, d, frames, k, i/s/c/sh, m's fields.
    assert _code(_raw(_header(v=2, t="launch"))).code == "bad-version"
    assert _code(_raw(_header(t="launch", w=7))).code == "bad-type"
    assert _code(_raw(_header(m={"loss": "high"}, d=[[0, "float32", [1]]]))).code == \
        "frame-count"
    assert _code(_raw(_header(m={"loss": "high"}, d=[[0, "float128", [1]]]),
                      b"\x00" * 4)).code == "bad-field"


def test_in_a_shard_the_address_comes_before_the_sender_and_the_sequence_before_the_content():
    state = _state()
    first = _raw(_header(i=2, d=[[0, "float32", [SIZE]]]), torch.ones(SIZE).numpy().tobytes())
    assert _answer(state, first)[0][1].meta["applied"]
    # An older incarnation, to another shard: the address is checked first.
    misaddressed = _raw(_header(i=1, sh=3, d=[[0, "float32", [SIZE]]]),
                        torch.ones(SIZE).numpy().tobytes())
    assert _answer(state, misaddressed)[0][1].meta["code"] == "bad-field"
    # An older incarnation with content out of range: the sender is checked before content.
    old = _raw(_header(i=1, d=[[4, "float32", [SIZE]]]), torch.ones(SIZE).numpy().tobytes())
    assert _answer(state, old)[0][1].meta["code"] == "old-incarnation"
    # A retry of the applied push, now holding NaN: answered as its original was.
    nan = _raw(_header(i=2, d=[[0, "float32", [SIZE]]]),
               torch.full((SIZE,), float("nan")).numpy().tobytes())
    (_, reply), = _answer(state, nan)
    assert reply.type == ACK and reply.meta == {"applied": False, "duplicate": True}
    assert state.version == 1


# ---- byte recipes an independent client can compute (PROTOCOL.md) -------------------------

def test_the_model_signature_digest_follows_the_spec_recipe():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    text = ('{"dtypes": ["float32", "float32"], "names": ["0.weight", "0.bias"], '
            '"shapes": [[2, 3], [2]]}')
    assert Layout.of(model).signature()["digest"] == \
        hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def test_the_data_digest_follows_the_spec_recipe():
    x, y = torch.zeros(4, 3), torch.tensor([2, 0, 1, 2])
    task = Task(name="t", model_fn=lambda: torch.nn.Linear(3, 3),
                train=Split((x,), y), test=Split((x[:1],), y[:1]))

    def split(labels):
        head = b'[[[3], "torch.float32"], [[], "torch.int64"]]'
        return hashlib.sha256(head + struct.pack(f"<{len(labels)}q", *labels)).hexdigest()

    expected = hashlib.sha256(f"{split([2, 0, 1, 2])}\n{split([2])}".encode()).hexdigest()[:16]
    assert data_signature(task, "lm", 0)["digest"] == expected


@pytest.mark.skipif(not shared.supported(), reason="no sealed memory files here")
def test_the_same_host_area_layout_follows_the_spec_byte_for_byte():
    elements = 1000
    area = shared.Area.create(link=1, elements=elements)
    try:
        slot = -(-elements * 4 // mmap.PAGESIZE) * mmap.PAGESIZE
        assert len(area.mapping) == 4096 + 2 * slot
        assert area.mapping[:16] == area.tag and len(area.tag) == 16
        area.grads.copy_(torch.arange(elements, dtype=torch.float32))
        area.params.fill_(-1.5)
        raw = bytes(area.mapping)
        assert struct.unpack_from(f"<{elements}f", raw, 4096) == tuple(map(float, range(elements)))
        assert struct.unpack_from(f"<{elements}f", raw, 4096 + slot) == (-1.5,) * elements
    finally:
        area.close()
