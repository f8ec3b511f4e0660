"""Publishing from an event loop: a coroutine's request goes in the loop's next group.

:class:`AsyncPublisher` is the asyncio form of the grouped publisher (grouped.py): the same rules
(:class:`~asyncinfer.client.grouped.Pending`, :class:`~asyncinfer.client.grouped.Group`), driven
by a task on the loop instead of a thread. Every request a coroutine hands over while the last
group's round trip is out goes in the next group, one pipeline on the loop's one connection; the
coroutine awaits its own request's outcome (:meth:`AsyncPublisher.publish` returns its status or
raises what refused it), so an ``await`` waits for its group, not for a round trip of its own.
The task runs while requests wait and ends when none do; the next request starts it again.

:class:`LoopPublishers` keeps one per event loop (a ``redis.asyncio`` connection belongs to the
loop that opened it).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

import redis.asyncio

from asyncinfer.broker.connections import never_resend
from asyncinfer.broker.publisher import _PUBLISH, TRACE_PUSH, _Push, _ttl_s
from asyncinfer.broker.urls import has_asyncio_client
from asyncinfer.client.grouped import DescribeError, Entry, Group, Pending
from asyncinfer.wire.sequence import SequenceFlags

__all__ = ["AsyncPublisher", "LoopPublishers"]

log = logging.getLogger(__name__)


class AsyncPublisher:
    """Publishes from the running event loop on the ``redis.asyncio`` client ``client``, a group
    per round trip. Waits for replicas are not done here (a client that needs them publishes
    through the blocking :class:`~asyncinfer.broker.publisher.Publisher`)."""

    def __init__(self, client: Any, describe_error: DescribeError, *, claim_ttl_s: float,
                 mark_ttl_s: float = 0.0) -> None:
        self.client = client
        self.describe_error = describe_error
        self.mark_ttl_s = _ttl_s(mark_ttl_s)
        self.replicas = 0
        self.claim_ttl_s = _ttl_s(claim_ttl_s)
        self._publish = client.register_script(_PUBLISH)
        self._trace_push = client.register_script(TRACE_PUSH)
        self._pending = Pending()
        self._arrived = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._script_lost = True  # the first group loads the script (EVAL)

    async def publish(self, queue: str, request_id: str, message: str, *, claim: bool,
                      result_key: str | None = None, max_queue_size: int = 0,
                      timeout_s: float = 0.0, priority: int = 0, cache_key: str = "",
                      reply_to: str = "", level_max_queue_size: int = 0,
                      identity: str = "", sequence: SequenceFlags | None = None,
                      model: str | None = None) -> int:
        """:meth:`Publisher.publish <asyncinfer.broker.publisher.Publisher.publish>`, awaited:
        PUBLISHED or DUPLICATE once the request is on its queue (CACHED: answered from the
        response cache); raises what refused it."""
        push = _Push(self, queue, request_id, message, claim, result_key, max_queue_size,
                     timeout_s, priority, cache_key, reply_to, level_max_queue_size, identity,
                     sequence, model)
        outcome: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        # A coroutine cancelled before its group goes (a gateway call its client gave up on,
        # a request waiting for room in its queue) withdraws its request: it is never sent.
        self._pending.add(Entry(push, lambda status, error: _settle(outcome, status, error),
                                withdrawn=outcome.cancelled))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name="asyncinfer-publish")
        else:
            self._arrived.set()
        return await outcome

    async def aclose(self) -> None:
        """Send what is still pending, then close the connection."""
        if self._runner is not None:
            await asyncio.shield(self._runner)
        await self.client.aclose()

    async def _run(self) -> None:
        """Send groups while requests wait (those of a queue waiting for room once it is due)."""
        while True:
            now = time.monotonic()
            taken, wake_at = self._pending.take(now)
            if taken:
                await self._send(Group(taken, self, self.describe_error,
                                       script_lost=self._script_lost))
                continue
            if not self._pending:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(),
                                       None if wake_at is None else max(0.0, wake_at - now))
            except asyncio.TimeoutError:
                pass

    async def _send(self, group: Group) -> None:
        try:
            replies = await group.fill(self.client.pipeline(transaction=False)).execute(
                raise_on_error=False)
        except BaseException as exc:  # noqa: BLE001 - every request of the group hears it
            if not isinstance(exc, (redis.RedisError, asyncio.CancelledError)):
                log.exception("publishing a group of requests failed")
            group.failed(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        group.read(replies)
        self._script_lost = group.script_lost
        for entries, pause_s in group.again:
            self._pending.put_back(entries, pause_s)
        group.confirm()


def _settle(outcome: asyncio.Future[int], status: int | None, error: BaseException | None) -> None:
    if outcome.done():  # its caller was cancelled
        return
    if isinstance(error, asyncio.CancelledError):
        outcome.cancel()
    elif error is not None:
        outcome.set_exception(error)
    else:
        assert status is not None
        outcome.set_result(status)


class LoopPublishers:
    """A client's publishers for event loops: one ``redis.asyncio`` connection pool per loop
    (their connections belong to the loop that made them; a loop's group uses one). None where
    the loop cannot publish itself: a broker other than plain Redis, a Sentinel group, or
    replica waits. ``describe_error``: the error a request hears when Redis fails it."""

    def __init__(self, broker_url: str, describe_error: DescribeError, *, claim_ttl_s: float,
                 replicas: int, connect_timeout_s: float, mark_ttl_s: float = 0.0) -> None:
        self.usable = has_asyncio_client(broker_url) and not replicas
        self.broker_url = broker_url
        self.describe_error = describe_error
        self.claim_ttl_s = claim_ttl_s
        self.mark_ttl_s = mark_ttl_s
        self.connect_timeout_s = connect_timeout_s
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncPublisher] = (
            weakref.WeakKeyDictionary())

    def for_running_loop(self) -> AsyncPublisher | None:
        if not self.usable:
            return None
        loop = asyncio.get_running_loop()
        publisher = self._by_loop.get(loop)
        if publisher is None:
            client = redis.asyncio.Redis.from_url(
                self.broker_url, socket_connect_timeout=self.connect_timeout_s,
                retry=never_resend(asyncio=True))
            publisher = self._by_loop[loop] = AsyncPublisher(
                client, self.describe_error, claim_ttl_s=self.claim_ttl_s,
                mark_ttl_s=self.mark_ttl_s)
        return publisher

    async def aclose(self) -> None:
        """Send the running loop's pending requests, then close its connections."""
        publisher = self._by_loop.pop(asyncio.get_running_loop(), None)
        if publisher is not None:
            await publisher.aclose()
