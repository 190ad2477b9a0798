"""Row-sparse segments on the wire (PROTOCOL.md, Row-sparse tables), without sockets: rows
and ids survive encode/decode bit for bit, every lying segment is refused with its code
before anything could be applied, dense messages are the bytes they were, and a model's
embedding tables are laid out apart from its dense slice.
"""

import hashlib
import json

import msgpack
import pytest
import torch

from asyncsgd.errors import ConfigError
from asyncsgd.wire.compression import pack_int8, pack_topk
from asyncsgd.core.models import embedding_tables
from asyncsgd.wire.layout import (Layout, TableSpec, holds, shard_rows,
                                  signature_mismatch)
from asyncsgd.wire.protocol import (FRAME_BYTES, MAX_SEGMENT_ROWS, MAX_SEGMENT_VALUES, PARAMS,
                                    PULL, PUSH,
                                    VERSION, Message, ProtocolError, Rows, Segment, decode,
                                    encode, in_parts)
from asyncsgd.wire.sparse import (MAX_MESSAGE_VALUES, apart, by_table, check_rows, ids_segment,
                                  reply_mismatch, rows_reply, rows_segment, sorted_ids,
                                  split_rows, unique_ids, widened)

TABLES = [TableSpec("emb.0.weight", 20, 4), TableSpec("emb.1.weight", 7, 3)]


def _frames(msg):
    return [bytes(f) for f in encode(msg)]


def _bits(t):
    """A tensor's raw bytes: equal bits, NaN payloads and -0.0 included."""
    return bytes(t.contiguous().view(torch.uint8).numpy())


def _odd_values(n, dim, seed=0):
    """Values whose bits a lossy path would change: -0.0, a subnormal, extremes, NaN."""
    values = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    values.view(-1)[:4] = torch.tensor([-0.0, 1e-45, 3.4e38, float("nan")])
    return values


# ---- round trips, bit for bit --------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_rows_in_a_push_survive_the_wire_bit_for_bit(dtype):
    ids = torch.tensor([19, 0, -5, 2 ** 62], dtype=torch.int64)
    values = _odd_values(4, 5).to(getattr(torch, dtype))
    dense = torch.arange(6, dtype=torch.float32)
    msg = Message(type=PUSH, worker="w", seq=3, shard=1, token="k",
                  segments=[Segment(0, dense), rows_segment(2, ids, values, dtype)])
    frames = _frames(msg)
    assert msgpack.unpackb(frames[0])["d"][1] == [2, "rows", [4, 5], dtype]
    assert len(frames[2]) == 8 * 4 + 4 * 5 * values.element_size()
    back = decode(frames)
    (plain,), (rows,) = apart(back.segments)
    assert torch.equal(plain.data, dense)
    assert rows.offset == 2 and isinstance(rows.data, Rows)
    assert (rows.data.table, rows.data.n, rows.data.dim, rows.data.dtype) == (2, 4, 5, dtype)
    assert _bits(rows.data.ids) == _bits(ids)
    assert _bits(rows.data.values) == _bits(values)
    table, got_ids, wide = widened(rows)
    assert table == 2 and wide.dtype == torch.float32
    assert _bits(wide) == _bits(values.to(torch.float32))


