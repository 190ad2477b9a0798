"""``WorkerGroup`` with real spawned processes: the child that failed first is the one
reported, with its own traceback, and the group's reports leave nothing in /dev/shm (a
multiprocessing queue's locks are named semaphores there, which a SIGKILL of the whole
process group would leave behind)."""

import gc
import os
import time

import pytest

from asyncsgd.errors import WorkerError
from asyncsgd.run.lifetime import pid_alive
from asyncsgd.run.process_group import WorkerGroup
from conftest import shm_entries

pytestmark = pytest.mark.processes  # every test starts child processes


def _raise_after(rank: int, marker: str) -> None:
    """Rank 1 raises at once, leaving its pid in ``marker``; the others raise only once
    rank 1's process is gone, so its report was sent before theirs."""
    if rank == 1:
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        raise ValueError("the first failure")
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(marker) as f:
        first = int(f.read())
    while pid_alive(first) and time.monotonic() < deadline:
        time.sleep(0.02)
    raise RuntimeError(f"a consequence in rank {rank}")


def test_the_first_failure_is_reported_and_no_named_semaphore_is_made(tmp_path):
    before = shm_entries()
    group = WorkerGroup(_raise_after, 3, args=[(str(tmp_path / "first"),)] * 3, name="child")
    try:
        group.start()
        made = {name for name in shm_entries() - before if name.startswith("sem.")}
        assert group.wait_all(180), "the children did not exit"
        with pytest.raises(WorkerError) as failure:
            group.check()
    finally:
        group.stop(grace=1)
    failed, text, worker = group.failed(), str(failure.value), failure.value.worker
    del group, failure  # the exception's traceback holds the group too
    gc.collect()
    # The group's own: made while it started and gone with it (multiprocessing unlinks a
    # queue's semaphores when the queue is collected); another run's would stay. Named
    # semaphores show in no /proc/PID/maps here, so mappings cannot tell them apart.
    assert made - shm_entries() == set()
    assert worker == 1, text
    assert text.startswith("child 1 raised an exception; its traceback:"), text
    assert "ValueError: the first failure" in text and "consequence" not in text
    assert failed == [0, 1, 2]
