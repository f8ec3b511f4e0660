"""Dynamic batching: what a batch takes, when it waits, and how it stops."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from types import SimpleNamespace

import pytest

from asyncinfer.engine.batcher import Batcher, WorkItem

pytestmark = pytest.mark.timeout(30)


def item(tag: str, rows: int = 1, signature: Hashable = "a") -> WorkItem:
    return WorkItem(request=tag, rows=rows, signature=signature)


def tags(batch: list[WorkItem] | None) -> list[str]:
    assert batch is not None
    return [i.request for i in batch]


class _WaitsSeen(threading.Condition):
    """A condition that sets ``waiting`` whenever a thread begins to wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def consumer_blocked(batcher: Batcher) -> threading.Event:
    """A gate, set once a consumer of the (still unused) ``batcher`` blocks in it."""
    condition = _WaitsSeen()
    batcher._cond = condition
    return condition.waiting


def test_a_lone_item_does_not_wait_for_the_delay() -> None:
    # Given: a long delay and one item, nothing arriving
    batcher = Batcher(max_batch_size=8, max_delay_ms=2000)
    batcher.put(item("r0"))
    # When
    started = time.perf_counter()
    batch = batcher.next_batch()
    elapsed = time.perf_counter() - started
    # Then: it comes back at once, alone
    assert tags(batch) == ["r0"]
    assert elapsed < 1.0  # well under the 2 s delay
    assert len(batcher) == 0


def test_queued_items_are_batched_up_to_max_rows() -> None:
    batcher = Batcher(max_batch_size=4, max_delay_ms=0)
    for i in range(10):
        batcher.put(item(f"r{i}"))
    assert tags(batcher.next_batch()) == ["r0", "r1", "r2", "r3"]
    assert tags(batcher.next_batch()) == ["r4", "r5", "r6", "r7"]
    assert tags(batcher.next_batch()) == ["r8", "r9"]
    assert len(batcher) == 0


def test_rows_are_counted_and_an_item_is_never_split() -> None:
    batcher = Batcher(max_batch_size=5, max_delay_ms=0)
    batcher.put(item("r0", rows=2))
    batcher.put(item("r1", rows=2))
    batcher.put(item("r2", rows=3))  # 2 + 2 + 3 > 5: waits whole for the next batch
    batcher.put(item("r3", rows=1))
    first = batcher.next_batch()
    assert first is not None
    assert sum(i.rows for i in first) <= 5
    assert "r2" not in tags(first)
    assert tags(first) == ["r0", "r1", "r3"]
    second = batcher.next_batch()
    assert tags(second) == ["r2"]
    assert second is not None and second[0].rows == 3


def test_an_item_of_exactly_max_rows_runs_alone() -> None:
    batcher = Batcher(max_batch_size=3, max_delay_ms=0)
    batcher.put(item("big", rows=3))
    batcher.put(item("small", rows=1))
    assert tags(batcher.next_batch()) == ["big"]
    assert tags(batcher.next_batch()) == ["small"]


def test_incompatible_signatures_go_to_separate_batches_in_order() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    for tag, sig in [("a0", "A"), ("b0", "B"), ("a1", "A"), ("b1", "B"), ("c0", "C"), ("a2", "A")]:
        batcher.put(item(tag, signature=sig))
    assert tags(batcher.next_batch()) == ["a0", "a1", "a2"]
    assert tags(batcher.next_batch()) == ["b0", "b1"]
    assert tags(batcher.next_batch()) == ["c0"]
    assert len(batcher) == 0


def test_a_batch_waits_for_an_arriving_item_and_includes_it() -> None:
    # Given: one queued item while another thread is still decoding its request
    batcher = Batcher(max_batch_size=8, max_delay_ms=2000)
    blocked = consumer_blocked(batcher)
    batcher.put(item("first"))
    entered, release = threading.Event(), threading.Event()

    def decode_and_put() -> None:
        with batcher.arriving():
            entered.set()
            release.wait(5)
            batcher.put(item("late"))

    thread = threading.Thread(target=decode_and_put)
    thread.start()
    assert entered.wait(5)
    got: list[list[WorkItem] | None] = []
    consumer = threading.Thread(target=lambda: got.append(batcher.next_batch()))
    consumer.start()
    # When: the batch is still open once the consumer waits, then the item arrives
    assert blocked.wait(5)
    assert consumer.is_alive(), "the batch must wait for the arriving item"
    release.set()
    consumer.join(5)
    thread.join(5)
    # Then: the arriving item is in the same batch, well before the 2 s deadline
    assert not consumer.is_alive()
    assert tags(got[0]) == ["first", "late"]


