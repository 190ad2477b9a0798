"""The worker's common step (``PSClient._push_pull_whole``): one pass when the reply only
acknowledges the push, the general handling for every other answer; a real ps-server."""

import torch

from asyncsgd.wire.layout import Layout
from asyncsgd.workers.client import PSClient
from conftest import shard_stats
from tasks_for_tests import index_counter


def _counted(method):
    """``method``, counting its calls in ``.calls``."""
    def call(*args, **kwargs):
        call.calls += 1
        return method(*args, **kwargs)

    call.calls = 0
    return call


def _updates(srv) -> int:
    """The updates the server's one shard applied."""
    port, = srv.stats()["shard_ports"]
    return shard_stats(srv, port)["updates"]


def _serve(server, *args):
    srv = server("--task", "tasks_for_tests:index_counter", "--samples", 1000,
                 "--eval-every", 1000, "--no-exit-when-done", *args)
    return srv, Layout.of(index_counter(1000).build_model())


def _client(srv, layout, worker: str) -> PSClient:
    return PSClient(srv.address, worker, layout.signature(), rank=0, world=1,
                    server_timeout=20, transport="tcp")


def _exact_steps(client, params, total, steps: int) -> None:
    """``steps`` push+pulls of random integer gradients; after each the parameters are
    exactly minus the sum of all pushed (``total``, updated)."""
    for step in range(steps):
        grad = torch.randint(-4, 5, (len(params),)).float()
        client.push_pull(grad, params)
        total += grad
        assert torch.equal(params, -total), f"step {step}: not exact"


def test_plain_replies_take_one_pass_and_the_parameters_stay_exact(server):
    """20 steps of a 1-shard model: every reply only acknowledges its push, so none goes
    through ``_handle``; the parameters are exactly minus the gradients' sum each step."""
    srv, layout = _serve(server)
    params, total = torch.zeros(layout.total), torch.zeros(layout.total)
    with _client(srv, layout, "one-pass") as client:
        client._handle = _counted(client._handle)
        _exact_steps(client, params, total, 20)
        assert client.versions == [20] and client._handle.calls == 0
        assert client.stats["bytes_sent"] > 0 and client.stats["bytes_received"] > 0
    assert _updates(srv) == 20


def test_a_duplicate_is_answered_through_the_general_handling_and_applied_once(server):
    """A push sent again under its old sequence number (as after a lost reply): the shard
    acknowledges a duplicate, which the common step hands to ``_handle`` (it counts it);
    the push is applied once, and the steps after it take one pass again."""
    srv, layout = _serve(server)
    params, total = torch.zeros(layout.total), torch.zeros(layout.total)
    with _client(srv, layout, "again") as client:
        grad = torch.ones(layout.total)
        client.push_pull(grad, params)
        total += grad
        client._handle = _counted(client._handle)
        client.seq -= 1  # the same push again, under the same number
        client.push_pull(grad, params)
        assert client.stats["duplicate_acks"] == 1 and client._handle.calls >= 1
        assert torch.equal(params, -total), "a duplicate was applied"
        handled = client._handle.calls
        _exact_steps(client, params, total, 3)
        assert client._handle.calls == handled
    assert _updates(srv) == 4


def test_a_model_of_two_shards_takes_the_general_path_exactly(server):
    """Two shards: the general exchange (each shard's reply through ``_handle``), exact."""
    srv, layout = _serve(server, "--shards", 2)
    params, total = torch.zeros(layout.total), torch.zeros(layout.total)
    with _client(srv, layout, "two") as client:
        client._handle = _counted(client._handle)
        _exact_steps(client, params, total, 5)
        assert client._handle.calls >= 10  # both shards' replies, each step
