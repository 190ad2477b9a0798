"""Where a server listens by default (friction 11): loopback for one host; all interfaces
only when asked (--bind tcp://0.0.0.0:PORT) or when a ps-job spans hosts."""

from asyncsgd.config import JobConfig, ServerConfig
from asyncsgd.jobs.roles import advertised_host, job_bind
from asyncsgd.jobs.torchrun import Launch
from asyncsgd.wire.security import exposed_warning

# torchrun --standalone --nnodes 1 --nproc-per-node 4, and one rank of --nnodes 2 x 2
STANDALONE = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
              "MASTER_ADDR": "localhost", "MASTER_PORT": "29400"}
TWO_NODES = dict(STANDALONE, LOCAL_WORLD_SIZE="2")


def test_ps_server_listens_on_loopback_unless_told_otherwise():
    assert ServerConfig().bind == "tcp://127.0.0.1:5555"
    assert exposed_warning("127.0.0.1", None) == ""
    assert exposed_warning("0.0.0.0", None).startswith(
        "WARNING: this server listens on 0.0.0.0 WITHOUT authentication")


def test_a_ps_job_on_one_host_binds_loopback_and_one_across_hosts_all_interfaces():
    assert JobConfig().bind is None
    one, two = Launch.from_env(STANDALONE), Launch.from_env(TWO_NODES)
    assert job_bind(None, one.local_world, one.world) == "tcp://127.0.0.1:0"
    assert job_bind(None, two.local_world, two.world) == "tcp://0.0.0.0:0"
    assert job_bind(None, 0, 4) == "tcp://0.0.0.0:0", "torchrun did not say: as before"
    for given in ("tcp://0.0.0.0:7000", "tcp://127.0.0.1:7000", "tcp://10.1.2.3:0"):
        assert job_bind(given, one.local_world, one.world) == given
        assert job_bind(given, two.local_world, two.world) == given


def test_workers_are_told_the_bound_host_when_it_is_not_all_interfaces():
    assert advertised_host("127.0.0.1", "10.9.8.7") == "127.0.0.1"
    assert advertised_host("10.1.2.3", "10.9.8.7") == "10.1.2.3"
