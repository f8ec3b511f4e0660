"""Waking an idle consumer when a request arrives, without taking the request.

A blocking pop (BRPOP, kombu's way) hands a message to the worker before the worker has recorded
it as unacknowledged: a worker killed in between loses it. Redis has no command that blocks until
one of several lists is non-empty without popping, but ``BLMOVE list list RIGHT RIGHT`` on a single
list does exactly that: it blocks while the list is empty and then moves the tail element onto the
tail of the same list — a no-op, done atomically. So every list an idle consumer watches gets one
thread with its own connection that blocks in that command; when one returns, the consumer wakes
and takes with the atomic take script (take.py). Nothing ever leaves a queue except through that
script, whoever the producer is (our client, Celery's ``send_task``, ``redis-cli``, another
language), so a request is at all times either on its queue or in kombu's unacknowledged
bookkeeping.

A watcher that fired waits until the consumer is idle again (:meth:`Waker.arm`) before it blocks
again; otherwise it would spin on a list that is not empty. Redis older than 6.2 has no BLMOVE:
``BRPOPLPUSH list list`` is used instead (it moves the oldest message to the front of its list,
which changes the order of that one message, never loses it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import redis

from asyncinfer.workers.vital import vital_thread

__all__ = ["Waker"]

log = logging.getLogger(__name__)


class Waker:
    """Watches ``lists`` on ``client``'s server; :meth:`wait` returns once one may hold a message.

    ``client`` must have a socket timeout longer than ``block_s`` (or none): each watcher blocks
    for up to ``block_s`` at a time, and looks whether it should stop in between.
    """

    def __init__(self, client: redis.Redis, lists: Sequence[str], *, block_s: int = 5,
                 stopping: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.lists = list(lists)
        self.block_s = block_s
        self._stopping = stopping or (lambda: False)
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._generation = 0
        self._rotate = False  # BRPOPLPUSH instead of BLMOVE (Redis < 6.2)
        self._threads = [vital_thread(self._watch, f"asyncinfer-wake-{i}", key)
                         for i, key in enumerate(self.lists)]

    def start(self) -> Waker:
        for thread in self._threads:
            thread.start()
        return self

    def clear(self) -> None:
        """Forget earlier wake-ups: call it just before taking, so none that follows is lost."""
        self._wake.clear()

    def arm(self) -> None:
        """The consumer is idle: every watcher that fired blocks on its list again."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Block until a watched list had a message since :meth:`clear` (True), or ``timeout_s``."""
        return self._wake.wait(timeout_s)

    def close(self) -> None:
        """Stop the watchers (their blocked commands are cut by closing the connections)."""
        self._closed.set()
        self._wake.set()
        with self._cond:
            self._cond.notify_all()
        try:
            self.client.connection_pool.disconnect()
        except Exception:  # noqa: BLE001 - closing anyway
            pass

    def _done(self) -> bool:
        return self._closed.is_set() or self._stopping()

    def _watch(self, key: str) -> None:
        seen = -1
        backoff_s = 0.1
        while not self._done():
            with self._cond:
                while self._generation == seen and not self._done():
                    self._cond.wait()
                seen = self._generation
            while not self._done():
                try:
                    found = self._block(key)
                    backoff_s = 0.1
                except Exception as exc:  # noqa: BLE001 - Redis errors, or a socket closed under it
                    if self._done():
                        return  # close() cut the connection
                    log.warning("watching %s failed (%s: %s); again in %.1f s", key,
                                type(exc).__name__, exc, backoff_s)
                    self._closed.wait(backoff_s)
                    backoff_s = min(backoff_s * 2, 5.0)
                    continue
                if found is not None:
                    self._wake.set()
                    break

    def _block(self, key: str) -> Any:
        if not self._rotate:
            try:
                return self.client.blmove(key, key, self.block_s, src="RIGHT", dest="RIGHT")
            except redis.ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    raise
                log.info("this Redis has no BLMOVE (before 6.2): watching with BRPOPLPUSH")
                self._rotate = True
        return self.client.brpoplpush(key, key, self.block_s)
