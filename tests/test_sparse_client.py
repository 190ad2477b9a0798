"""The worker's client with row-sparse tables (workers/client.py), against a shard played by
hand over real sockets on 127.0.0.1: what it sends each shard and what it makes of replies.

The played server keeps no tables: the row of id ``i`` is ``i + [0, 1, ..., dim)`` / 8, a
function of the id alone, so an exact oracle for any id space. It answers as PROTOCOL.md
says (a push's parts gathered, a reply of several segments in parts), or lies when told.
"""

import threading

import pytest
import torch
import zmq

from asyncsgd.core.sparse_ids import hash_id
from asyncsgd.wire.layout import Layout, holds
from asyncsgd.wire.protocol import (BYE, HEARTBEAT, HELLO, PARAMS, PULL, PUSH, WELCOME, Key,
                                    Message, ProtocolError, Rows, in_parts, rows_bytes, split)
from asyncsgd.wire.sparse import apart, rows_reply
from asyncsgd.wire.transport import recv_from, router, send
from asyncsgd.workers.client import PSClient

pytestmark = pytest.mark.processes  # sockets, on 127.0.0.1

DIM = 4


def row_of(ids: torch.Tensor, dim: int = DIM) -> torch.Tensor:
    return (ids.to(torch.float32)[:, None] + torch.arange(dim, dtype=torch.float32)) / 8


class Model(torch.nn.Module):
    def __init__(self, rows=100):
        super().__init__()
        self.a = torch.nn.Embedding(rows, DIM)
        self.b = torch.nn.Embedding(rows, DIM)
        self.head = torch.nn.Linear(DIM, 3)