def test_waiting_for_arriving_items_is_bounded_by_max_delay() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=100)
    release = threading.Event()
    entered = threading.Event()

    def slow_decode() -> None:
        with batcher.arriving():
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=slow_decode)
    thread.start()
    try:
        assert entered.wait(5)
        batcher.put(item("first"))
        started = time.perf_counter()
        batch = batcher.next_batch()
        elapsed = time.perf_counter() - started
        assert tags(batch) == ["first"]
        assert 0.05 <= elapsed < 2.0  # waited for the arrival, gave up near the 100 ms deadline
    finally:
        release.set()
        thread.join(5)


def test_a_batch_does_not_wait_once_full() -> None:
    batcher = Batcher(max_batch_size=2, max_delay_ms=5000)
    batcher.put(item("r0"))
    batcher.put(item("r1"))
    with batcher.arriving():  # someone is still arriving, but the batch is full
        started = time.perf_counter()
        batch = batcher.next_batch()
        assert time.perf_counter() - started < 1.0
    assert tags(batch) == ["r0", "r1"]


def test_arriving_count_drops_when_decoding_raises() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=5000)
    with pytest.raises(RuntimeError), batcher.arriving():
        raise RuntimeError("decode failed")
    batcher.put(item("r0"))
    started = time.perf_counter()
    assert tags(batcher.next_batch()) == ["r0"]
    assert time.perf_counter() - started < 1.0


def test_close_returns_leftovers_and_next_batch_returns_none() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    batcher.put(item("r0"))
    batcher.put(item("r1", signature="other"))
    left = batcher.close()
    assert [i.request for i in left] == ["r0", "r1"]
    assert batcher.next_batch() is None
    assert len(batcher) == 0
    assert batcher.close() == []
    with pytest.raises(RuntimeError, match="closed"):
        batcher.put(item("r2"))


def test_close_wakes_a_waiting_consumer() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    blocked = consumer_blocked(batcher)
    got: list[list[WorkItem] | None] = []
    consumer = threading.Thread(target=lambda: got.append(batcher.next_batch()))
    consumer.start()
    assert blocked.wait(5)
    assert consumer.is_alive()  # blocked on an empty queue
    batcher.close()
    consumer.join(5)
    assert not consumer.is_alive()
    assert got == [None]


def test_a_consumer_blocked_on_an_empty_queue_gets_the_next_item() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    blocked = consumer_blocked(batcher)
    got: list[list[WorkItem] | None] = []
    consumer = threading.Thread(target=lambda: got.append(batcher.next_batch()))
    consumer.start()
    assert blocked.wait(5)
    batcher.put(item("r0"))
    consumer.join(5)
    assert tags(got[0]) == ["r0"]


@pytest.mark.parametrize(("size", "delay", "message"), [
    (0, 1.0, "max_batch_size must be an integer >= 1, got 0"),
    (-3, 1.0, "max_batch_size must be an integer >= 1, got -3"),
    (4, -1.0, "max_delay_ms must be a finite number >= 0, got -1.0"),
])
def test_constructor_validation(size: int, delay: float, message: str) -> None:
    with pytest.raises(ValueError) as info:
        Batcher(max_batch_size=size, max_delay_ms=delay)
    assert str(info.value) == message


def test_constructor_stores_the_delay_in_seconds() -> None:
    batcher = Batcher(max_batch_size=3, max_delay_ms=250)
    assert batcher.max_batch_size == 3
    assert batcher.max_delay_s == pytest.approx(0.25)


def test_preferred_sizes_trim_a_batch_and_keep_the_rest_in_order() -> None:
    batcher = Batcher(16, 0.0, preferred_batch_sizes=(4, 8))
    items = [WorkItem(request=f"r{i}", rows=1, signature="s") for i in range(6)]
    for item in items:
        batcher.put(item)
    first = batcher.next_batch()
    second = batcher.next_batch()
    assert [i.request for i in first] == ["r0", "r1", "r2", "r3"]  # the largest preferred size that fits
    assert [i.request for i in second] == ["r4", "r5"]  # no preferred size fits: sent as is


def test_a_batch_stops_waiting_at_the_largest_preferred_size() -> None:
    batcher = Batcher(32, 2000.0, preferred_batch_sizes=(8,))
    for i in range(8):
        batcher.put(WorkItem(request=f"r{i}", rows=1, signature="s"))
    batcher.hold()  # more requests are being decoded: without a preferred size it would wait
    try:
        began = time.perf_counter()
        batch = batcher.next_batch()
        waited_s = time.perf_counter() - began
    finally:
        batcher.release()
    assert len(batch) == 8 and waited_s < 1.0


