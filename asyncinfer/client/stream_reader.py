"""Reading one request's stream of parts (wire/stream.py) as it is written: blocking and asyncio.

A reader sends ``XREAD BLOCK`` strictly after the last entry ID it saw (``0-0``, or part ``n`` to
resume after it), so it shows each part once however often it reconnects. It ends after the
stream's ``final``: nothing more (SUCCESS), or the request's error as its future raises it
(FAILURE: the stored result's exception; REVOKED: :class:`~asyncinfer.errors.RequestRevoked`
naming the request). A part above the next one expected (the stream was trimmed to the model's
``stream_max_parts``) raises :class:`~asyncinfer.errors.StreamTruncated`; an entry that breaks the
contract raises :class:`StreamMalformed`; both name the request.

Between entries, every ``check_s``, it looks at two things in one round trip:

- the lease of the last ``start`` (``ZSCORE asyncinfer:leases <tag>`` against Redis' ``TIME``):
  gone or run out with no ``final`` means its worker died or froze. That is reported once per
  ``start`` (:class:`Interruption`: a list and a callback) and the reader goes on waiting: the
  request is delivered again, a new ``start`` follows and its parts go on after the last one seen.
  A second ``start`` with no interruption reported for the first is one too;
- the request's stored result (Celery's result key): stored with no ``final`` in the stream (a
  model that does not stream, a request refused before its model ran) ends the reading with that
  result as one part, or its error.

:class:`~asyncinfer.client.stream_progress.StreamProgress` is the sans-IO core (what an entry or
a look means, client/stream_progress.py); :class:`StreamReader` and :class:`AsyncStreamReader`
only do the I/O, on redis-py and ``redis.asyncio`` clients of the result backend.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import redis
import redis.asyncio
from celery import states

from asyncinfer.backoff import Backoff
from asyncinfer.client.responses import StreamPart
from asyncinfer.client.stream_progress import (
    FINAL_STATES,
    Interruption,
    StreamProgress,
    entry_count,
)
from asyncinfer.errors import BrokerUnavailable, RequestTimeout
from asyncinfer.wire.keys import LEASES_KEY

__all__ = ["StreamReader", "block_s_of", "AsyncStreamReader", "Stored"]

log = logging.getLogger(__name__)

#: A stored result payload → ``(status, outcome)``: for a final status the response or the
#: exception its future would give (:func:`~asyncinfer.client.responses.stored_outcome`), else None.
Stored = Callable[[Any], tuple[str, Any]]

#: Entries read in one XREAD at most.
READ_COUNT = 256
#: The longest one XREAD blocks (seconds), whatever ``check_s`` says.
MAX_BLOCK_S = 10.0
#: How long past what it was asked to block Redis may take to answer (seconds).
REPLY_MARGIN_S = 10.0


def block_s_of(check_s: float) -> float:
    """How long one XREAD blocks for ``check_s`` (ValueError unless it is above 0)."""
    if check_s <= 0:
        raise ValueError(f"check_s must be above 0, got {check_s!r}")
    return min(check_s, MAX_BLOCK_S)


class _Reading:
    """What both readers share: the progress, the settings, the clock."""

    #: How long a FAILURE's stored result may take to follow its ``final`` (seconds).
    failure_wait_s = 5.0
    #: How long Redis may fail every read before the reader gives up (seconds).
    give_up_after_s = 30.0

    def __init__(self, client: Any, request_id: str, *, result_key: str, stored: Stored,
                 after: int = 0, check_s: float = 1.0,
                 on_interrupted: Callable[[Interruption], Any] | None = None,
                 timeout_s: float | None = None,
                 lost: Callable[[], BaseException | None] | None = None) -> None:
        self.client = client
        self.progress = StreamProgress(request_id, after=after, on_interrupted=on_interrupted)
        self.result_key = result_key
        self.stored = stored
        self.check_s = block_s_of(check_s)
        self.timeout_s = timeout_s
        self.lost = lost
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._failing_since: float | None = None
        self._backoff = Backoff()

    @property
    def request_id(self) -> str:
        return self.progress.request_id

    @property
    def interruptions(self) -> list[Interruption]:
        """Every interruption reported so far."""
        return self.progress.interruptions

    @property
    def ended(self) -> bool:
        """The request's end was seen (nothing more will come)."""
        return self.progress.ended

    def _block_ms(self) -> int:
        wait_s = self.check_s
        if self._deadline is not None:
            left_s = self._deadline - time.monotonic()
            if left_s <= 0:
                raise RequestTimeout(
                    f"request {self.request_id}: its stream did not end within "
                    f"{self.timeout_s:g} s (last part seen: {self.progress.last_part}); it may "
                    f"still finish (read it on with read_stream('{self.request_id}', "
                    f"after={self.progress.last_part}))")
            wait_s = min(wait_s, left_s)
        return max(1, int(wait_s * 1000))

    def _check_lost(self) -> None:
        if self.lost is not None:
            error = self.lost()
            if error is not None:
                self.progress.ended = True
                raise error

    def _looks(self, pipe: Any) -> None:
        """Queue the looks between entries on ``pipe``: the lease (and TIME), the result."""
        tag = self.progress.lease_tag
        if tag:
            pipe.zscore(LEASES_KEY, tag)
            pipe.time()
        pipe.get(self.result_key)

    def _judge(self, replies: list[Any], reply: Any) -> list[StreamPart]:
        """After the looks (:meth:`_looks`' ``replies``) and one more read of the stream
        (``reply``): the entries read, then the stored result, else the lease. A stored result
        is stored after its ``final``, and a lease given back after both: what the read found
        was in the stream before the looks were made."""
        progress = self.progress
        drained = progress.take_reply(reply)
        if progress.final is not None or progress.failure is not None:
            return drained
        if entry_count(reply) >= READ_COUNT:
            return drained  # more to read: judged at the next look
        status, outcome = self.stored(replies[-1]) if replies[-1] is not None else ("", None)
        if status in FINAL_STATES:
            return drained + progress.stored_end(status, outcome)
        if len(replies) == 3:
            progress.judge_lease(replies[0], replies[1])
        return drained

    def _failed(self, exc: Exception) -> float:
        """Redis failed a read: seconds to wait before the next, or raise when it has failed
        for too long."""
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if now - self._failing_since > self.give_up_after_s:
            raise BrokerUnavailable(
                f"request {self.request_id}: the result backend's Redis failed every read of its "
                f"stream for {self.give_up_after_s:g} s ({type(exc).__name__}: {exc}); read it on "
                f"with read_stream('{self.request_id}', after={self.progress.last_part})") from exc
        wait_s = self._backoff.failed()
        log.warning("request %s: reading its stream failed (%s); again in %.1f s",
                    self.request_id, exc, wait_s)
        return wait_s

    def _answered(self) -> None:
        self._failing_since = None
        self._backoff.reset()