class PlayedServer:
    """A front and ``shards`` shards on 127.0.0.1, in a thread; ``pushed``: per shard the
    (table, ids, values, dtype) of every rows segment it took, ``asked`` its ids segments."""

    def __init__(self, layout: Layout, shards: int = 2, id_space=None, lie: bool = False,
                 whole: bool = False, drop_first: bool = False):
        self.layout, self.lie, self.id_space, self.whole = layout, lie, id_space, whole
        self.drop_first = drop_first  # leave the first push unanswered: the client re-sends
        self.ack_extra: dict = {}  # more fields of every push's acknowledgement
        self.ctx = zmq.Context()
        self.front, self.endpoint = router(self.ctx, "tcp://127.0.0.1:0")
        self.ranges = layout.shard_ranges(shards)
        self.socks = [router(self.ctx, "tcp://127.0.0.1:0")[0] for _ in range(shards)]
        self.params = torch.arange(layout.total, dtype=torch.float32)
        self.pushed = [[] for _ in range(shards)]
        self.asked = [[] for _ in range(shards)]
        self.stray = []  # (shard, table, id) of ids sent to a shard that does not hold them
        self.parts: dict = {}
        self.refused = []  # what its decoder refused: a client's malformed message
        self.taken = []  # (shard, type, seq, [(table, ids, values)]) of each, as it came
        # (shard, type, ids asked per table, tensor bytes) of every push and pull
        self.requests = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        poller = zmq.Poller()
        for sock in [self.front, *self.socks]:
            poller.register(sock, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                peer, msg = recv_from(sock)
                if isinstance(msg, ProtocolError):
                    self.refused.append(msg)
                    continue
                if sock is self.front:
                    self._front(peer, msg)
                else:
                    self._shard(self.socks.index(sock), peer, msg)

    def _front(self, peer, msg):
        if msg.type == HELLO:
            shards = [{Key.PORT: int(s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]),
                       Key.START: a, Key.END: b} for s, (a, b) in zip(self.socks, self.ranges)]
            meta = {Key.SHARDS: shards, Key.CONSISTENCY: "async", Key.TOTAL: self.layout.total,
                    Key.INSTANCE: "played", Key.TOKEN: "t", Key.HEARTBEAT_TIMEOUT: 10.0}
            if self.id_space is not None:
                meta["id_space"] = self.id_space
            send(self.front, Message(type=WELCOME, seq=msg.seq, meta=meta), peer)
        elif msg.type == BYE:
            send(self.front, Message(type=BYE, seq=msg.seq), peer)

    def _shard(self, i, peer, msg):
        sock = self.socks[i]
        if msg.type in (HEARTBEAT, BYE):
            send(sock, Message(type=msg.type, seq=msg.seq, shard=i), peer)
            return
        if msg.type == PUSH and Key.PARTS in msg.meta:  # gathered until its last part
            held = self.parts.setdefault(msg.seq, [])
            held.extend(msg.segments)
            if msg.meta[Key.PART] < msg.meta[Key.PARTS] - 1:
                return
            msg.segments = self.parts.pop(msg.seq)
        dense, rows = apart(msg.segments)
        asked = [seg for seg in rows if not seg.data.dim]
        wanted = {}
        for seg in asked:
            wanted.setdefault(seg.data.table, []).extend(seg.data.ids.tolist())
        payload = sum(seg.data.nbytes if type(seg.data) is Rows else
                      seg.data.numel() * seg.data.element_size() for seg in msg.segments)
        self.requests.append((i, msg.type, wanted, payload))
        self.taken.append((i, msg.type, msg.seq, [(s.data.table, s.data.ids.clone(),
                                                   s.data.values.clone()) for s in rows]))
        if self.drop_first and msg.type == PUSH:
            self.drop_first = False
            return
        hashed = hash_id if self.id_space == "hashed" else None
        for seg in rows:
            spec = self.layout.tables[seg.data.table]
            ids = seg.data.ids.clone()
            mine = holds(ids, i, len(self.socks), spec.rows, hashed)
            self.stray += [(i, seg.data.table, int(x)) for x in ids[~mine]]
            if seg.data.dim:
                self.pushed[i].append((seg.data.table, ids, seg.data.values.float().clone(),
                                       seg.data.dtype))
            else:
                self.asked[i].append((seg.data.table, ids))
        start, end = self.ranges[i]
        segments = split(self.params[start:end])
        for seg in asked:
            ids = seg.data.ids.clone()
            dim = self.layout.tables[seg.data.table].dim
            values = row_of(ids, dim)
            if self.lie:  # the rows of other ids than asked
                values, seg = row_of(ids + 1, dim), rows_reply(seg, values)
                seg.data.ids.add_(1)
            else:
                seg = rows_reply(seg, values)
            segments.append(seg)
        meta = {Key.VERSION: 1}
        if msg.type == PUSH:
            meta[Key.ACK] = {Key.APPLIED: True, Key.STALENESS: 0, **self.ack_extra}
        reply = Message(type=PARAMS, seq=msg.seq, shard=i, meta=meta, segments=segments)
        for part in in_parts(reply) if len(segments) > 1 and not self.whole else [reply]:
            send(sock, part, peer)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        for sock in [self.front, *self.socks]:
            sock.close(0)
        self.ctx.term()


@pytest.fixture
def played(request):
    """Start a played server and a client of it: (server, client, layout)."""
    servers = []

    def start(model, **kw):
        layout = Layout.of(model, ["a.weight", "b.weight"])
        server = PlayedServer(layout, **{k: v for k, v in kw.items() if k != "compressor"})
        servers.append(server)
        client = PSClient(server.endpoint, "w", layout.signature(), rank=0, world=1,
                          heartbeat=0.5, server_timeout=10,
                          **{k: v for k, v in kw.items() if k == "compressor"})
        request.addfinalizer(client.close)
        return server, client, layout
    yield start
    for server in servers:
        server.close()


def ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def test_rows_go_to_their_shards_and_come_back_in_the_order_asked(played):
    server, client, layout = played(Model())
    params = torch.zeros(layout.total)
    push = [(ids(1, 2, 7, 10), torch.randn(4, DIM)), (ids(0, 99), torch.randn(2, DIM))]
    want = [ids(3, 4, 5, 8, 9), ids(6, 11, 98)]
    got = client.push_pull(torch.ones(layout.total), params, rows=push, want=want)
    assert torch.equal(params, server.params)  # the dense slice, as before
    for t, table_ids in enumerate(want):
        assert torch.equal(got[t], row_of(table_ids))
    assert server.stray == []
    for t, (table_ids, values) in enumerate(push):  # every row once, on its shard, float32
        taken = [(i, s) for i in range(2) for s in server.pushed[i] if s[0] == t]
        all_ids = torch.cat([s[1] for _, s in taken])
        assert sorted(all_ids.tolist()) == sorted(table_ids.tolist())
        for i, (_, sent, vals, dtype) in taken:
            assert dtype == "float32" and bool((sent % 2 == i).all())
            at = [table_ids.tolist().index(x) for x in sent.tolist()]
            assert torch.equal(vals, values[at])
    assert client.stats["rows_pushed"] == 6 and client.stats["rows_pulled"] == 8
    # a pull of rows alone: the ids go in the pull, nothing is pushed
    got = client.push_pull(None, params, want=[ids(42), ids(43, 44)])
    assert torch.equal(got[1], row_of(ids(43, 44)))
    assert client.stats["rows_pushed"] == 6


def test_bytes_sent_count_the_rows(played):
    server, client, layout = played(Model())
    params, grads = torch.zeros(layout.total), torch.ones(layout.total)
    sent = client.stats["bytes_sent"]
    client.push_pull(grads, params)
    dense = client.stats["bytes_sent"] - sent
    n = 20
    sent = client.stats["bytes_sent"]
    client.push_pull(grads, params, rows=[(torch.arange(n), torch.randn(n, DIM)),
                                          (ids(), torch.zeros(0, DIM))])
    # the rows' frames (ids and values), and the headers of the parts they travel in
    extra = client.stats["bytes_sent"] - sent - dense
    assert rows_bytes(n, DIM, "float32") <= extra <= rows_bytes(n, DIM, "float32") + 512


def test_a_hashed_id_space_routes_by_the_hash_of_each_id(played):
    server, client, layout = played(Model(), shards=3, id_space="hashed")
    assert client.hashed
    raw = ids(10 ** 12, -5, 7, 1 << 62, 123456789)
    got = client.push_pull(torch.ones(layout.total), torch.zeros(layout.total),
                           rows=[(raw, torch.randn(5, DIM)), (ids(), torch.zeros(0, DIM))],
                           want=[raw, ids(1)])
    assert server.stray == []
    assert torch.equal(got[0], row_of(raw))
    owners = {i for i in range(3) for s in server.pushed[i] for _ in s[1]}
    assert len(owners) > 1  # the hash spreads them


def test_many_rows_travel_in_several_segments_and_parts(played):
    rows = 200_000  # above the 65,536 rows one segment may hold; 6.4 MB: a push in parts
    server, client, layout = played(Model(rows), shards=1)
    every = torch.arange(rows)
    got = client.push_pull(torch.ones(layout.total), torch.zeros(layout.total),
                           rows=[(every, torch.ones(rows, DIM)), (ids(3), torch.ones(1, DIM))],
                           want=[every, ids(5)])
    assert len(server.pushed[0]) == 5 and len(server.asked[0]) == 5
    assert [kind for _, kind, _, _ in server.requests] == [PUSH]  # one push, gathered
    assert torch.equal(got[0], row_of(every))


def test_rows_are_pushed_as_the_dense_part_is_cast(played):
    from asyncsgd.wire.compression import Compressor
    server, client, layout = played(Model(), compressor=Compressor("none", 0.0, "bf16"))
    values = torch.randn(3, DIM)
    client.push_pull(torch.ones(layout.total), torch.zeros(layout.total),
                     rows=[(ids(0, 2, 4), values), (ids(), torch.zeros(0, DIM))])
    (_, sent, vals, dtype), = server.pushed[0]
    assert dtype == "bfloat16" and torch.equal(vals, values.bfloat16().float())


def test_a_reply_with_other_rows_than_asked_stops_the_worker(played):
    server, client, layout = played(Model(), lie=True)
    params = torch.zeros(layout.total)
    with pytest.raises(ProtocolError, match="other rows than this worker asked"):
        client.push_pull(None, params, want=[ids(1, 2), ids(3)])


def test_a_whole_reply_is_checked_before_anything_is_copied(played):
    server, client, layout = played(Model(), lie=True, shards=1, whole=True)
    params = torch.full((layout.total,), -1.0)
    with pytest.raises(ProtocolError, match="other rows"):
        client.push_pull(None, params, want=[ids(1), ids()])
    assert bool((params == -1).all())