def test_a_sparse_pull_and_its_reply_carry_exactly_the_rows_asked():
    """A pull names ids per table; the params reply holds those ids in that order with
    their rows (cast to pull_dtype when asked); a reply of other rows is told apart."""
    asked = [ids_segment(0, torch.tensor([4, 0, 12])), ids_segment(1, torch.tensor([6]))]
    pull = decode(_frames(Message(type=PULL, worker="w", seq=1, segments=asked,
                                  meta={"pull_dtype": "bfloat16"})))
    assert msgpack.unpackb(_frames(Message(type=PULL, segments=asked))[0])["d"] == \
        [[0, "ids", [3], "int64"], [1, "ids", [1], "int64"]]
    assert [_bits(s.data.ids) for s in pull.segments] == [_bits(s.data.ids) for s in asked]
    store = {0: torch.arange(80, dtype=torch.float32).view(20, 4),
             1: -torch.arange(21, dtype=torch.float32).view(7, 3)}
    reply = [rows_reply(seg, store[seg.data.table][seg.data.ids], torch.bfloat16)
             for seg in pull.segments]
    back = decode(_frames(Message(type=PARAMS, seq=1, segments=reply)))
    assert reply_mismatch(asked, back.segments, TABLES) == ""
    for want, seg in zip(asked, back.segments):
        assert seg.data.dtype == "bfloat16"
        assert torch.equal(seg.data.values.float(), store[want.data.table][want.data.ids])
    other = [back.segments[0], rows_reply(asked[1], store[1][[5]])]
    other[1].data.ids[0] = 5  # a reply naming a row not asked
    assert "other rows" in reply_mismatch(asked, other, TABLES)
    assert "1 rows segments for 2" in reply_mismatch(asked, back.segments[:1], TABLES)
    assert "wide" in reply_mismatch(asked[:1], [rows_reply(asked[0], torch.zeros(3, 3))],
                                    TABLES)


