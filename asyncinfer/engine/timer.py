"""One thread that calls functions at given times: time limits and delayed retries; and the
time limits of a request (:class:`TimeLimits`, read from Celery's options by the worker's policy:
policy/time_limits.py).

A heap and a condition variable: the thread sleeps until the earliest entry is due (or a new,
earlier one arrives), never polls. Entries are not cancelled; a callback checks whether it still
has work to do (a finished request's limit callback finds its future done and returns).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncinfer.supervision.vital import vital_thread

__all__ = ["Timer", "TimeLimits"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimeLimits:
    """Soft and hard limits in seconds; None where there is none."""

    soft_s: float | None = None
    hard_s: float | None = None

    def __bool__(self) -> bool:
        return self.soft_s is not None or self.hard_s is not None


class Timer:
    """Calls ``fn()`` at ``time.monotonic()`` readings given to :meth:`call_at`."""

    def __init__(self, name: str = "asyncinfer-timer") -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = vital_thread(self._run, name)
        self._thread.start()

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` (in the timer's thread) once ``time.monotonic()`` reaches ``when``."""
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), fn))
            if self._heap[0][2] is fn:
                self._cond.notify()

    def call_later(self, delay_s: float, fn: Callable[[], None]) -> None:
        """Call ``fn`` in ``delay_s`` seconds."""
        self.call_at(time.monotonic() + delay_s, fn)

    def __len__(self) -> int:
        return len(self._heap)

    def close(self) -> None:
        """Stop the thread; entries not yet due are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # noqa: BLE001 - one callback must not stop the others
                log.exception("timer callback failed")
