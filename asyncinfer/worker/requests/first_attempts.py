"""Counting first attempts towards the fleet's retry budget, off the requests' path.

The budget (policy/retry_budget.py) allows retries as a fraction of the requests of its last
windows (10 s each). The consumer adds each take's first attempts here, after those requests have
gone to their models; the count goes to Redis at most every ``COUNT_INTERVAL_S`` (an idle consumer
sends what is left within a second), not once per take.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

import redis

from asyncinfer.constants import TASK_NAME
from asyncinfer.policy.retries import Retries
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["FirstAttempts", "COUNT_INTERVAL_S"]

log = logging.getLogger(__name__)

#: While requests keep coming, their count is sent at most this often (seconds).
COUNT_INTERVAL_S = 0.1


class FirstAttempts:
    """First attempts taken and not yet counted in the budget of ``retries`` (from any thread:
    a fast consumer's take and its Celery consumer may both feed one pipeline)."""

    def __init__(self, retries: Retries) -> None:
        self.retries = retries
        self._uncounted = 0
        self._sent_at = 0.0
        self._lock = threading.Lock()

    def add(self, deliveries: Iterable[TakenMessage]) -> None:
        """Count the first attempts of asyncinfer.infer among ``deliveries``; send if due."""
        first = sum(1 for d in deliveries
                    if d.headers.get("task") == TASK_NAME and not d.headers.get("retries"))
        with self._lock:
            self._uncounted += first
        self.send(due_only=True)

    def send(self, due_only: bool) -> None:
        """Send what is counted (``due_only``: only if ``COUNT_INTERVAL_S`` has passed)."""
        now = time.monotonic()
        with self._lock:
            if not self._uncounted or (due_only and now - self._sent_at < COUNT_INTERVAL_S):
                return
            self._sent_at = now
            count, self._uncounted = self._uncounted, 0
        try:
            self.retries.count_first_attempts(count)
        except redis.RedisError as exc:  # sent with the next ones
            with self._lock:
                self._uncounted += count
            log.warning("could not count %d requests towards the retry budget (%s)", count, exc)
