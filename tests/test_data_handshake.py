"""The handshake checks the data as well as the model (PROTOCOL.md, Data): a worker about to
train the server's model on other data is refused in one line, and the server goes on."""

import pytest
import torch
from conftest import finish, one_line_error, read_json, worker
from tasks_for_tests import blob_dataset

from asyncsgd.core.signature import FIELDS, data_mismatch, data_signature
from asyncsgd.core.tasks import Split, Task, load_task, task_identity
from asyncsgd.wire.protocol import ERROR, HELLO, WELCOME, Code, Key, Message, encode

BLOBS = "tasks_for_tests:blob_dataset"


def test_a_worker_on_other_data_is_refused_in_one_line_and_the_server_keeps_serving(
        server, cli_env, run_cli):
    srv = server("--task", "mnist1d-cnn", "--shards", 1)  # the default data: 5,000 samples
    res = run_cli("worker", "--server", srv.address, "--samples", 6000, "--progress", "off",
                  "--threads", 1, "--server-timeout", 30, timeout=120)
    one_line_error(res, "other data than the server's", "4,800 training and 1,200 test",
                   "the server 4,000 and 1,000", "--task mnist1d-cnn, no --samples")
    assert res.returncode == 2
    assert srv.proc.poll() is None
    assert srv.stats()["refused_handshakes"] == 1
    (code, out, err), = finish([worker(cli_env, srv.address, 0, 1, "--epochs", 1)])
    assert code == 0 and "125 steps" in out, err  # 4,000 rows of batch 32: the server's data
    code, _, err = srv.wait()
    assert code == 0, err
    summary = read_json(srv.out / "summary.json")
    assert len(summary["workers_joined"]) == 1 and summary["refused_handshakes"] == 1


def _hello(srv, data, worker="probe"):
    meta = {Key.SIGNATURE: srv.signature(), Key.RANK: 0, Key.WORLD: 1}
    if data is not None:
        meta[Key.DATA] = data
    return srv.request(encode(Message(type=HELLO, worker=worker, incarnation=1, seq=1,
                                      meta=meta)))


def test_hellos_with_malformed_or_other_data_are_refused_and_the_server_goes_on(server):
    srv = server("--task", BLOBS, "--seed", 1, "--no-exit-when-done")
    ours = data_signature(load_task(BLOBS, seed=1), BLOBS, 1)
    assert ours["seed"] == 1 and ours["train"] == 1600 and ours["test"] == 400
    malformed = [7, [], {}, {**ours, "extra": 1}, {**ours, "train": "1600"},
                 {**ours, "train": True}, {**ours, "seed": 1.0}, {**ours, "task": ["x"]},
                 {k: v for k, v in ours.items() if k != "digest"}, {**ours, "digest": None}]
    for data in malformed:
        reply = _hello(srv, data)
        assert reply.type == ERROR and reply.meta[Key.CODE] == Code.DATA_MISMATCH, (data, reply)
        assert "run the same asyncsgd version" in reply.meta[Key.ERROR]
    other = {  # each differs from ours in one field: the refusal names both values
        "seed": (data_signature(load_task(BLOBS, seed=0), BLOBS, 0),
                 ["seed 0, the server with seed 1", f"--task {BLOBS}, no --samples, --seed 1"]),
        "samples": (data_signature(load_task(BLOBS, samples=1000, seed=1), BLOBS, 1),
                    ["800 training and 200 test samples, the server 1,600 and 400"]),
        "task": ({**ours, "task": "mnist1d-cnn"},
                 ["builds task 'mnist1d-cnn', the server 'tasks_for_tests:blob_dataset'"]),
        "partition": ({**ours, "partition": "round-robin"},
                      ["'round-robin', the server as 'seeded-permutation-split/1 seed 0'",
                       "run the same asyncsgd version"]),
        "digest": ({**ours, "digest": "0" * 16},
                   [f"digest '{'0' * 16}' on the worker, '{ours['digest']}' on the server"]),
    }
    for what, (data, fragments) in other.items():
        reply = _hello(srv, data)
        assert reply.type == ERROR and reply.meta[Key.CODE] == Code.DATA_MISMATCH, (what, reply)
        for fragment in fragments:
            assert fragment in reply.meta[Key.ERROR], (what, reply.meta[Key.ERROR])
    assert srv.proc.poll() is None
    assert _hello(srv, ours).type == WELCOME
    assert _hello(srv, None).type == WELCOME  # no claim about data: not checked
    assert srv.stats()["refused_handshakes"] == len(malformed) + len(other)


def test_the_data_signature_tells_data_apart_cheaply():
    assert task_identity("lm", 5) == task_identity("lm:layers=4,width=128", 5)
    assert task_identity("lm", 5)[1] is None  # lm takes no seed: every seed, the same data
    assert task_identity("lm:context=64", 0) != task_identity("lm", 0)
    assert task_identity(BLOBS, 5) == (BLOBS, 5)  # no options beyond the offered ones
    x = torch.arange(12.0).view(6, 2)
    y = torch.tensor([0, 1, 2, 0, 1, 2])

    def task(xs, ys):
        return Task(name="t", model_fn=lambda: torch.nn.Linear(2, 3),
                    train=Split((xs,), ys), test=Split((xs[:2],), ys[:2]))

    def sig(t):
        return data_signature(t, "lm", 0)

    assert sig(task(x, y)) == sig(task(x.clone(), y.clone()))
    assert sig(task(x, y.flip(0)))["digest"] != sig(task(x, y))["digest"]  # other labels
    assert sig(task(x.view(6, 2, 1), y))["digest"] != sig(task(x, y))["digest"]  # shapes
    assert sig(task(x.double(), y))["digest"] != sig(task(x, y))["digest"]  # dtypes
    assert sig(task(x + 1, y)) == sig(task(x, y))  # float inputs are not hashed
    datasets = sig(blob_dataset())
    assert datasets == sig(blob_dataset()) and set(datasets) == set(FIELDS)
    assert data_mismatch(datasets, dict(datasets), "--task x") == ""


@pytest.mark.parametrize("theirs", [None, 7, "x", [1], {"task": {}}, {1: 2}, {"": None}])
def test_data_mismatch_never_raises_on_what_the_network_sends(theirs):
    ours = data_signature(blob_dataset(), BLOBS, 0)
    assert "run the same asyncsgd version" in data_mismatch(ours, theirs, "--task x")
