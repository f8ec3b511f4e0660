"""Streaming responses on the client's side: :class:`Streams`, one broker group's connections
and the calls that make the :class:`ResponseStream` and :class:`AsyncResponseStream`
(client/response_stream.py) that ``client.stream`` / ``client.astream`` (send a request and read
its parts) and ``client.read_stream`` / ``client.aread_stream`` (read any request's parts) return.

A request is sent as every request is (``Client.submit``: the same message; a worker streams every
request of a decoupled model) and its parts are read from its stream (client/stream_reader.py).
A model the catalogue knows not to stream (its metadata's ``decoupled`` false or absent) is not
read at all: its one answer, when its future has it, is the stream's one part. Leaving a stream
of a request it sent before its end (``close()``, the end of its ``with``, garbage collection;
``aclose()`` or a cancelled task in asyncio) revokes the request, as ``InferFuture.cancel()``
does; a stream that only reads (``read_stream``) revokes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio
from celery import states

from asyncinfer.broker.connections import redis_client
from asyncinfer.broker.urls import has_asyncio_client, is_redis_url
from asyncinfer.client import aio
from asyncinfer.client.known_models import KnownModels
from asyncinfer.client.response_stream import AsyncResponseStream, ResponseStream
from asyncinfer.client.responses import (
    InferFuture,
    InferResponse,
    StreamPart,
    decode_stored,
    stored_outcome,
)
from asyncinfer.client.result_watcher import result_key_prefix
from asyncinfer.client.stream_progress import Interruption, StreamProgress
from asyncinfer.client.stream_reader import MAX_BLOCK_S, AsyncStreamReader, Stored, StreamReader, block_s_of
from asyncinfer.errors import AsyncInferError, RequestLost
from asyncinfer.wire.messages import uuid4_text

if TYPE_CHECKING:
    from asyncinfer.client.brokers import BrokerGroup

__all__ = ["Streams", "OnInterrupted"]

log = logging.getLogger(__name__)

#: What ``on_interrupted`` is called with.
OnInterrupted = Callable[[Interruption], Any]


class Streams:
    """One broker group's streams: the result backend's Redis connections that readers block on
    (a blocking client, one ``redis.asyncio`` client per event loop) and the four calls."""

    def __init__(self, group: BrokerGroup) -> None:
        self.group = group
        settings = group.settings
        self.url = str(group.app.conf.result_backend)
        #: Every read blocks at most MAX_BLOCK_S; a reply may take a connect's time more.
        self._timeouts: dict[str, Any] = {
            "socket_connect_timeout": settings.connect_timeout_s,
            "socket_timeout": MAX_BLOCK_S + max(settings.connect_timeout_s, 1.0) + 5}
        #: Result backend URL → the blocking client read there (one per shard of a cluster URL
        #: that spreads requests: a request's stream is on its shard).
        self._blocking: dict[str, redis.Redis] = {}
        self._lock = threading.Lock()
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary())
        #: What the catalogue said of each model's streaming, and when (monotonic): read again
        #: after ``KnownModels.KNOWN_FOR_S``, not at every stream's start.
        self._decoupled: dict[str, tuple[float, bool | None]] = {}

    # -- connections ---------------------------------------------------------------------------

    def _usable(self, request_id: str) -> None:
        if not is_redis_url(self.url):
            raise AsyncInferError(f"request {request_id}: streaming responses are read from the "
                                  f"result backend's Redis, and this client's result backend is "
                                  f"not Redis ({self.url.split(':', 1)[0]}://)")

    def blocking(self, request_id: str) -> redis.Redis:
        """The blocking client that sync readers of ``request_id`` read on (made on first use)."""
        url = str(self.group.sender.lane(request_id).app.conf.result_backend)
        with self._lock:
            client = self._blocking.get(url)
            if client is None:
                client = self._blocking[url] = redis_client(url, self.group.settings,
                                                            **self._timeouts)
            return client

    def for_running_loop(self) -> Any | None:
        """The running loop's ``redis.asyncio`` client (None for a Sentinel or a cluster URL:
        read in threads)."""
        if not has_asyncio_client(self.url):
            return None
        loop = asyncio.get_running_loop()
        client = self._by_loop.get(loop)
        if client is None:
            # no socket_timeout: the reader bounds each command itself (AsyncStreamReader)
            client = self._by_loop[loop] = redis.asyncio.Redis.from_url(
                self.url, socket_connect_timeout=self._timeouts["socket_connect_timeout"])
        return client

    def result_key(self, request_id: str) -> str:
        return result_key_prefix(self.group.app.backend) + request_id

    def stored(self, request_id: str) -> Stored:
        """A stored result payload of ``request_id`` → (status, its outcome)."""
        app = self.group.app

        def outcome(payload: Any) -> tuple[str, Any]:
            meta = decode_stored(app.backend, payload)
            status = str(meta.get("status") or "")
            if status not in states.READY_STATES:
                return status, None
            return status, stored_outcome(app, request_id, meta)

        return outcome

    def decoupled(self, model: str) -> bool | None:
        """Whether the catalogue says ``model`` streams (its metadata's ``decoupled``); None when
        it does not know the model (or cannot be read). A model's answer is read at most every
        ``KnownModels.KNOWN_FOR_S``."""
        now = time.monotonic()
        seen = self._decoupled.get(model)
        if seen is not None and now - seen[0] < KnownModels.KNOWN_FOR_S:
            return seen[1]
        catalogue = self.group.catalogue
        if catalogue is None:
            return None
        try:
            entry = catalogue.read().get(model)
        except redis.RedisError:
            return None  # not remembered: read again next time
        decoupled = None if entry is None else bool(entry.metadata.get("decoupled"))
        self._decoupled[model] = (now, decoupled)
        return decoupled

    def _reader_options(self, request_id: str, after: int, check_s: float,
                        on_interrupted: OnInterrupted | None, timeout_s: float | None,
                        lost: Callable[[], BaseException | None] | None) -> dict[str, Any]:
        return {"result_key": self.result_key(request_id), "stored": self.stored(request_id),
                "after": after, "check_s": check_s, "on_interrupted": on_interrupted,
                "timeout_s": timeout_s, "lost": lost}

    # -- blocking ------------------------------------------------------------------------------

    def stream(self, model: str, inputs: Any, *, request_id: str | None, timeout_s: float | None,
               on_interrupted: OnInterrupted | None, check_s: float,
               options: dict[str, Any]) -> ResponseStream:
        """Send a request (``Sender.submit``'s ``options``) and read its parts."""
        request_id = request_id or uuid4_text()
        self._usable(request_id)
        decoupled = self.decoupled(model)
        future = self.group.sender.submit(model, inputs, request_id=request_id, **options).sent()
        if decoupled is False:
            return ResponseStream(request_id, _one_part(future, timeout_s),
                                  ended=future.done, interruptions=[], revoke=future.cancel)
        reader = StreamReader(self.blocking(request_id), request_id, **self._reader_options(
            request_id, 0, check_s, on_interrupted, timeout_s, _lost(future)))
        return ResponseStream(request_id, iter(reader), ended=lambda: reader.ended,
                              interruptions=reader.interruptions, revoke=future.cancel)

    def read(self, request_id: str, *, after: int, timeout_s: float | None,
             on_interrupted: OnInterrupted | None, check_s: float) -> ResponseStream:
        """Read ``request_id``'s parts after part ``after``; sends and revokes nothing."""
        self._usable(request_id)
        reader = StreamReader(self.blocking(request_id), request_id, **self._reader_options(
            request_id, after, check_s, on_interrupted, timeout_s, None))
        return ResponseStream(request_id, iter(reader), ended=lambda: reader.ended,
                              interruptions=reader.interruptions)

    # -- asyncio -------------------------------------------------------------------------------

    def astream(self, model: str, inputs: Any, *, request_id: str | None,
                timeout_s: float | None, on_interrupted: OnInterrupted | None, check_s: float,
                options: dict[str, Any]) -> AsyncResponseStream:
        """:meth:`stream` in asyncio: the request is sent at the stream's first ``__anext__``."""
        request_id = request_id or uuid4_text()
        self._usable(request_id)
        block_s_of(check_s)  # bad arguments raise here, not at the first read
        interruptions: list[Interruption] = []
        sent: list[InferFuture] = []

        async def opening() -> tuple[AsyncIterator[StreamPart], Callable[[], bool]]:
            loop = asyncio.get_running_loop()
            decoupled = await loop.run_in_executor(None, self.decoupled, model)
            future = await aio.submit(self.group.sender, model, inputs,
                                      {**options, "request_id": request_id})
            sent.append(future)
            if decoupled is False:
                return _one_part_async(future, timeout_s), future.done
            reader = self._async_reader(request_id, 0, check_s, on_interrupted, timeout_s,
                                        _lost(future), interruptions)
            return aiter(reader), lambda: reader.ended

        def revoke() -> None:
            for future in sent:
                future.cancel()

        return AsyncResponseStream(request_id, opening, interruptions=interruptions, revoke=revoke)

    def aread(self, request_id: str, *, after: int, timeout_s: float | None,
              on_interrupted: OnInterrupted | None, check_s: float) -> AsyncResponseStream:
        """:meth:`read` in asyncio."""
        self._usable(request_id)
        interruptions: list[Interruption] = []

        async def opening() -> tuple[AsyncIterator[StreamPart], Callable[[], bool]]:
            reader = self._async_reader(request_id, after, check_s, on_interrupted, timeout_s,
                                        None, interruptions)
            return aiter(reader), lambda: reader.ended

        StreamProgress(request_id, after=after)  # bad arguments raise here, not at the first read
        block_s_of(check_s)
        return AsyncResponseStream(request_id, opening, interruptions=interruptions)

    def _async_reader(self, request_id: str, after: int, check_s: float,
                      on_interrupted: OnInterrupted | None, timeout_s: float | None,
                      lost: Callable[[], BaseException | None] | None,
                      interruptions: list[Interruption]) -> Any:
        def noted(interruption: Interruption) -> None:
            interruptions.append(interruption)
            if on_interrupted is not None:
                on_interrupted(interruption)

        client = self.for_running_loop()
        if client is None:  # Sentinel: the blocking reader, in the loop's executor
            loop = asyncio.get_running_loop()

            def on_loop(interruption: Interruption) -> None:  # told on the loop's thread
                loop.call_soon_threadsafe(noted, interruption)

            options = self._reader_options(request_id, after, check_s, on_loop, timeout_s, lost)
            return _InThreads(StreamReader(self.blocking(request_id), request_id, **options))
        options = self._reader_options(request_id, after, check_s, noted, timeout_s, lost)
        return AsyncStreamReader(client, request_id, **options)

    # -- closing -------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the running loop's connections."""
        client = self._by_loop.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def close(self) -> None:
        """Close the blocking client's connections."""
        with self._lock:
            clients, self._blocking = list(self._blocking.values()), {}
        for client in clients:
            client.close()


class _InThreads:
    """A blocking reader read from a coroutine, one part per executor call."""

    def __init__(self, reader: StreamReader) -> None:
        self.reader = reader

    @property
    def ended(self) -> bool:
        return self.reader.ended

    async def __aiter__(self) -> AsyncIterator[StreamPart]:
        loop = asyncio.get_running_loop()
        parts = iter(self.reader)
        done = object()
        while True:
            part = await loop.run_in_executor(None, next, parts, done)
            if part is done:
                return
            assert isinstance(part, StreamPart)
            yield part


def _lost(future: InferFuture) -> Callable[[], BaseException | None]:
    """What ends a reading of ``future``'s request without a stored result: the broker lost it
    (RequestLost, from the client's lost check)."""

    def lost() -> BaseException | None:
        if not future.done() or future.cancelled():
            return None
        error = future.exception(0)
        return error if isinstance(error, RequestLost) else None

    return lost


def _as_part(request_id: str, response: Any) -> StreamPart:
    if not isinstance(response, InferResponse):
        raise AsyncInferError(f"request {request_id}: its result is not a v2 response "
                              f"({type(response).__name__}), so it has no part to show")
    return StreamPart(request_id, 1, list(response.outputs.values()))


def _one_part(future: InferFuture, timeout_s: float | None) -> Iterator[StreamPart]:
    """A model that does not stream: its one answer as the one part (a revoke is the future's
    RequestRevoked already, client/responses.py)."""
    yield _as_part(future.id, future.result(timeout=timeout_s))


async def _one_part_async(future: InferFuture,
                          timeout_s: float | None) -> AsyncIterator[StreamPart]:
    response = await aio.wait_response(asyncio.wrap_future(future), timeout_s, future.id)
    yield _as_part(future.id, response)