def test_split_rows_keeps_each_segment_within_its_bounds():
    ids = torch.arange(3 * MAX_SEGMENT_VALUES // 64 + 5, dtype=torch.int64)
    values = torch.randn(len(ids), 64)
    parts = split_rows(0, ids, values)
    assert [p.data.n for p in parts] == [MAX_SEGMENT_VALUES // 64] * 3 + [5]
    assert torch.equal(torch.cat([p.data.values for p in parts]), values)
    asked = split_rows(1, torch.arange(MAX_SEGMENT_ROWS + 1, dtype=torch.int64))
    assert [p.data.n for p in asked] == [MAX_SEGMENT_ROWS, 1]
    assert all(decode(_frames(Message(type=PUSH, segments=parts))).segments)


def test_rows_in_parts_travel_one_segment_a_part():
    """A push of dense values and two tables' rows, sent in parts: each part decodes to its
    segment, so a shard can check rows part by part as it does dense ones."""
    msg = Message(type=PUSH, worker="w", seq=5, shard=0, token="k",
                  segments=[Segment(0, torch.ones(3)),
                            rows_segment(0, torch.tensor([1, 4]), torch.ones(2, 4)),
                            rows_segment(1, torch.tensor([4]), torch.ones(1, 3), "float16")])
    parts = [decode(_frames(part)) for part in in_parts(msg)]
    assert [p.meta["part"] for p in parts] == [0, 1, 2]
    assert [type(p.segments[0].data).__name__ for p in parts] == ["Tensor", "Rows", "Rows"]
    assert check_rows([p.segments[0] for p in parts[1:]], TABLES, 1, 3) is None


# ---- lying segments -------------------------------------------------------------------

def _header(kind, descriptors, meta=None):
    return msgpack.packb({"v": VERSION, "t": kind, "w": "w", "i": 0, "s": 1, "c": 0, "sh": 0,
                          "m": meta or {}, "d": descriptors})


def _payload(ids, values=None):
    raw = torch.tensor(ids, dtype=torch.int64).view(torch.uint8)
    if values is not None:
        raw = torch.cat([raw, torch.tensor(values, dtype=torch.float32).view(-1).view(torch.uint8)])
    return bytes(raw.numpy())


GOOD = _payload([1, 3], [[1.0, 2.0], [3.0, 4.0]])


@pytest.mark.parametrize("kind, desc, frame, code", [
    (PUSH, [0, "rows", [2, 2], "float32"], GOOD[:-1], "length-mismatch"),     # short frame
    (PUSH, [0, "rows", [3, 2], "float32"], GOOD, "length-mismatch"),          # n ids != rows
    (PUSH, [0, "rows", [2, 3], "float32"], GOOD, "length-mismatch"),
    (PUSH, [0, "rows", [1, 2], "float32"], GOOD, "length-mismatch"),          # rows > ids
    (PULL, [0, "ids", [1], "int64"], _payload([1, 3]), "length-mismatch"),
    (PUSH, [0, "rows", [2, 2], "float64"], GOOD, "bad-dtype"),
    (PUSH, [0, "rows", [2, 2], "int64"], GOOD, "bad-dtype"),
    (PULL, [0, "ids", [2], "float32"], _payload([1, 3]), "bad-dtype"),
    (PUSH, [0, "rows", [2], "float32"], GOOD, "bad-descriptor"),              # no dim
    (PUSH, [0, "rows", [2, 0], "float32"], _payload([1, 3]), "bad-descriptor"),
    (PUSH, [0, "rows", [0, 2], "float32"], b"", "bad-descriptor"),            # empty
    (PUSH, [-1, "rows", [2, 2], "float32"], GOOD, "bad-descriptor"),
    (PUSH, [1 << 10, "rows", [2, 2], "float32"], GOOD, "bad-descriptor"),
    (PUSH, [0, "rows", [MAX_SEGMENT_ROWS + 1, 1], "float32"], b"", "too-large"),
    (PUSH, [0, "rows", [2, MAX_SEGMENT_VALUES], "float32"], b"", "too-large"),
    (PULL, [0, "ids", [MAX_SEGMENT_ROWS + 1], "int64"], b"", "too-large"),
    (PULL, [0, "rows", [2, 2], "float32"], GOOD, "bad-dtype"),                # rows in a pull
    (PUSH, [0, "ids", [2], "int64"], _payload([1, 3]), "bad-dtype"),          # ids in a push
    (PUSH, [0, "ids", [1], "int64"], _payload([1, 3]), "length-mismatch"),    # one that pulls
    (PARAMS, [0, "ids", [2], "int64"], _payload([1, 3]), "bad-dtype"),
    (PUSH, [0, "rowz", [2, 2], "float32"], GOOD, "bad-dtype"),                # unknown form
], ids=lambda v: f"{len(v)}B" if isinstance(v, bytes) else str(v).replace(" ", ""))
def test_a_malformed_sparse_segment_is_refused_on_decode(kind, desc, frame, code):
    pulls = {"pull": True} if "length-mismatch" == code and desc[1] == "ids" else None
    with pytest.raises(ProtocolError) as info:
        decode([_header(kind, [desc], pulls if kind == PUSH else None), frame])
    assert info.value.code == code


@pytest.mark.parametrize("pull", [True, False, 1, "yes"])
def test_a_push_carries_ids_only_when_it_pulls(pull):
    """A push with m.pull true asks back rows with its reply (the next batch's): ids travel
    there beside its rows; in any other push they are refused."""
    frames = [_header(PUSH, [[0, "rows", [2, 2], "float32"], [0, "ids", [2], "int64"]],
                      {"pull": pull}), GOOD, _payload([1, 5])]
    if pull is True:
        rows, ids = decode(frames).segments
        assert rows.data.dim == 2 and ids.data.dim == 0 and ids.data.ids.tolist() == [1, 5]
    else:
        with pytest.raises(ProtocolError) as info:
            decode(frames)
        # m.pull that is no flag is refused for itself first
        assert info.value.code == ("bad-dtype" if pull is False else "bad-field")


def _push(*segments):
    return decode(_frames(Message(type=PUSH, segments=list(segments)))).segments


@pytest.mark.parametrize("segments, code, words", [
    # shard 1 of 3 holds ids 1, 4, 7, ... of table 0 (20 rows) and 1, 4 of table 1 (7 rows)
    (lambda: _push(rows_segment(0, torch.tensor([1, 20]), torch.ones(2, 4))),
     "out-of-range", "id 20 of table 0"),
    (lambda: _push(rows_segment(0, torch.tensor([-2]), torch.ones(1, 4))),
     "out-of-range", "id -2"),
    (lambda: _push(rows_segment(0, torch.tensor([4, 5]), torch.ones(2, 4))),
     "out-of-range", "id 5 of table 0 is not shard 1's"),
    (lambda: _push(rows_segment(1, torch.tensor([4, 7]), torch.ones(2, 3))),
     "out-of-range", "id 7 of table 1"),
    (lambda: _push(rows_segment(0, torch.tensor([4, 1, 4]), torch.ones(3, 4))),
     "bad-field", "id 4 of table 0 appears twice"),
    (lambda: _push(rows_segment(0, torch.tensor([4, 1]), torch.ones(2, 4)),
                   rows_segment(0, torch.tensor([7, 1]), torch.ones(2, 4))),
     "bad-field", "id 1 of table 0 appears twice"),                  # across segments
    (lambda: _push(rows_segment(0, torch.tensor([4]), torch.ones(1, 3))),
     "bad-field", "[n, 4], not [1, 3]"),                             # wrong dim
    (lambda: _push(rows_segment(2, torch.tensor([4]), torch.ones(1, 4))),
     "bad-descriptor", "table 2 of a model with 2 tables"),
    (lambda: _push(rows_segment(0, torch.tensor([1, 4]),
                                torch.tensor([[0.0] * 4, [0, float("nan"), 0, 0]]))),
     "non-finite", "NaN or Inf"),
    (lambda: _push(rows_segment(1, torch.tensor([4]),
                                torch.tensor([[float("-inf"), 0, 0]]), "bfloat16")),
     "non-finite", "NaN or Inf"),
])
def test_a_lying_sparse_segment_is_refused_with_its_reason(segments, code, words):
    segs = segments()
    before = [_bits(s.data.payload) for s in segs]
    verdict = check_rows(segs, TABLES, shard=1, shards=3)
    assert verdict is not None and verdict[0] == code and words in verdict[1], verdict
    assert [_bits(s.data.payload) for s in segs] == before  # the check changes nothing


@pytest.mark.parametrize("ids, words", [([0, 19, 5], None), ([3, 20], "id 20 of table 0"),
                                        ([-2, 3], "id -2 of table 0"), ([19], None)])
def test_one_shard_of_one_table_holds_exactly_the_ids_in_range(ids, words):
    """The one-shard path (a least and greatest id, no mask) refuses what the mask would."""
    tables = TABLES[:1]  # 20 rows
    asked = torch.tensor(ids, dtype=torch.int64)
    for segs in (_push(rows_segment(0, asked, torch.ones(len(ids), 4))),  # a push's rows
                 [ids_segment(0, asked)]):                                # a pull's ids
        verdict = check_rows(segs, tables, shard=0, shards=1)
        if words is None:
            assert verdict is None
        else:
            assert verdict[0] == "out-of-range" and words in verdict[1], verdict


def test_honest_rows_and_ids_pass_and_the_finite_scan_can_be_skipped():
    push = _push(rows_segment(0, torch.tensor([19, 1, 4]), torch.ones(3, 4)),
                 rows_segment(1, torch.tensor([1, 4]), torch.ones(2, 3), "float16"))
    assert check_rows(push, TABLES, shard=1, shards=3) is None
    pull = [ids_segment(0, torch.tensor([10, 1])), ids_segment(1, torch.tensor([4]))]
    assert check_rows(pull, TABLES, shard=1, shards=3) is None
    nan = _push(rows_segment(0, torch.tensor([1]), torch.full((1, 4), float("nan"))))
    assert check_rows(nan, TABLES, 1, 3, finite=False) is None


def test_a_message_over_its_total_bound_is_refused_before_its_ids_are_read():
    """4096 segments of 64Ki ids each would make a shard gather 2^28 rows: refused from
    the descriptors (too-large), whatever the ids hold."""
    tables = [TableSpec("t", 1 << 40, 16)]
    per = MAX_SEGMENT_ROWS
    count = MAX_MESSAGE_VALUES // (per * 16) + 1
    asked = [Segment(0, Rows(0, per, 0, "int64", torch.full((8 * per,), 255, dtype=torch.uint8)))
             for _ in range(count)]
    verdict = check_rows(asked, tables, 0, 1)
    assert verdict is not None and verdict[0] == "too-large", verdict
    assert check_rows(asked[:count - 1], tables, 0, 1)[0] == "out-of-range"  # ids of -1


def test_a_hashed_id_space_holds_any_id_its_hash_sends_to_the_shard():
    def parity(ids):  # a stand-in hash: which shard holds what is the caller's hash
        return ids // 2
    tables = [TableSpec("t", 0, 2)]
    ids = torch.tensor([2 ** 62, -8, 2, 3])  # hashes 2^61, -4, 1, 1: shards 0, 0, 1, 1
    assert holds(ids, 1, 2, hash_ids=parity).tolist() == [False, False, True, True]
    assert check_rows(_push(rows_segment(0, ids[:2], torch.ones(2, 2))), tables, 0, 2,
                      hash_ids=parity) is None
    verdict = check_rows(_push(rows_segment(0, ids[1:3], torch.ones(2, 2))), tables, 0, 2,
                         hash_ids=parity)
    assert verdict[0] == "out-of-range" and "id 2 of table 0 is not shard 0's" == \
        verdict[1], verdict


@pytest.mark.parametrize("n", [0, 1, 2, 50, 832, 30_000])
def test_the_numpy_sorts_give_torchs_answers(n):
    """sorted_ids, unique_ids and by_table (numpy's sorts, faster on one thread) equal the
    torch ops they stand for, repeats and negative ids included."""
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(-5, 400, (n,), generator=g)
    table_of = torch.randint(0, 26, (n,), generator=g)
    assert torch.equal(sorted_ids(ids), ids.sort().values)
    assert torch.equal(unique_ids(ids), torch.unique(ids, sorted=True))
    by_id = torch.argsort(ids, stable=True)
    order = by_id[torch.argsort(table_of[by_id], stable=True)]
    got_ids, got_tables = by_table(ids, table_of)
    assert torch.equal(got_ids, ids[order]) and torch.equal(got_tables, table_of[order])


def test_the_numpy_sorts_read_any_view_and_many_tables():
    """Ids viewed from a read-only buffer (as decoded from a frame) or strided, and table
    numbers past 16 bits (no radix key): the same answers as torch's, in fresh memory."""
    raw = torch.tensor([9, -3, 9, 2 ** 62, 0, -3], dtype=torch.int64).numpy().tobytes()
    frozen = torch.frombuffer(raw, dtype=torch.int64)
    strided = torch.arange(40, dtype=torch.int64).flip(0)[::3]
    for ids in (frozen, strided):
        assert torch.equal(sorted_ids(ids), ids.sort().values)
        assert torch.equal(unique_ids(ids), torch.unique(ids, sorted=True))
        assert unique_ids(ids).data_ptr() != ids.data_ptr()
    table_of = torch.tensor([40_000, 3, 40_000, 3, 70_000, 3], dtype=torch.int64)
    by_id = torch.argsort(frozen, stable=True)
    order = by_id[torch.argsort(table_of[by_id], stable=True)]
    got_ids, got_tables = by_table(frozen, table_of)
    assert torch.equal(got_ids, frozen[order]) and torch.equal(got_tables, table_of[order])


def test_a_fixed_table_is_cut_by_id_modulo_shards():
    ids = torch.arange(-1, 11)
    assert holds(ids, 2, 3, rows=10).nonzero().flatten().add(-1).tolist() == [2, 5, 8]
    assert [shard_rows(10, s, 3) for s in range(3)] == [4, 3, 3]
    assert [shard_rows(2, s, 3) for s in range(3)] == [1, 1, 0]


# ---- dense messages unchanged ----------------------------------------------------------

def _dense_messages():
    g = torch.arange(6, dtype=torch.float32) / 4
    yield Message(type=PUSH, worker="w1", incarnation=7, seq=42, clock=3, shard=1,
                  meta={"loss": 0.5, "samples": 32, "pull": True}, token="tok",
                  segments=[Segment(0, g[:4]), Segment(4, g[4:].to(torch.bfloat16))])
    yield Message(type=PUSH, worker="w2", seq=1, shard=0, token="t",
                  segments=[Segment(0, pack_int8(g, 4)), Segment(6, pack_topk(g, 0.5))])
    yield Message(type=PARAMS, shard=2, seq=9, meta={"version": 5, "updates": 5},
                  segments=[Segment(3, g.view(2, 3))])
    yield Message(type=PULL, worker="w", incarnation=1, seq=2, shard=0, token="k",
                  meta={"pull_dtype": "float16"})


# The frames of the four messages above, as the encoder before row-sparse segments (integ at
# fc11090) wrote them.
DENSE_GOLDEN = [
    ["8aa17603a174a470757368a177a27731a16907a1732aa16303a2736801a16d83a46c6f7373cb3fe00000000"
     "00000a773616d706c657320a470756c6cc3a164929300a7666c6f6174333291049304a862666c6f61743136"
     "9102a16ba3746f6b", "000000000000803e0000003f0000403f", "803fa03f"],
    ["8aa17603a174a470757368a177a27732a16900a17301a16300a2736800a16d80a164929400a4696e7438910"
     "6049406a4746f706b910603a16ba174", "0683c13b8542213c002a557f667f",
     "0300000004000000050000000000403f0000803f0000a03f"],
    ["89a17603a174a6706172616d73a177a0a16900a17309a16300a2736802a16d82a776657273696f6e05a7757"
     "0646174657305a164919303a7666c6f61743332920203",
     "000000000000803e0000003f0000403f0000803f0000a03f"],
    ["8aa17603a174a470756c6ca177a177a16901a17302a16300a2736800a16d81aa70756c6c5f6474797065a76"
     "66c6f61743136a16490a16ba16b"],
]


def test_dense_messages_are_the_bytes_they_were():
    assert [[f.hex() for f in _frames(m)] for m in _dense_messages()] == DENSE_GOLDEN


# ---- layout: tables apart from the dense slice -----------------------------------------

class _Recommender(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bottom = torch.nn.Linear(3, 2)
        self.users = torch.nn.Embedding(10, 4)
        self.items = torch.nn.EmbeddingBag(6, 4, mode="sum")
        self.top = torch.nn.Linear(4, 1)


def test_embedding_tables_are_found_and_laid_out_apart():
    torch.manual_seed(0)
    model = _Recommender()
    names = embedding_tables(model)
    assert names == ["users.weight", "items.weight"]
    layout = Layout.of(model, names)
    assert layout.tables == [TableSpec("users.weight", 10, 4), TableSpec("items.weight", 6, 4)]
    assert [(s.name, s.offset, s.numel) for s in layout.specs] == \
        [("bottom.weight", 0, 6), ("bottom.bias", 6, 2), ("top.weight", 8, 4),
         ("top.bias", 12, 1)]
    assert layout.total == 13
    flat = layout.flatten(model)
    assert torch.equal(flat, torch.cat([model.bottom.weight.detach().reshape(-1),
                                        model.bottom.bias.detach(),
                                        model.top.weight.detach().reshape(-1),
                                        model.top.bias.detach()]))
    params, grads = torch.zeros(13), torch.zeros(13)
    users = model.users.weight.data_ptr()
    layout.bind(model, params, grads)
    assert model.top.bias.data.data_ptr() == params[12:].data_ptr()
    assert model.users.weight.data_ptr() == users  # a table stays the model's own
    assert set(layout.state_dict(params)) == {s.name for s in layout.specs}
    assert layout.shard_ranges(20)[:2] == [(0, 0), (0, 1)]  # more shards than dense values


def test_the_signature_names_the_tables_and_is_unchanged_without():
    model = _Recommender()
    plain, apart_ = Layout.of(model).signature(), Layout.of(model, ["users.weight"]).signature()
    body = {"names": plain["names"], "shapes": plain["shapes"], "dtypes": plain["dtypes"]}
    assert plain["digest"] == \
        hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    assert "tables" not in plain and Layout.of(model).tables == []
    assert apart_["names"] == plain["names"] and apart_["tables"] == [["users.weight", 10, 4]]
    assert apart_["digest"] == hashlib.sha256(json.dumps(
        {**body, "tables": [["users.weight", 10, 4]]}, sort_keys=True).encode()
    ).hexdigest()[:16]
    assert signature_mismatch(apart_, apart_) == ""
    assert "tables" in signature_mismatch(apart_, plain)
    assert "tables" in signature_mismatch(plain, apart_)
    with pytest.raises(ConfigError, match="'bottom.bias' is not a 2-D parameter"):
        Layout.of(model, ["bottom.bias"])


# ---- joined frames (PROTOCOL.md, Joined frames) ---------------------------------------------

def _step_push(tables=26, per=25, dim=16):
    """A ctr-like push that pulls: a dense gradient, each table's rows, each table's ids."""
    g = torch.Generator().manual_seed(5)
    rows = [rows_segment(t, torch.randperm(1000, generator=g)[:per], torch.randn(per, dim))
            for t in range(tables)]
    ids = [ids_segment(t, torch.randperm(1000, generator=g)[:per]) for t in range(tables)]
    return Message(type=PUSH, worker="w", seq=1, shard=0, token="k", meta={"pull": True},
                   segments=[Segment(0, torch.arange(8, dtype=torch.float32)), *rows, *ids])


def test_consecutive_row_segments_travel_in_one_frame_and_come_back_each_bit_for_bit():
    msg = _step_push()
    frames = _frames(msg)
    header = msgpack.unpackb(frames[0])
    assert header["j"] == [1, 52] and len(frames) == 3  # header, dense, the 52 joined
    assert len(frames[2]) == sum(seg.data.nbytes for seg in msg.segments[1:])
    back = decode(frames)
    assert len(back.segments) == 53
    for sent, got in zip(msg.segments[1:], back.segments[1:]):
        assert (got.data.table, got.data.n, got.data.dim) == (sent.data.table, sent.data.n,
                                                               sent.data.dim)
        assert _bits(got.data.payload) == _bits(sent.data.payload)


def test_a_dense_message_or_a_lone_rows_segment_has_no_j():
    dense = Message(type=PUSH, worker="w", seq=1, shard=0, token="k",
                    segments=[Segment(0, torch.ones(4)), Segment(4, torch.ones(4))])
    assert "j" not in msgpack.unpackb(_frames(dense)[0])
    one = Message(type=PUSH, worker="w", seq=1, shard=0, token="k",
                  segments=[Segment(0, torch.ones(4)), rows_segment(0, torch.tensor([1]),
                                                                    torch.ones(1, 4))])
    assert "j" not in msgpack.unpackb(_frames(one)[0])


def test_joined_frames_stay_within_the_frame_bound():
    n = 60_000  # 60,000 x 16 float32 + ids: 4.3 MB, alone above the bound: a frame each
    segs = [rows_segment(t, torch.arange(n), torch.zeros(n, 16)) for t in range(2)]
    segs += [rows_segment(2 + t, torch.arange(1000), torch.zeros(1000, 16)) for t in range(70)]
    msg = Message(type=PUSH, worker="w", seq=1, shard=0, token="k", segments=segs)
    frames = _frames(msg)
    joins = msgpack.unpackb(frames[0])["j"]
    assert sum(joins) == 72 and joins[:2] == [1, 1] and len(joins) > 3
    assert all(len(f) <= FRAME_BYTES for f, k in zip(frames[1:], joins) if k > 1)
    assert len(decode(frames).segments) == 72


def _with_header(frames, **change):
    header = msgpack.unpackb(frames[0])
    header.update(change)
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize("joins, code", [
    ("52", "bad-field"), ([1, 0, 52], "bad-field"), ([1], "bad-field"), ([1, 51], "frame-count"),
    ([1, 53], "frame-count"), ([1.0, 52], "bad-field"), ([2, 51], "bad-descriptor")])
def test_a_lying_j_is_refused_with_its_code(joins, code):
    with pytest.raises(ProtocolError) as err:
        decode(_with_header(_frames(_step_push()), j=joins))
    assert err.value.code == code


@pytest.mark.parametrize("cut", [-1, 1])
def test_a_joined_frame_of_another_length_than_its_segments_is_a_length_mismatch(cut):
    frames = _frames(_step_push())
    frames[2] = frames[2][:cut] if cut < 0 else frames[2] + b"\0"
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.code == "length-mismatch"


def test_j_beside_a_shared_area_is_a_frame_count():
    frames = _frames(_step_push())
    with pytest.raises(ProtocolError) as err:
        decode(_with_header(frames[:1], x=5, j=[]))
    assert err.value.code == "frame-count"