def test_shared_memory_is_refused_with_tables():
    model = Model()
    layout = Layout.of(model, ["a.weight", "b.weight"])
    with pytest.raises(ValueError, match="tables travel row by row"):
        PSClient("tcp://127.0.0.1:1", "w", layout.signature(), rank=0, world=1,
                 transport="shared", server_timeout=0.5)


def test_a_pull_without_tables_is_as_before(played):
    server, client, layout = played(Model())
    got = client.push_pull(None, torch.zeros(layout.total))
    assert got is None and server.asked == [[], []]


def test_the_worker_pulls_each_batchs_rows_with_the_previous_push(tmp_path):
    """The real worker loop on ctr: one pull for the first batch's rows, then every push
    carries the next batch's ids; every step trains on exactly its batch's rows."""
    from asyncsgd.config import WorkerConfig, make_config
    from asyncsgd.core.signature import PS_PARTITION_SEED
    from asyncsgd.core.tasks import epoch_order, partition_indices, task_of
    from asyncsgd.workers.worker import run_worker

    given = dict(task="ctr:rows=100", samples=300, epochs=1, batch_size=32, progress="off",
                 heartbeat=0.5, server_timeout=10)
    cfg = make_config(WorkerConfig, None, given)
    task = task_of(cfg)
    model = task.build_model(0)
    layout = Layout.of(model, task.served_tables(model))
    server = PlayedServer(layout, shards=2)
    try:
        cfg = make_config(WorkerConfig, None, {**given, "server": server.endpoint})
        result = run_worker(cfg)
    finally:
        server.close()
    part = partition_indices(len(task.train), 1, 0, PS_PARTITION_SEED)
    order = epoch_order(part, cfg.seed, 0, 0)
    batches = [order[k:k + 32] for k in range(0, len(order), 32)]
    want = [[sorted(set(task.train.rows(b)[0][1][:, t].tolist())) for t in range(26)]
            for b in batches]
    for shard in range(2):
        seen = [(kind, wanted) for i, kind, wanted, _ in server.requests if i == shard]
        kinds = [kind for kind, _ in seen]
        # the start's pull, the first batch's rows, then one push a step and no other pull
        assert kinds == [PULL, PULL] + [PUSH] * len(batches)
        asked = [wanted for _, wanted in seen[1:]]
        for step, wanted in enumerate(asked[:len(batches)]):
            for t in range(26):
                mine = [x for x in want[step][t] if x % 2 == shard]
                assert wanted.get(t, []) == mine, (shard, step, t)
        assert asked[-1] == {}  # the last push asks for nothing
        # every push's bytes are what its rows imply: the dense slice, then per table the
        # batch's n unique ids of this shard, 8 bytes each, with 16 float32s each, and 8
        # bytes for each id of the next batch it asks for
        start, end = server.ranges[shard]
        pushes = [payload for i, kind, _, payload in server.requests if i == shard and
                  kind == PUSH]
        for step, payload in enumerate(pushes):
            rows = sum(len([x for x in ids if x % 2 == shard]) for ids in want[step])
            ahead = sum(len([x for x in ids if x % 2 == shard])
                        for ids in (want[step + 1] if step + 1 < len(want) else []))
            assert payload == 4 * (end - start) + rows * (8 + 16 * 4) + 8 * ahead, step
    assert result.steps == result.pushes == len(batches)
    total = sum(len(ids) for batch in want for ids in batch)
    assert result.stats["rows_pulled"] == total == result.stats["rows_pushed"]


class MovingServer(PlayedServer):
    """A played server whose dense parameters move by 1000 after every message, as other
    workers' pushes would move them; ``dense_pushed``: each push's dense values."""

    def __init__(self, *args, **kw):
        self.dense_pushed = []
        super().__init__(*args, **kw)

    def _shard(self, i, peer, msg):
        if msg.type == PUSH:
            self.dense_pushed.append(torch.cat([s.data for s in apart(msg.segments)[0]]))
        super()._shard(i, peer, msg)
        self.params += 1000


