"""``WorkerGroup`` with real spawned processes: the child that failed first is the one
reported, with its own traceback, and the group's reports leave nothing in /dev/shm (a
multiprocessing queue's locks are named semaphores there, which a SIGKILL of the whole
process group would leave behind)."""

import os
import time

import pytest

from asyncsgd.errors import WorkerError
from asyncsgd.run.lifetime import pid_alive
from asyncsgd.run.process_group import WorkerGroup
from conftest import shm_entries


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


def _mapped_by(pids: list, name: str) -> bool:
    """Whether one of ``pids`` maps /dev/shm/``name`` (a named semaphore is mapped by every
    process that opened it)."""
    for pid in pids:
        try:
            if f"/dev/shm/{name}" in open(f"/proc/{pid}/maps").read():
                return True
        except OSError:  # exited meanwhile
            pass
    return False


def test_the_first_failure_is_reported_and_no_named_semaphore_is_made(tmp_path):
    before = shm_entries()
    group = WorkerGroup(_raise_after, 3, args=[(str(tmp_path / "first"),)] * 3, name="child")
    try:
        group.start()
        ours = [os.getpid()] + [p.pid for p in group.processes]  # not other runs' entries
        made = {name for name in shm_entries() - before
                if name.startswith("sem.") and _mapped_by(ours, name)}
        assert group.wait_all(180), "the children did not exit"
        with pytest.raises(WorkerError) as failure:
            group.check()
    finally:
        group.stop(grace=1)
    assert made == set()
    text = str(failure.value)
    assert failure.value.worker == 1, text
    assert text.startswith("child 1 raised an exception; its traceback:"), text
    assert "ValueError: the first failure" in text and "consequence" not in text
    assert group.failed() == [0, 1, 2]