class _WakesCounted(threading.Condition):
    """A condition that counts the waits that ended, and sets ``waiting`` at each that began."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()
        self.wakes = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        try:
            return super().wait(timeout)
        finally:
            self.wakes += 1


def test_requests_still_arriving_wake_a_forming_batch_only_once_they_can_fill_it() -> None:
    # Given: requests being decoded, and a batch of one waiting for more (max 4, 5 s delay)
    batcher = Batcher(max_batch_size=4, max_delay_ms=5000)
    condition = _WakesCounted()
    batcher._cond = condition
    batcher.hold()
    batcher.put(item("r0"))
    got: list[list[WorkItem] | None] = []
    former = threading.Thread(target=lambda: got.append(batcher.next_batch()))
    former.start()
    assert condition.waiting.wait(5)
    # When: two arrive, then the third that fills it, the decoding still going on
    batcher.put(item("r1"))
    batcher.put(item("r2"))
    time.sleep(0.05)
    woken_early = condition.wakes
    started = time.perf_counter()
    batcher.put(item("r3"))
    former.join(5)
    # Then: not woken for a batch it could not fill; woken, full, at the fourth, not at its deadline
    assert woken_early == 0
    assert not former.is_alive() and tags(got[0]) == ["r0", "r1", "r2", "r3"]
    assert time.perf_counter() - started < 2.0
    batcher.release()


def test_an_idle_former_takes_the_first_request_while_others_still_arrive() -> None:
    batcher = Batcher(max_batch_size=4, max_delay_ms=200)
    condition = _WakesCounted()
    batcher._cond = condition
    batcher.hold()
    got: list[list[WorkItem] | None] = []
    former = threading.Thread(target=lambda: got.append(batcher.next_batch()))
    former.start()
    assert condition.waiting.wait(5)
    batcher.put(item("r0"))  # woken by the first: it then waits up to 200 ms for the others
    former.join(5)
    batcher.release()
    assert not former.is_alive() and tags(got[0]) == ["r0"]
    assert condition.wakes >= 1


def test_an_item_marked_alone_forms_a_batch_of_its_own_and_is_never_taken_into_another() -> None:
    # Given a suspect (a worker died with it on the device) among compatible items
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    suspect = item("suspect")
    suspect.alone = True
    for i in (item("a"), suspect, item("b"), item("c")):
        batcher.put(i)
    # Then the first batch takes the others around it, and the suspect goes alone
    assert tags(batcher.next_batch()) == ["a", "b", "c"]
    assert tags(batcher.next_batch()) == ["suspect"]
    # And a suspect first in line does not wait for company
    batcher.put(suspect)
    batcher.put(item("d"))
    assert tags(batcher.next_batch()) == ["suspect"] and tags(batcher.next_batch()) == ["d"]


def test_suspects_batch_together_and_never_with_requests_that_saw_no_death() -> None:
    # Given the batch-mates of a lost worker (one death each) among fresh requests and one that
    # runs alone (two deaths)
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    mates = [WorkItem(request=f"s{i}", rows=1, signature="a", suspect=True) for i in range(3)]
    lone = WorkItem(request="alone", rows=1, signature="a", alone=True)
    fresh = [item("f0"), item("f1")]
    for i in (fresh[0], mates[0], lone, mates[1], fresh[1], mates[2]):
        batcher.put(i)
    # Then the fresh ones go together, the suspects together (one batch, not one each), and the
    # lone one by itself
    assert tags(batcher.next_batch()) == ["f0", "f1"]
    assert tags(batcher.next_batch()) == ["s0", "s1", "s2"]
    assert tags(batcher.next_batch()) == ["alone"]
    # And a suspect's batch has the device to itself, as a lone one's
    assert mates[0].isolated and lone.isolated and not fresh[0].isolated
    # And a running batch of fresh requests takes no suspect in (in-flight batching)
    batcher.put(WorkItem(request="s3", rows=1, signature="a", suspect=True))
    assert batcher.take_joining("a", 4) == []


def test_a_lost_batchs_rerun_waits_for_its_suspects_still_decoding_past_the_delay() -> None:
    # Given a lost batch's requests back in one take (suspects), a delay of 0, and a host so busy
    # that one of them is still being decoded when the first is queued
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    blocked = consumer_blocked(batcher)
    got: list[list[WorkItem] | None] = []
    batcher.hold()
    batcher.put(WorkItem(request="s0", rows=1, signature="a", suspect=True))
    former = threading.Thread(target=lambda: got.append(batcher.next_batch()))
    former.start()
    try:
        # When the batch former waits past the delay, and then the last suspect comes in
        assert blocked.wait(5)
        assert former.is_alive()
        batcher.put(WorkItem(request="s1", rows=1, signature="a", suspect=True))
    finally:
        batcher.release()
        former.join(5)
    # Then the rerun is one batch of both, not two
    assert tags(got[0]) == ["s0", "s1"]
    # And a batch of requests that saw no death still goes at its delay
    batcher.hold()
    try:
        batcher.put(item("f0"))
        assert tags(batcher.next_batch()) == ["f0"]
    finally:
        batcher.release()


def test_withdrawn_items_leave_the_queue_and_the_others_keep_their_order() -> None:
    batcher = Batcher(max_batch_size=8, max_delay_ms=0)
    items = [WorkItem(request=SimpleNamespace(id=f"r{i}"), rows=1, signature="s") for i in range(4)]
    for item in items:
        batcher.put(item)
    gone = batcher.withdraw({"r1", "r3", "unknown"})
    assert [i.request.id for i in gone] == ["r1", "r3"]
    assert batcher.waiting_ids() == {"r0", "r2"}
    assert [i.request.id for i in batcher.next_batch() or []] == ["r0", "r2"]


def costly(tag: str, cost: float, rows: int = 1, signature: Hashable = "a") -> WorkItem:
    return WorkItem(request=tag, rows=rows, signature=signature, cost=cost)


def test_rows_of_like_cost_batch_together_led_by_the_oldest() -> None:
    # Given short and long sentences waiting, mixed, the oldest a short one
    b = Batcher(max_batch_size=3, max_delay_ms=0)
    for tag, cost in [("s1", 40), ("l1", 600), ("s2", 50), ("l2", 550), ("s3", 45), ("l3", 700),
                      ("s4", 60)]:
        b.put(costly(tag, cost))
    # Then each batch is led by the oldest left and filled with the nearest in cost
    assert tags(b.next_batch()) == ["s1", "s3", "s2"]  # 45 and 50 nearest 40; s4 (60) waits
    assert tags(b.next_batch()) == ["l1", "l2", "l3"]  # the oldest now a long one: the longs
    assert tags(b.next_batch()) == ["s4"]
    assert len(b) == 0


def test_nearest_by_ratio_and_the_older_first_among_equals() -> None:
    b = Batcher(max_batch_size=3, max_delay_ms=0)
    for tag, cost in [("a", 100), ("twice", 200), ("same1", 100), ("far", 5000), ("same2", 100),
                      ("same3", 100)]:
        b.put(costly(tag, cost))
    # three as near as can be (cost 100): the older two
    assert tags(b.next_batch()) == ["a", "same1", "same2"]
    # then the oldest left leads; 100 is nearer 200 than 5000 is, and 5000 is more than twice
    # either: it would run padded (or pad them) far past its cost, so it waits for its own batch
    assert tags(b.next_batch()) == ["twice", "same3"]
    assert tags(b.next_batch()) == ["far"]


def test_cost_grouping_keeps_the_other_rules() -> None:
    # a request too large for what is left, another signature, one that runs alone: all wait
    b = Batcher(max_batch_size=4, max_delay_ms=0)
    b.put(costly("first", 10, rows=2))
    b.put(costly("big", 10, rows=3))
    b.put(costly("other", 10, signature="b"))
    lone = costly("lone", 10)
    lone.alone = True
    b.put(lone)
    b.put(costly("near", 11, rows=2))
    assert tags(b.next_batch()) == ["first", "near"]
    assert tags(b.next_batch()) == ["big"]
    assert tags(b.next_batch()) == ["other"]
    assert tags(b.next_batch()) == ["lone"]


def test_without_costs_or_with_grouping_off_batches_form_in_arrival_order() -> None:
    for batcher, make in [(Batcher(3, 0), lambda t, c: item(t)),
                          (Batcher(3, 0, group_by_cost=False), costly)]:
        for tag, cost in [("s1", 40), ("l1", 600), ("s2", 50), ("l2", 550)]:
            batcher.put(make(tag, cost))
        assert tags(batcher.next_batch()) == ["s1", "l1", "s2"]
        assert tags(batcher.next_batch()) == ["l2"]


def test_a_batch_filled_in_steps_keeps_the_ratio_to_its_cheapest_row() -> None:
    # a batch that already holds rows of cost 10 and 19 (taken in an earlier step, while more
    # were arriving) takes no row of 30: more than twice its cheapest, though within twice 19
    b = Batcher(max_batch_size=4, max_delay_ms=0)
    b.put(costly("thirty", 30))
    b.put(costly("fifteen", 15))
    batch = [costly("ten", 10), costly("nineteen", 19)]
    assert b._take_nearest(batch, 2) == 3
    assert tags(batch) == ["ten", "nineteen", "fifteen"] and len(b) == 1
