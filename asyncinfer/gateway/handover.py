"""Results from the client's result watcher thread to the gateway's event loop, several per wake-up.

The watcher settles a request's :class:`~asyncinfer.client.responses.InferFuture` in its own
thread. ``asyncio.wrap_future`` would hand each one to the loop with its own
``call_soon_threadsafe`` (a write on the loop's wake-up pipe, a loop iteration, and a chained
future's callbacks). Under load the watcher settles many requests in one burst (a worker's batch),
so a :class:`Handover` queues each settled future and wakes the loop only when nothing is queued
yet: the loop then ends every queued waiter in one callback.

A waiter is a plain loop future, not chained to the request's: cancelling it (the caller went
away) does not cancel the request; the caller decides what that means (the service revokes it).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from typing import Any, TypeVar

__all__ = ["Handover"]

T = TypeVar("T")


class Handover:
    """Hands settled ``concurrent.futures`` to waiters on one event loop (:meth:`wait`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._settled: collections.deque[tuple[asyncio.Future[Any],
                                               concurrent.futures.Future[Any]]] = collections.deque()
        self._woken = False
        #: Wake-ups of the loop so far (each ends every waiter queued by then).
        self.wakeups = 0

    def wait(self, future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
        """A loop future that ends as ``future`` does (result, exception or cancellation).
        Call on the loop."""
        waiter: asyncio.Future[T] = self.loop.create_future()
        if future.done():
            _copy(future, waiter)
        else:
            future.add_done_callback(lambda done: self._settle(waiter, done))
        return waiter

    def _settle(self, waiter: asyncio.Future[Any], done: concurrent.futures.Future[Any]) -> None:
        # Any thread (the watcher's, or the loop's when the future ends while it is added).
        self._settled.append((waiter, done))
        if not self._woken:
            self._woken = True
            self.wakeups += 1
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def _drain(self) -> None:
        self._woken = False  # before taking: a future settled from now on wakes the loop again
        settled = self._settled
        while settled:
            waiter, done = settled.popleft()
            _copy(done, waiter)


def _copy(source: concurrent.futures.Future[Any], waiter: asyncio.Future[Any]) -> None:
    if waiter.done():
        return  # its caller went away
    if source.cancelled():
        waiter.cancel()
        return
    exc = source.exception()
    if exc is not None:
        waiter.set_exception(exc)
    else:
        waiter.set_result(source.result())