class StreamReader(_Reading):
    """Iterate for the parts of one request's stream (a redis-py client of the result backend)."""

    def __iter__(self) -> Iterator[StreamPart]:
        return self._read()

    def _read(self) -> Iterator[StreamPart]:
        progress = self.progress
        next_check = time.monotonic()  # the first look at once: a request long finished
        while True:
            looking = progress.final is None and time.monotonic() >= next_check
            try:
                if looking:
                    next_check = time.monotonic() + self.check_s
                    parts = self._check()
                else:
                    parts = progress.take_reply(self.client.xread(
                        {progress.key: progress.last_id}, count=READ_COUNT,
                        block=self._block_ms()))
                self._answered()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                time.sleep(self._failed(exc))
                continue
            yield from parts
            if progress.failure is not None:
                raise progress.failure
            if progress.final is not None:
                error = progress.final_error(self._stored_failure())
                if error is not None:
                    raise error
                return
            if progress.ended:
                return

    def _check(self) -> list[StreamPart]:
        self._check_lost()
        pipe = self.client.pipeline(transaction=False)
        self._looks(pipe)
        replies = pipe.execute()
        reply = self.client.xread({self.progress.key: self.progress.last_id}, count=READ_COUNT)
        return self._judge(replies, reply)

    def _stored_failure(self) -> tuple[str, Any] | None:
        """A FAILURE's stored result (written just after its ``final``), waited for a while."""
        final = self.progress.final
        if final is None or final.status != states.FAILURE:
            return None
        give_up = time.monotonic() + self.failure_wait_s
        while True:
            try:
                payload = self.client.get(self.result_key)
            except (redis.ConnectionError, redis.TimeoutError):
                payload = None
            if payload is not None:
                stored = self.stored(payload)
                if stored[0] in FINAL_STATES:
                    return stored
            if time.monotonic() >= give_up:
                return None
            time.sleep(0.02)


