"""Repeated log records folded into one line per interval with a count (gateway/repeated_logs.py),
on a clock the test moves."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from asyncinfer.gateway.repeated_logs import RepeatFolder

NAME = "tests.repeated_logs"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def folded(caplog: pytest.LogCaptureFixture) -> Iterator[tuple[RepeatFolder, Clock, logging.Logger]]:
    clock = Clock()
    folder = RepeatFolder(interval_s=10.0, clock=clock)
    folder.install([NAME])
    caplog.set_level(logging.INFO, logger=NAME)
    try:
        yield folder, clock, logging.getLogger(NAME)
    finally:
        folder.uninstall([NAME])


def _accept_failed(logger: logging.Logger, fd: int) -> None:
    """What asyncio logs when accept() finds no descriptor left: the socket on a line of its own."""
    try:
        raise OSError(24, "Too many open files")
    except OSError:
        logger.error("socket.accept() out of system resource\nsocket: <TransportSocket fd=%d>", fd,
                     exc_info=True)


def test_the_first_of_a_kind_passes_whole_and_the_rest_are_counted(
        folded: tuple[RepeatFolder, Clock, logging.Logger],
        caplog: pytest.LogCaptureFixture) -> None:
    folder, clock, logger = folded
    # Given 5,000 failed accepts in 9 s
    for i in range(5000):
        clock.now = 100.0 + i * 9.0 / 5000
        _accept_failed(logger, 9 + i % 3)
    # then one record passed, traceback and all
    assert len(caplog.records) == 1
    assert caplog.records[0].exc_info is not None
    assert caplog.records[0].getMessage().startswith("socket.accept() out of system resource\n")
    # and the flush within the interval logs nothing
    assert folder.flush() == 0 and len(caplog.records) == 1

    # When the interval has passed, the flush logs one line with the count, at the same level
    clock.now = 110.0
    assert folder.flush() == 1
    count = caplog.records[-1]
    assert count.getMessage() == ("4999 more like this in the last 10 s: socket.accept() out of "
                                  "system resource (OSError)")
    assert count.levelno == logging.ERROR and count.exc_info is None
    # and the next one after it is a new interval's first: it passes whole again
    _accept_failed(logger, 9)
    assert len(caplog.records) == 3 and caplog.records[-1].exc_info is not None


def test_a_record_after_the_interval_brings_the_count_with_it(
        folded: tuple[RepeatFolder, Clock, logging.Logger],
        caplog: pytest.LogCaptureFixture) -> None:
    _, clock, logger = folded
    for port in range(3):
        logger.warning("refused a connection from port %d", port)
    clock.now += 12.0
    logger.warning("refused a connection from port %d", 99)
    assert [r.getMessage() for r in caplog.records] == [
        "refused a connection from port 0",
        "2 more like this in the last 12 s: refused a connection from port 0",
        "refused a connection from port 99"]


def test_kinds_are_counted_apart_and_the_exit_flush_takes_every_count(
        folded: tuple[RepeatFolder, Clock, logging.Logger],
        caplog: pytest.LogCaptureFixture) -> None:
    folder, clock, logger = folded
    for _ in range(3):
        logger.info("closed an idle connection")
        logger.warning("closed an idle connection")  # another level: another kind
        logger.info("closed a slow header")
    logging.getLogger(NAME + ".child").info("closed a slow header")  # not folded: not installed
    assert len(caplog.records) == 4
    clock.now += 1.0
    assert folder.flush() == 0
    assert folder.flush(everything=True) == 3
    assert sorted(r.getMessage() for r in caplog.records[4:]) == [
        "2 more like this in the last 1 s: closed a slow header",
        "2 more like this in the last 1 s: closed an idle connection",
        "2 more like this in the last 1 s: closed an idle connection"]
    assert folder.flush(everything=True) == 0  # said once


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0, got 0"):
        RepeatFolder(interval_s=0)
