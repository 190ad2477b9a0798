"""Dynamic dispatch's rule: every row once per epoch at unequal rates, exact re-handing, resume."""

import pytest
import torch

from asyncsgd.core.dispatch import Chunk, Dispatcher


def _train(d: Dispatcher, rates: dict, stop_after=None) -> dict:
    """Workers train ``rates[w]`` rows per turn from their plans; rows each trained, by worker."""
    trained = {w: [] for w in rates}
    turns = 0
    while not d.finished and (stop_after is None or turns < stop_after):
        turns += 1
        for worker, rate in rates.items():
            plan = d.top_up(worker)
            if not plan:
                continue
            chunk = plan[0]
            take = min(rate, len(chunk))
            trained[worker].append(d.rows(chunk)[:take])
            d.done(worker, take)
    return trained


def test_every_row_once_per_epoch_with_three_workers_at_unequal_rates():
    d = Dispatcher(1000, epochs=3, seed=7, chunk=64)
    trained = _train(d, {"a": 5, "b": 20, "c": 40})
    assert d.counts.min().item() == d.counts.max().item() == 3
    rows = torch.cat([r for rs in trained.values() for r in rs])
    assert torch.equal(torch.bincount(rows, minlength=1000).int(), d.counts)
    # the fast worker trained most: nothing was held back for the slow one
    assert sum(map(len, trained["c"])) > 4 * sum(map(len, trained["a"]))
    assert d.rehanded == 0 and d.unattributed == 0


def test_an_epoch_is_all_handed_before_the_next_and_the_next_is_handed_before_it_is_trained():
    d = Dispatcher(100, epochs=2, seed=0, chunk=30)
    handed = [d.hand("a") for _ in range(5)]
    assert [(c.epoch, c.start, c.stop) for c in handed] == [
        (0, 0, 30), (0, 30, 60), (0, 60, 90), (0, 90, 100), (1, 0, 30)]
    assert torch.equal(torch.sort(d.order(0)).values, torch.arange(100))
    assert not torch.equal(d.order(0), d.order(1))


def test_a_released_worker_s_unfinished_rows_are_rehanded_first_and_counted_exactly():
    d = Dispatcher(200, epochs=1, seed=1, chunk=50)
    assert d.top_up("slow") == [Chunk(0, 0, 50), Chunk(0, 50, 100)]
    d.done("slow", 18)
    assert d.release("slow") == 32 + 50
    assert d.rehanded == 82
    assert d.top_up("fast") == [Chunk(0, 18, 50), Chunk(0, 50, 100)]
    _train(d, {"fast": 7})
    assert d.counts.min().item() == d.counts.max().item() == 1
    assert d.rehanded == 82


def test_state_round_trip_continues_the_position_and_gives_back_what_was_out():
    d = Dispatcher(300, epochs=2, seed=3, chunk=40)
    _train(d, {"a": 10, "b": 25}, stop_after=9)
    saved = d.state_dict()
    out = sum(len(c) for w in ("a", "b") for c in d.plan(w))
    e = Dispatcher(300, epochs=2, seed=3, chunk=40)
    e.load_state_dict(saved)
    assert e.cursor == d.cursor and torch.equal(e.counts, d.counts)
    assert e.rehanded == d.rehanded + out
    assert list(e.queue) == d.plan("a") + d.plan("b") + list(d.queue)
    _train(e, {"a": 10, "b": 25, "c": 3})
    assert e.counts.min().item() == e.counts.max().item() == 2


def test_a_push_beyond_the_chunks_held_is_counted_as_unattributed():
    d = Dispatcher(10, epochs=1, seed=0, chunk=4)
    d.done("ghost", 3)
    assert d.unattributed == 3 and d.counts.sum().item() == 0


def test_exhausted_and_finished():
    d = Dispatcher(5, epochs=1, seed=0, chunk=5)
    d.top_up("a")
    assert d.exhausted and not d.finished and d.hand("b") is None
    d.done("a", 5)
    assert d.finished


def test_a_checkpoint_of_other_data_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        Dispatcher(10, 1, 0, 4).load_state_dict(Dispatcher(11, 1, 0, 4).state_dict())