class AsyncStreamReader(_Reading):
    """``async for`` the parts of one request's stream (a ``redis.asyncio`` client of the result
    backend, made without a ``socket_timeout``: each command is bounded here instead).

    Why: with redis-py 8.1 a ``socket_timeout`` on a pooled connection can swallow the cancelling
    of the task that awaits a command sent right after another one (the task reads on, and its
    request is never revoked); ``asyncio.wait_for`` around the command keeps both the bound and
    the cancel.
    """

    def __aiter__(self) -> AsyncIterator[StreamPart]:
        return self._read()

    async def _read(self) -> AsyncIterator[StreamPart]:
        progress = self.progress
        next_check = time.monotonic()  # the first look at once: a request long finished
        while True:
            looking = progress.final is None and time.monotonic() >= next_check
            try:
                if looking:
                    next_check = time.monotonic() + self.check_s
                    parts = await self._check()
                else:
                    block_ms = self._block_ms()
                    parts = progress.take_reply(await self._reply(self.client.xread(
                        {progress.key: progress.last_id}, count=READ_COUNT, block=block_ms),
                        block_ms / 1000))
                self._answered()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                await asyncio.sleep(self._failed(exc))
                continue
            for part in parts:
                yield part
            if progress.failure is not None:
                raise progress.failure
            if progress.final is not None:
                error = progress.final_error(await self._stored_failure())
                if error is not None:
                    raise error
                return
            if progress.ended:
                return

    async def _check(self) -> list[StreamPart]:
        self._check_lost()
        pipe = self.client.pipeline(transaction=False)
        self._looks(pipe)
        replies = await self._reply(pipe.execute())
        reply = await self._reply(self.client.xread(
            {self.progress.key: self.progress.last_id}, count=READ_COUNT))
        return self._judge(replies, reply)

    async def _reply(self, command: Awaitable[Any], blocks_s: float = 0.0) -> Any:
        """``command``'s reply, or redis.TimeoutError when Redis has not answered within
        ``blocks_s`` (what it was asked to block) + :data:`REPLY_MARGIN_S`. The client's own
        socket timeout is off (see :class:`AsyncStreamReader`)."""
        try:
            return await asyncio.wait_for(command, blocks_s + REPLY_MARGIN_S)
        except asyncio.TimeoutError:
            raise redis.TimeoutError(f"no reply from Redis within "
                                     f"{blocks_s + REPLY_MARGIN_S:g} s") from None

    async def _stored_failure(self) -> tuple[str, Any] | None:
        final = self.progress.final
        if final is None or final.status != states.FAILURE:
            return None
        give_up = time.monotonic() + self.failure_wait_s
        while True:
            try:
                payload = await self._reply(self.client.get(self.result_key))
            except (redis.ConnectionError, redis.TimeoutError):
                payload = None
            if payload is not None:
                stored = self.stored(payload)
                if stored[0] in FINAL_STATES:
                    return stored
            if time.monotonic() >= give_up:
                return None
            await asyncio.sleep(0.02)
