"""Repeated log records folded into one line per interval with a count.

A gateway out of file descriptors once wrote 550,416 tracebacks in a minute: asyncio's accept
loop logs ``socket.accept() out of system resource`` for each connection the kernel still queues
(up to the listen backlog each time it retries), and every one carried the same traceback. What
an operator needs is the first one and how many followed. :class:`RepeatFolder` is a
:class:`logging.Filter` put on the loggers that can flood (asyncio, aiohttp, grpc, the gateway's
connection guard): the first record of a kind in an interval passes whole, traceback included; the
rest of the interval are counted, and the count is logged (one line, no traceback) by
:meth:`RepeatFolder.flush`, which the gateway calls once an interval, or with the next record of
that kind.

A record's kind is its logger, its level, the first line of its message template (asyncio puts
the socket and the peer on later lines) and its exception's type; its count line repeats the
first line of the first record of the interval, as it was logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["RepeatFolder", "FOLDED_LOGGERS", "INTERVAL_S"]

#: The loggers whose records may repeat without bound: asyncio's accept loop and exception
#: handler, aiohttp's server, grpc's Python side, and the gateway's connection guard.
FOLDED_LOGGERS = ("asyncio", "aiohttp.server", "aiohttp.web", "aiohttp.internal",
                  "grpc._cython.cygrpc", "grpc.aio._server", "asyncinfer.gateway.connections")
#: Seconds in which a kind of record is logged once.
INTERVAL_S = 10.0

#: The attribute that marks a record the folder wrote itself (a count): it always passes.
_COUNT_MARK = "asyncinfer_folded_count"

Kind = tuple[str, int, str, str]


@dataclass
class _Seen:
    since: float
    shown: str  # the first line of the first record, as logged
    suppressed: int = 0


class RepeatFolder(logging.Filter):
    """Lets the first record of each kind through per ``interval_s``; counts the others.

    ``clock``: seconds, monotonic (injectable for tests)."""

    def __init__(self, interval_s: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self._clock = clock
        self._seen: dict[Kind, _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _COUNT_MARK, False):
            return True
        kind = _kind(record)
        now = self._clock()
        seen = self._seen.get(kind)
        if seen is not None and now - seen.since < self.interval_s:
            seen.suppressed += 1
            return False
        if seen is not None and seen.suppressed:
            _log_count(kind, seen, now)
        self._seen[kind] = _Seen(since=now, shown=_first_line(record))
        return True

    def flush(self, *, everything: bool = False) -> int:
        """Log the count of every kind whose interval has passed with records held back (of
        every kind, ``everything``: at exit), and forget those kinds; the number of count
        lines logged."""
        now = self._clock()
        logged = 0
        for kind, seen in list(self._seen.items()):
            if now - seen.since < self.interval_s and not everything:
                continue
            if seen.suppressed:
                _log_count(kind, seen, now)
                logged += 1
            del self._seen[kind]
        return logged

    def install(self, names: Iterable[str] = FOLDED_LOGGERS) -> None:
        """Put this folder on the loggers ``names`` (records logged to them directly)."""
        for name in names:
            logging.getLogger(name).addFilter(self)

    def uninstall(self, names: Iterable[str] = FOLDED_LOGGERS) -> None:
        for name in names:
            logging.getLogger(name).removeFilter(self)


def _kind(record: logging.LogRecord) -> Kind:
    first = str(record.msg).split("\n", 1)[0]
    error = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
    return (record.name, record.levelno, first, error)


def _first_line(record: logging.LogRecord) -> str:
    try:
        return record.getMessage().split("\n", 1)[0]
    except (TypeError, ValueError):  # arguments that do not fit: logging reports it itself
        return str(record.msg).split("\n", 1)[0]


def _log_count(kind: Kind, seen: _Seen, now: float) -> None:
    name, level, _, error = kind
    logging.getLogger(name).log(
        level, "%d more like this in the last %.0f s: %s%s", seen.suppressed, now - seen.since,
        seen.shown, f" ({error})" if error else "", extra={_COUNT_MARK: True})