def train_table_counter(ack_extra=None, **given):
    """The real worker loop, one epoch of tasks_for_tests:table_counter at local lr 1,
    against a MovingServer of one shard (``ack_extra``: more fields of its push
    acknowledgements): (its result, the server)."""
    from asyncsgd.config import WorkerConfig, make_config
    from asyncsgd.core.tasks import task_of
    from asyncsgd.workers.worker import run_worker

    given = dict(task="tasks_for_tests:table_counter", epochs=1, progress="off", local_lr=1.0,
                 heartbeat=0.5, server_timeout=10, **given)
    task = task_of(make_config(WorkerConfig, None, given))
    model = task.build_model(0)
    server = MovingServer(Layout.of(model, task.served_tables(model)), shards=1)
    server.ack_extra = ack_extra or {}
    try:
        return run_worker(make_config(WorkerConfig, None,
                                      {**given, "server": server.endpoint})), server
    finally:
        server.close()


def test_a_window_pulled_on_its_own_measures_its_change_from_that_pull():
    """--local-steps with tables: no push brought the first window's rows, so a pull of its
    own does, and brings newer dense parameters with them; the pseudo-gradient is measured
    from those. table_counter's scalar has the batch size (8) for gradient whatever its
    value, so at local lr 1 a window of 4 steps pushes exactly 32 and the last of 2 steps
    16, not 32 minus the 1000 the parameters moved between the start's pull and the
    window's."""
    result, server = train_table_counter(samples=48, local_steps="4")
    assert (result.steps, result.pushes) == (6, 2)
    assert [d.tolist() for d in server.dense_pushed] == [[32.0], [16.0]]
    kinds = [kind for _, kind, _, _ in server.requests]
    assert kinds == [PULL, PULL, PUSH, PUSH]  # the start's, the first window's, 2 pushes


def test_a_window_that_shrinks_at_a_push_trains_on_the_rows_that_push_brought():
    """--local-steps auto:4 (DyLU): shard 0's first acknowledgement sets H to 2, after the
    push had asked for the rows of 4 batches. The 2-batch window is their first half, so
    it trains on those rows with no pull of its own: 2 pulls (the start's, the first
    window's) and 5 pushes over 12 batches, of 4, 2, 2, 2 and 2 steps (8 a step)."""
    result, server = train_table_counter(samples=96, local_steps="auto:4",
                                         ack_extra={Key.LOCAL_STEPS: 2})
    assert (result.steps, result.pushes) == (12, 5)
    assert [d.tolist() for d in server.dense_pushed] == [[32.0], [16.0], [16.0], [16.0],
                                                          [16.0]]
    assert [kind for _, kind, _, _ in server.requests] == [PULL, PULL] + [PUSH] * 5


def test_the_push_of_a_worker_out_of_time_asks_for_no_rows():
    """--max-seconds ends a worker inside a window (H = 8, 0.5 s a step, 2 s): its last
    push carries the steps it took and asks for no rows, which nothing would train on."""
    result, server = train_table_counter(samples=96, local_steps="8", delay="const:500ms",
                                         max_seconds=2)
    assert 1 <= result.steps < 8 and result.pushes == 1, result
    assert [d.tolist() for d in server.dense_pushed] == [[8.0 * result.steps]]
    kind, wanted = server.requests[-1][1:3]
    assert kind == PUSH and wanted == {}


def test_a_push_left_unanswered_is_sent_again_with_the_same_rows(played):
    server, client, layout = played(Model(), shards=1, drop_first=True)
    push = [(ids(1, 2, 7), torch.randn(3, DIM)), (ids(5), torch.randn(1, DIM))]
    got = client.push_pull(torch.ones(layout.total), torch.zeros(layout.total), rows=push,
                           want=[ids(3), ids(4, 9)])
    assert torch.equal(got[1], row_of(ids(4, 9)))
    first, again = [entry for entry in server.taken if entry[1] == PUSH]
    assert first[2] == again[2] and client.stats["retries"] == 1  # the same seq: one push
    for (t1, ids1, v1), (t2, ids2, v2) in zip(first[3], again[3], strict=True):
        assert t1 == t2 and torch.equal(ids1, ids2) and torch.equal(v1, v2)
