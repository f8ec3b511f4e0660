"""The broker's clock (wire/clock.py) and its offset's measurement (broker/clock_skew.py): every
deadline a process writes or judges is on the broker's clock."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

import pytest

from asyncinfer.broker import clock_skew
from asyncinfer.wire import clock
from asyncinfer.wire.clock import BROKER_CLOCK
from asyncinfer.wire.envelope import Message, seconds_until
from asyncinfer.wire.messages import SENT_AT, retry_message, task_message


@pytest.fixture(autouse=True)
def _offset_restored():
    before = BROKER_CLOCK.offset_s, BROKER_CLOCK.measured
    yield
    BROKER_CLOCK.offset_s, BROKER_CLOCK.measured = before


class _Redis:
    """Answers TIME as a broker whose clock is ``ahead_s`` ahead of this host's, the first read
    slow (its round trip long: a poorer reading, off by ``slow_error_s``)."""

    def __init__(self, ahead_s: float, slow_error_s: float = 0.0) -> None:
        self.ahead_s, self.slow_error_s, self.reads = ahead_s, slow_error_s, 0

    def time(self) -> tuple[int, int]:
        import time
        self.reads += 1
        error = self.slow_error_s if self.reads == 1 else 0.0
        if self.reads == 1:
            time.sleep(0.02)
        now = time.time() + self.ahead_s + error
        return int(now), int((now % 1) * 1e6)


def test_the_offset_is_the_reading_with_the_shortest_round_trip() -> None:
    offset = clock_skew.measure_offset_s(_Redis(60.0, slow_error_s=5.0))  # type: ignore[arg-type]
    assert offset == pytest.approx(60.0, abs=0.01)


def test_deadlines_are_set_and_judged_on_the_broker_clock() -> None:
    host_now = datetime.now(timezone.utc)
    BROKER_CLOCK.set_offset_s(-60.0)  # this host is a minute ahead of the broker
    assert (clock.now_utc() - host_now).total_seconds() == pytest.approx(-60, abs=1)
    # a new request's expires and its sent time are on the broker's clock
    envelope = json.loads(task_message("asyncinfer.infer", "r1", {"model": "m"}, "infer.m",
                                       expires_s=30))
    expires = datetime.fromisoformat(envelope["headers"]["expires"])
    assert (expires - host_now).total_seconds() == pytest.approx(-30, abs=1)
    assert envelope["properties"][SENT_AT] == pytest.approx(host_now.timestamp() - 60, abs=1)
    # and judged there: 30 s left, not -30
    assert seconds_until(envelope["headers"]["expires"]) == pytest.approx(30, abs=1)
    # a retry's eta too
    retry = json.loads(retry_message(Message(raw=json.dumps(envelope).encode(), queue="infer.m"), 3.0))
    eta = datetime.fromisoformat(retry["headers"]["eta"])
    assert (eta - host_now).total_seconds() == pytest.approx(-57, abs=1)
    assert seconds_until(retry["headers"]["eta"]) == pytest.approx(3, abs=1)


def test_a_clock_far_off_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=clock_skew.__name__)
    follower = clock_skew.ClockFollower(BROKER_CLOCK)
    broker = _Redis(-75.0)
    assert follower.measure(broker)  # type: ignore[arg-type]
    assert follower.measure(broker)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "this host's clock is 75.0 s ahead of the broker's" in lines[0]
    assert BROKER_CLOCK.offset_s == pytest.approx(-75, abs=0.05)
    # a clock within a second of the broker's says nothing
    caplog.clear()
    assert clock_skew.ClockFollower(BROKER_CLOCK).measure(_Redis(0.3))  # type: ignore[arg-type]
    assert caplog.records == []


def test_a_producer_measures_once_before_its_first_deadline() -> None:
    follower = clock_skew.ClockFollower(BROKER_CLOCK)
    BROKER_CLOCK.measured = False
    broker = _Redis(30.0)
    follower.measured(broker)  # type: ignore[arg-type]
    follower.measured(broker)  # type: ignore[arg-type]
    assert broker.reads == clock_skew.READINGS and BROKER_CLOCK.offset_s == pytest.approx(30, abs=0.05)


def test_a_broker_that_cannot_be_read_leaves_the_offset() -> None:
    import redis

    class Down:
        def time(self):
            raise redis.ConnectionError("refused")

    BROKER_CLOCK.set_offset_s(12.0)
    assert clock_skew.ClockFollower(BROKER_CLOCK).measure(Down()) is False  # type: ignore[arg-type]
    assert BROKER_CLOCK.offset_s == 12.0
