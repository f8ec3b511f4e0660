"""The hang watch (engine/hangs.py) and what a worker does about a hang (policy/hangs.py), alone:
the limit derived from the batches seen, a hang reported once, only batches still on the device
judged, and the worker's note, give-back (keeping what is on the device) and exit."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from asyncinfer.engine.hangs import HANG_FACTOR, HANG_FLOOR_S, STALL_FLOOR_S, HangWatch, Hung
from asyncinfer.policy.hangs import Hang
from asyncinfer.policy.time_limits import EXIT_WEDGED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _item(request_id: str, alone: bool = False) -> SimpleNamespace:
    """A work item on the device; ``alone``: its batch has the device to itself (a suspect's)."""
    return SimpleNamespace(request=SimpleNamespace(id=request_id), on_device=True, alone=alone,
                           isolated=alone)


def _watch(clock: Clock, seen: list[Hung], after_s: float | None = None) -> HangWatch:
    return HangWatch("m", lambda: seen.append, after_s=after_s, clock=clock)


def test_the_limit_is_the_floor_until_batches_say_more_then_ten_times_the_slowest() -> None:
    watch = _watch(Clock(), [])
    assert watch.limit_s() == HANG_FLOOR_S
    watch.observe(0.5)
    assert watch.limit_s() == HANG_FLOOR_S  # 10 × 0.5 s is under the floor
    watch.observe(7.0)
    watch.observe(2.0)  # not the slowest: changes nothing
    assert watch.limit_s() == pytest.approx(HANG_FACTOR * 7.0)
    assert _watch(Clock(), [], after_s=5.0).limit_s() == 5.0  # the setting, whatever was seen
    assert _watch(Clock(), [], after_s=0.0).limit_s() == HANG_FLOOR_S  # 0: derived


def test_a_batch_past_the_limit_is_reported_once_with_everything_on_the_device() -> None:
    clock, seen = Clock(), []
    watch = _watch(clock, seen)
    hung, other = [_item("a"), _item("b")], [_item("c")]
    watch.launched(hung, clock.now)
    clock.now += 10
    watch.launched(other, clock.now)
    clock.now += HANG_FLOOR_S - 10  # the first batch exactly at the limit: not yet
    assert watch.check() is None and seen == []
    clock.now += 0.5
    found = watch.check()
    assert found is not None and seen == [found]
    assert [i.request.id for i in found.items] == ["a", "b"]
    assert sorted(i.request.id for i in found.on_device) == ["a", "b", "c"]
    assert found.on_device_s == pytest.approx(HANG_FLOOR_S + 0.5)
    assert "model 'm': a batch of 2 request(s) made no progress on the device for 30 s" in (
        found.describe())
    clock.now += 100
    assert watch.check() is None and len(seen) == 1  # once


def test_only_batches_still_on_the_device_are_judged() -> None:
    clock, seen = Clock(), []
    watch = _watch(clock, seen)
    done = [_item("done")]
    watch.launched(done, clock.now)
    for item in done:
        item.on_device = False  # its results came back
    clock.now += 1000
    assert watch.check() is None and seen == [] and watch.on_device() == []


def test_a_stop_finds_every_batch_over_its_limit() -> None:
    clock = Clock()
    watch = _watch(clock, [])
    old, young = [_item("old")], [_item("young")]
    watch.launched(old, clock.now)
    clock.now += 8
    watch.launched(young, clock.now)
    clock.now += 4
    stuck = watch.stuck(10.0)
    assert stuck is not None and [i.request.id for i in stuck.items] == ["old"]
    assert watch.stuck(20.0) is None


def test_the_watch_thread_finds_a_hang_on_its_own() -> None:
    seen: list[Hung] = []
    found = threading.Event()
    watch = HangWatch("m", lambda: lambda hung: (seen.append(hung), found.set()), after_s=0.2,
                      check_s=0.05).start()
    try:
        watch.launched([_item("x")], watch.clock())
        assert found.wait(5) and [i.request.id for i in seen[0].items] == ["x"]
    finally:
        watch.close()


def test_a_worker_notes_the_hang_gives_back_all_but_the_device_and_leaves_once() -> None:
    happened: list[object] = []
    left = threading.Event()

    def leave(status: int) -> None:
        happened.append(f"leave {status}")
        left.set()

    hang = Hang(lambda hung: happened.append(f"note {hung.model}"),
                lambda keep: happened.append(("give back but", sorted(keep))),
                exit_after_s=0.05, leave=leave)
    hung = Hung("m", [_item("a")], 31.0, 30.0, [_item("a"), _item("c")])
    hang(hung)
    hang(hung)  # once
    assert left.wait(5)
    assert happened == ["note m", ("give back but", ["a", "c"]), f"leave {EXIT_WEDGED}"]


def test_a_worker_leaves_even_when_its_note_and_give_back_fail() -> None:
    left = threading.Event()

    def fail(*_: object) -> None:
        raise ConnectionError("redis is gone")

    Hang(fail, fail, exit_after_s=0.0, leave=lambda status: left.set())(
        Hung("m", [_item("a")], 31.0, 30.0, [_item("a")]))
    assert left.wait(5)


def test_a_suspect_batch_far_slower_than_the_model_s_stalls_the_device_once_before_it_hangs(
        ) -> None:
    clock, hung, stalls = Clock(), [], []
    watch = HangWatch("m", lambda: hung.append, on_stalled=lambda: stalls.append, clock=clock)
    watch.observe(1.0)
    assert watch.stall_limit_s() == pytest.approx(3.0) and watch.limit_s() == HANG_FLOOR_S
    good = [_item("good")]  # not alone: slow, but no reason to move what waits
    watch.launched(good, clock.now)
    clock.now += 10
    assert watch.check() is None and stalls == []
    good[0].on_device = False
    slow = [_item("slow", alone=True)]
    watch.launched(slow, clock.now)
    clock.now += 2.9
    assert watch.check() is None and stalls == []
    clock.now += 0.2
    watch.check()
    watch.check()
    assert [[i.request.id for i in s.items] for s in stalls] == [["slow"]] and hung == []
    slow[0].on_device = False  # it came off; the next slow one stalls again
    later = [_item("later", alone=True)]
    watch.launched(later, clock.now)
    clock.now += 3.5
    watch.check()
    assert [[i.request.id for i in s.items] for s in stalls] == [["slow"], ["later"]]
    clock.now += HANG_FLOOR_S
    watch.check()
    assert [[i.request.id for i in h.items] for h in hung] == [["later"]]


def test_the_stall_limit_never_passes_the_hang_limit_and_has_a_floor() -> None:
    watch = _watch(Clock(), [], after_s=1.0)
    assert watch.stall_limit_s() == 1.0
    assert _watch(Clock(), []).stall_limit_s() == STALL_FLOOR_S  # nothing seen yet
