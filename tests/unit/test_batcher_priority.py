"""The batcher's priority order: which waiting requests form the next batch, by Celery priority
(0 first, Celery's Redis order), and the age bound that keeps a low level from starving."""

from __future__ import annotations

from typing import Any

import pytest

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.batcher import Batcher, WorkItem
from asyncinfer.engine.device import Device, DeviceSpec
from asyncinfer.engine.runner import ModelRunner
from asyncinfer.models.builtin import Identity
from asyncinfer.wire.envelope import priority_in


class _Request(str):
    """A request stand-in: its tag, with the ``id`` the batcher withdraws by."""

    @property
    def id(self) -> str:
        return str(self)


def item(tag: str, priority: int = 0, rows: int = 1, signature: str = "a",
         cost: float | None = None) -> WorkItem:
    return WorkItem(request=_Request(tag), rows=rows, signature=signature, priority=priority,
                    cost=cost)


def batches(batcher: Batcher, count: int) -> list[list[str]]:
    out = []
    for _ in range(count):
        batch = batcher.next_batch()
        assert batch is not None
        out.append([str(w.request) for w in batch])
    return out


def queued(batcher: Batcher, *items: WorkItem) -> Batcher:
    for work in items:
        batcher.put(work)
    return batcher


def test_a_high_priority_item_behind_a_backlog_leads_the_next_batch() -> None:
    batcher = queued(Batcher(max_batch_size=4, max_delay_ms=0),
                     *[item(f"low{i}", priority=9) for i in range(10)], item("high", priority=0))
    assert batches(batcher, 3) == [["high", "low0", "low1", "low2"], ["low3", "low4", "low5", "low6"],
                                   ["low7", "low8", "low9"]]


def test_a_batch_fills_from_the_best_level_first_then_the_next_in_arrival_order() -> None:
    batcher = queued(Batcher(max_batch_size=3, max_delay_ms=0),
                     item("p9a", 9), item("p6a", 6), item("p3a", 3), item("p6b", 6), item("p3b", 3),
                     item("p9b", 9))
    assert batches(batcher, 2) == [["p3a", "p3b", "p6a"], ["p6b", "p9a", "p9b"]]


def test_signatures_still_separate_batches_within_the_priority_order() -> None:
    batcher = queued(Batcher(max_batch_size=4, max_delay_ms=0),
                     item("low-a", 9, signature="a"), item("high-b", 0, signature="b"),
                     item("mid-a", 3, signature="a"), item("high-a", 0, signature="a"))
    # the oldest of the best level leads (high-b); only b's may join it
    assert batches(batcher, 2) == [["high-b"], ["high-a", "mid-a", "low-a"]]


def test_cost_grouping_applies_within_a_level_before_the_next() -> None:
    batcher = queued(Batcher(max_batch_size=3, max_delay_ms=0, max_cost_ratio=2.0),
                     item("low-near", 9, cost=10), item("high-lead", 0, cost=10),
                     item("high-far", 0, cost=100), item("high-near", 0, cost=12))
    # high-far is out of the lead's cost ratio; the low one of the right cost fills the batch
    assert batches(batcher, 2) == [["high-lead", "high-near", "low-near"], ["high-far"]]


def test_an_item_passed_over_by_the_bound_of_batches_counts_as_the_best_level() -> None:
    batcher = queued(Batcher(max_batch_size=2, max_delay_ms=0, max_priority_passes=2),
                     item("low", 9), *[item(f"high{i}", 0) for i in range(8)])
    # two batches of younger high items pass it over; then it leads (the oldest at level 0)
    assert batches(batcher, 4) == [["high0", "high1"], ["high2", "high3"], ["low", "high4"],
                                   ["high5", "high6"]]


def test_a_backlog_is_passed_over_once_by_a_high_item_and_keeps_its_order() -> None:
    batcher = queued(Batcher(max_batch_size=2, max_delay_ms=0, max_priority_passes=2),
                     *[item(f"low{i}", 9) for i in range(4)], item("high", 0), item("mid", 3))
    assert batches(batcher, 3) == [["high", "mid"], ["low0", "low1"], ["low2", "low3"]]


def test_the_lowest_level_progresses_under_a_constant_stream_of_higher_ones() -> None:
    batcher = Batcher(max_batch_size=2, max_delay_ms=0, max_priority_passes=5)
    batcher.put(item("low", 9))
    served: list[list[str]] = []
    for i in range(50):  # each round brings three high items, one more than a batch takes
        queued(batcher, item(f"h{i}a", 0), item(f"h{i}b", 0), item(f"h{i}c", 0))
        served += batches(batcher, 1)
    at = next(n for n, batch in enumerate(served) if "low" in batch)
    # Then it ran in the sixth batch, once five batches had passed it, far ahead of the backlog
    assert at == 5 and served[at][0] == "low"
    assert len(batcher) > 40


def test_one_level_keeps_arrival_order_and_withdraw_and_close_keep_the_count() -> None:
    batcher = queued(Batcher(max_batch_size=2, max_delay_ms=0),
                     item("a", 5), item("b", 5), item("c", 7))
    gone = batcher.withdraw({"c"})
    assert [w.request for w in gone] == ["c"]
    assert batches(batcher, 1) == [["a", "b"]]
    assert batcher._ranked == 0
    batcher.put(item("d", 3))
    assert [w.request for w in batcher.close()] == ["d"]
    assert batcher._ranked == 0


def test_preferred_sizes_give_back_the_lowest_levels() -> None:
    batcher = queued(Batcher(max_batch_size=3, max_delay_ms=0, preferred_batch_sizes=(2,)),
                     item("low", 9), item("high1", 0), item("high2", 0))
    assert batches(batcher, 2) == [["high1", "high2"], ["low"]]


@pytest.mark.parametrize("passes", [0, -1, 1.5])
def test_max_priority_passes_is_checked(passes: Any) -> None:
    with pytest.raises(ValueError, match="max_priority_passes must be an integer >= 1"):
        Batcher(max_batch_size=2, max_delay_ms=0, max_priority_passes=passes)


@pytest.mark.parametrize(("info", "expected"), [
    ({"priority": 0}, 0), ({"priority": 6}, 6), ({"priority": 12}, 9), ({"priority": -3}, 0),
    ({"priority": None}, 0), ({}, 0), (None, 0), ({"priority": "9"}, 0), ({"priority": True}, 0),
])
def test_priority_in_reads_the_message_priority(info: object, expected: int) -> None:
    assert priority_in(info) == expected


def test_the_model_option_bounds_the_passes_and_reaches_the_batcher() -> None:
    assert ModelOptions().max_priority_passes == 8
    with pytest.raises(ValueError, match="max_priority_passes must be an integer >= 1"):
        ModelOptions(max_priority_passes=0)
    runner = ModelRunner(Identity(), Device(DeviceSpec("cpu")), ModelOptions(max_priority_passes=3))
    assert runner.batcher.max_priority_passes == 3
