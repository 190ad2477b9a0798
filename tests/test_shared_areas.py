"""A worker's same-host areas (workers/shared_areas.py), in one process: no sockets."""

import os

import pytest
import torch

from asyncsgd.wire import shared
from asyncsgd.wire.protocol import Key
from asyncsgd.workers.shared_areas import ATTACH_TRIES, SharedAreas

pytestmark = pytest.mark.skipif(not shared.supported(), reason="no sealed memory files here")

LINK, ELEMENTS = 4242, 1000


def mappings(link: int) -> int:
    """How many mappings of area ``link`` this process holds."""
    with open("/proc/self/maps") as maps:
        return sum(f"asyncsgd-area-{link}" in line for line in maps)


def answer(area: shared.Area) -> dict:
    """What a shard's attach answer says of ``area``."""
    return {Key.PID: os.getpid(), Key.FD: area.fd, Key.LINK: area.link,
            Key.ELEMENTS: area.elements, Key.TAG: area.tag.hex()}


def test_an_attached_area_shares_memory_with_the_shard_and_close_unmaps_it():
    shm = sorted(os.listdir("/dev/shm"))
    made = shared.Area.create(LINK, ELEMENTS, worker="w", incarnation=1)
    areas = SharedAreas(2)
    assert mappings(LINK) == 1 and list(areas) == [None, None]
    assert areas.map(1, answer(made)) is None
    assert areas[0] is None and areas[1].link == LINK and mappings(LINK) == 2
    areas[1].grads.copy_(torch.arange(ELEMENTS, dtype=torch.float32))
    assert torch.equal(made.grads, torch.arange(ELEMENTS, dtype=torch.float32))
    made.params.fill_(2.5)
    assert areas.slots[1](LINK, "w", 1).sum().item() == 2.5 * ELEMENTS
    assert areas.slots[1](LINK + 1, "w", 1) is None, "another link is not ours"
    assert areas.slots[0](LINK, "w", 1) is None, "shard 0 has no area"
    areas.close()
    assert list(areas) == [None, None]
    assert mappings(LINK) == 1, "the worker's mapping is gone; the shard's stays"
    made.close()
    del made
    assert mappings(LINK) == 0
    assert sorted(os.listdir("/dev/shm")) == shm


def test_a_wrong_tag_is_refused_and_nothing_stays_mapped():
    made = shared.Area.create(LINK + 1, ELEMENTS)
    areas = SharedAreas(1)
    why = areas.map(0, {**answer(made), Key.TAG: "00" * 16})
    assert why is not None and "tag" in why
    assert areas[0] is None and mappings(LINK + 1) == 1
    made.close()


def test_auto_falls_back_after_one_try_and_gives_up_after_attach_tries_in_a_row():
    areas, tries = SharedAreas(2), []

    def attach(i):
        tries.append(i)
        return "no answer to attach"

    areas.want_all()
    assert areas.attach_pending(attach) is None and tries == [0, 1] and not areas.pending
    for _ in range(ATTACH_TRIES + 1):
        areas.drop(0, "evicted")
        areas.attach_pending(attach)
    assert tries == [0, 1] + [0] * (ATTACH_TRIES - 1), "frames for good after 3 failures"


def test_insisting_tries_attach_tries_times_then_says_why():
    areas, tries = SharedAreas(2, insist=True), []

    def attach(i):
        tries.append(i)
        return None if i == 0 else f"shard {i} refused"

    areas.want_all()
    assert areas.attach_pending(attach) == "shard 1 refused"
    assert tries == [0] + [1] * ATTACH_TRIES


def test_a_success_resets_the_count_of_failures_in_a_row():
    areas, results = SharedAreas(1), iter(["lost", "lost", None, "lost", "lost", "lost"])
    tries = []

    def attach(i):
        tries.append(i)
        return next(results)

    for _ in range(6):
        areas.drop(0, "evicted")
        areas.attach_pending(attach)
    assert len(tries) == 6, "three failures in a row never came before the success"
