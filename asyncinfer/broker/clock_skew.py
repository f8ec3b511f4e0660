"""How far this host's clock is from the broker's (Redis ``TIME``), kept for the process in
``wire/clock.py`` and measured again every minute.

A reading is Redis' time against the midpoint of the round trip that read it; the best of a
few (the shortest round trip) is kept, so the error is at most half a round trip. A host whose
clock is more than :data:`WARN_AFTER_S` off says so once in its log (and again if the offset
changes by as much): its deadlines are still kept, since every ``expires`` and ``eta`` is set
and judged on the broker's clock, but its logs' times are not."""

from __future__ import annotations

import logging
import threading
import time

import redis

from asyncinfer.wire.clock import BROKER_CLOCK, BrokerClock

__all__ = ["CLOCK_FOLLOWER", "REMEASURE_S", "WARN_AFTER_S", "ClockFollower", "measure_offset_s"]

log = logging.getLogger(__name__)

#: A clock this far off the broker's (seconds) is named in the log.
WARN_AFTER_S = 1.0
#: The offset is measured again this often (seconds): clocks drift, and get stepped by NTP.
REMEASURE_S = 60.0
#: Readings per measurement; the one with the shortest round trip is kept.
READINGS = 3


def measure_offset_s(client: redis.Redis, readings: int = READINGS) -> float:
    """The broker's clock minus this host's (seconds), from ``readings`` reads of ``TIME``."""
    best: tuple[float, float] | None = None  # (round trip, offset)
    for _ in range(max(1, readings)):
        before = time.time()
        seconds, micros = client.time()
        after = time.time()
        offset = seconds + micros / 1e6 - (before + after) / 2
        if best is None or after - before < best[0]:
            best = (after - before, offset)
    assert best is not None
    return best[1]


class ClockFollower:
    """Keeps ``clock``'s offset measured: once before it is needed, then every ``remeasure_s``
    on a thread of its own (one a process)."""

    def __init__(self, clock: BrokerClock, remeasure_s: float = REMEASURE_S) -> None:
        self.clock = clock
        self.remeasure_s = remeasure_s
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        #: What the thread reads the broker's clock through (the newest ``follow``'s).
        self._client: redis.Redis | None = None
        #: The offset last named in the log (None: none yet).
        self._warned_s: float | None = None

    def measure(self, client: redis.Redis) -> bool:
        """Measure and keep the offset; whether the broker's clock could be read."""
        try:
            offset = measure_offset_s(client)
        except Exception as exc:  # noqa: BLE001 - the thread must outlive whatever goes wrong
            log.debug("could not read the broker's clock (%s); the offset stays %.3f s", exc,
                      self.clock.offset_s)
            return False
        self.clock.set_offset_s(offset)
        if abs(offset) > WARN_AFTER_S and (self._warned_s is None
                                           or abs(offset - self._warned_s) > WARN_AFTER_S):
            self._warned_s = offset
            log.warning("this host's clock is %.1f s %s the broker's (Redis TIME); every expires "
                        "and eta is set and judged on the broker's clock, but this host's log "
                        "times are off by as much: synchronise its clock (NTP)", abs(offset),
                        "behind" if offset > 0 else "ahead of")
        return True

    def measured(self, client: redis.Redis) -> None:
        """Measure the offset now through ``client`` unless this process has already: before the
        first deadline a producer sets (the thread may not have read the clock yet)."""
        if not self.clock.measured:
            with self._lock:
                if not self.clock.measured:
                    self.measure(client)

    def follow(self, client: redis.Redis, *, wait: bool = False) -> None:
        """Keep the offset measured through ``client`` (a pooled, thread-safe one: the thread
        shares it), now and every ``remeasure_s``; the newest call's client is the one read. With
        ``wait`` the measurement is made before this returns (a worker, before it takes
        anything); else on the thread."""
        with self._lock:
            self._client = client
            if wait:
                self.measure(client)
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._run, args=(not wait,),
                                            name="asyncinfer-broker-clock", daemon=True)
            self._thread.start()

    def _run(self, first: bool) -> None:
        while True:
            if first and self._client is not None:
                self.measure(self._client)
            first = True
            time.sleep(self.remeasure_s)


#: The process' one, keeping :data:`~asyncinfer.wire.clock.BROKER_CLOCK`.
CLOCK_FOLLOWER = ClockFollower(BROKER_CLOCK)
