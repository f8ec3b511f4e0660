"""Streaming responses from a client (:class:`Streaming`, a part of
:class:`~asyncinfer.client.client.Client`): send a request and read its parts, or read any
request's parts, blocking or in asyncio (docs/streaming.md; client/streams.py)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from asyncinfer.client.response_stream import AsyncResponseStream, ResponseStream
from asyncinfer.client.streams import OnInterrupted, Streams

if TYPE_CHECKING:
    from asyncinfer.client.brokers import BrokerGroup

__all__ = ["Streaming"]


class Streaming:
    """:class:`~asyncinfer.client.client.Client`'s streaming calls."""

    if TYPE_CHECKING:  # the client's own
        _streams: dict[int, Streams]
        _streams_lock: threading.Lock

        def _group_for(self, model: str | None) -> BrokerGroup: ...

    def _streams_for(self, model: str | None) -> Streams:
        group = self._group_for(model)
        with self._streams_lock:
            streams = self._streams.get(id(group))
            if streams is None:
                streams = self._streams[id(group)] = Streams(group)
            return streams

    def stream(self, model: str, inputs: Any, *, parameters: Mapping[str, Any] | None = None,
               request_id: str | None = None, priority: int | None = None,
               timeout_s: float | None = None, on_interrupted: OnInterrupted | None = None,
               check_s: float = 1.0, **options: Any) -> ResponseStream:
        """Send one request and read its response in parts, as its model makes them::

            with client.stream("echo-stream", {"text_input": ["a b c"]}) as parts:
                for part in parts:
                    print(part.index, part["text_output"])

        The request is sent as :meth:`submit` sends it (its other ``options``; this returns once
        it is on its queue, or raises what refused it). Each part (a
        :class:`~asyncinfer.client.responses.StreamPart`) comes once, in order, even when its
        worker dies and the request runs again (``on_interrupted`` is called then, and
        ``stream.interruptions`` lists it). The iteration ends after the last part, or raises the
        request's error (a revoked request: :class:`~asyncinfer.errors.RequestRevoked`),
        :class:`~asyncinfer.errors.StreamTruncated` (parts trimmed before they were read), or
        :class:`~asyncinfer.errors.RequestTimeout` when it has not ended within ``timeout_s``.
        A model that does not stream gives its one answer as one part.

        Leaving the stream before its end (``close()``, the end of its ``with``, garbage
        collection) revokes the request. ``check_s``: how often, between parts, the reader looks
        at the request's lease and stored result (docs/streaming.md).
        """
        return self._streams_for(model).stream(
            model, inputs, request_id=request_id, timeout_s=timeout_s,
            on_interrupted=on_interrupted, check_s=check_s,
            options={"parameters": parameters, "priority": priority, **options})

    def read_stream(self, request_id: str, *, model: str | None = None, after: int = 0,
                    timeout_s: float | None = None, on_interrupted: OnInterrupted | None = None,
                    check_s: float = 1.0) -> ResponseStream:
        """The parts of a request sent by anyone, from its first (a late reader gets every part
        the stream holds), or those after part ``after`` (a reader that lost its connection goes
        on where it was). Sends nothing; closing it revokes nothing. ``model``: with routes, the
        request's model (its broker). Otherwise as :meth:`stream`."""
        return self._streams_for(model).read(request_id, after=after, timeout_s=timeout_s,
                                             on_interrupted=on_interrupted, check_s=check_s)

    def astream(self, model: str, inputs: Any, *, parameters: Mapping[str, Any] | None = None,
                request_id: str | None = None, priority: int | None = None,
                timeout_s: float | None = None, on_interrupted: OnInterrupted | None = None,
                check_s: float = 1.0, **options: Any) -> AsyncResponseStream:
        """:meth:`stream` in asyncio: ``async for part in client.astream(model, inputs)``. The
        request is sent at the first ``__anext__`` (or ``async with``), without blocking the
        loop; cancelling the task that reads it, or ``aclose()`` before its end, revokes it."""
        return self._streams_for(model).astream(
            model, inputs, request_id=request_id, timeout_s=timeout_s,
            on_interrupted=on_interrupted, check_s=check_s,
            options={"parameters": parameters, "priority": priority, **options})

    def aread_stream(self, request_id: str, *, model: str | None = None, after: int = 0,
                     timeout_s: float | None = None, on_interrupted: OnInterrupted | None = None,
                     check_s: float = 1.0) -> AsyncResponseStream:
        """:meth:`read_stream` in asyncio: ``async for part in client.aread_stream(id)``.
        ``on_interrupted`` is called on the loop's thread."""
        return self._streams_for(model).aread(request_id, after=after, timeout_s=timeout_s,
                                              on_interrupted=on_interrupted, check_s=check_s)
