"""The device gate: batches share the device, a batch that must run alone has it to itself."""

from __future__ import annotations

import threading

import pytest

from asyncinfer.engine.gate import DeviceGate

pytestmark = pytest.mark.timeout(30)


def test_an_alone_batch_waits_for_the_device_to_empty_and_holds_it_alone() -> None:
    gate = DeviceGate()
    events: list[str] = []
    inside_shared = threading.Event()
    release_shared = threading.Event()
    alone_inside = threading.Event()
    release_alone = threading.Event()

    def shared(name: str, started: threading.Event | None, until: threading.Event) -> None:
        with gate.enter():
            events.append(f"{name} in")
            if started is not None:
                started.set()
            until.wait(10)
            events.append(f"{name} out")

    def alone() -> None:
        with gate.enter(alone=True):
            events.append("alone in")
            alone_inside.set()
            release_alone.wait(10)
            events.append("alone out")

    # Given a batch on the device
    first = threading.Thread(target=shared, args=("first", inside_shared, release_shared))
    first.start()
    assert inside_shared.wait(10)
    # When a batch that must run alone comes, then another ordinary one
    lone = threading.Thread(target=alone)
    lone.start()
    while not gate._alone_waiting:  # the lone batch is waiting (a gate, not a sleep)
        threading.Event().wait(0.001)
    later = threading.Thread(target=shared, args=("later", None, release_alone))
    later.start()
    # Then neither enters while the first is inside
    assert not alone_inside.wait(0.2) and events == ["first in"]
    # When the first leaves, the lone batch enters, and the later one waits behind it
    release_shared.set()
    assert alone_inside.wait(10)
    assert events == ["first in", "first out", "alone in"]
    release_alone.set()
    for t in (first, lone, later):
        t.join(10)
    assert events == ["first in", "first out", "alone in", "alone out", "later in", "later out"]


def test_a_batch_alone_that_shares_lets_others_in_while_it_stays() -> None:
    # Given a batch alone on the device, an ordinary batch and another lone batch waiting
    gate = DeviceGate()
    entered: list[str] = []
    shared_now = threading.Event()
    leave = threading.Event()

    def enter(name: str, alone: bool) -> None:
        with gate.enter(alone=alone):
            entered.append(name)

    def first() -> None:
        with gate.enter(alone=True) as share:
            entered.append("suspects")
            shared_now.wait(10)
            share()
            leave.wait(10)

    holder = threading.Thread(target=first)
    holder.start()
    while not entered:
        threading.Event().wait(0.001)
    ordinary = threading.Thread(target=enter, args=("ordinary", False))
    ordinary.start()
    ordinary.join(0.2)
    assert entered == ["suspects"]  # it waits while the device is held alone
    # When the first shares the device (its first step passed)
    shared_now.set()
    ordinary.join(10)
    # Then the ordinary batch enters beside it; a lone batch still waits for the device to empty
    assert entered == ["suspects", "ordinary"]
    lone = threading.Thread(target=enter, args=("lone", True))
    lone.start()
    lone.join(0.2)
    assert entered == ["suspects", "ordinary"]
    leave.set()
    for t in (holder, lone):
        t.join(10)
    assert entered == ["suspects", "ordinary", "lone"]
