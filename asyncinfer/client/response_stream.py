"""The streams a client reads: :class:`ResponseStream` and :class:`AsyncResponseStream`, what
``client.stream`` / ``client.astream`` (send a request and read its parts) and
``client.read_stream`` / ``client.aread_stream`` (read any request's parts) return.

Leaving a stream of a request it sent before its end (``close()``, the end of its ``with``,
garbage collection; ``aclose()`` or a cancelled task in asyncio) revokes the request, as
``InferFuture.cancel()`` does; a stream that only reads (``read_stream``) revokes nothing.
client/streams.py makes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from asyncinfer.client.responses import StreamPart
from asyncinfer.client.stream_progress import Interruption

__all__ = ["ResponseStream", "AsyncResponseStream"]


class ResponseStream:
    """The parts of one request as they are made: ``for part in stream`` (each a
    :class:`~asyncinfer.client.responses.StreamPart`, in order, each once); a context manager.

    It ends after the request's last part, or raises the request's error (as its future would;
    a revoked request: :class:`~asyncinfer.errors.RequestRevoked`). Closing it before then
    revokes the request when this stream sent it.
    """

    def __init__(self, request_id: str, parts: Iterator[StreamPart], *,
                 ended: Callable[[], bool], interruptions: list[Interruption],
                 revoke: Callable[[], Any] | None = None) -> None:
        self.request_id = request_id
        #: Every interruption reported so far (its worker died or froze; it runs again).
        self.interruptions = interruptions
        self._parts = parts
        self._ended = ended
        self._revoke = revoke
        self._closed = False

    def __iter__(self) -> ResponseStream:
        return self

    def __next__(self) -> StreamPart:
        if self._closed:
            raise StopIteration
        return next(self._parts)

    @property
    def ended(self) -> bool:
        """The request's end was seen: nothing more will come."""
        return self._ended()

    def close(self) -> None:
        """Stop reading; a request this stream sent and that has not ended is revoked."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self._parts, "close", None)
        if close is not None:
            close()
        if self._revoke is not None and not self._ended():
            self._revoke()

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nothing to raise to at garbage collection
                pass

    def __repr__(self) -> str:
        return f"<ResponseStream {self.request_id}{' ended' if self._ended() else ''}>"


class AsyncResponseStream:
    """``async for part in stream``: :class:`ResponseStream` in asyncio (an async context
    manager). A stream that sends its request sends it at the first ``__anext__`` (or
    ``async with``); cancelling the task that reads it, or ``aclose()`` before the end, revokes
    the request."""

    def __init__(self, request_id: str,
                 opening: Callable[[], Awaitable[tuple[AsyncIterator[StreamPart],
                                                       Callable[[], bool]]]], *,
                 interruptions: list[Interruption],
                 revoke: Callable[[], Any] | None = None) -> None:
        self.request_id = request_id
        #: Every interruption reported so far (its worker died or froze; it runs again).
        self.interruptions = interruptions
        self._opening: Callable[..., Awaitable[Any]] | None = opening
        self._parts: AsyncIterator[StreamPart] | None = None
        self._ended: Callable[[], bool] = lambda: False
        self._revoke = revoke
        self._closed = False

    async def _open(self) -> AsyncIterator[StreamPart]:
        if self._parts is None:
            assert self._opening is not None
            opening, self._opening = self._opening, None
            self._parts, self._ended = await opening()
        return self._parts

    def __aiter__(self) -> AsyncResponseStream:
        return self

    async def __anext__(self) -> StreamPart:
        if self._closed:
            raise StopAsyncIteration
        try:
            parts = await self._open()
            return await parts.__anext__()
        except asyncio.CancelledError:
            self._closed = True
            self._revoke_soon()
            raise

    @property
    def ended(self) -> bool:
        """The request's end was seen: nothing more will come."""
        return self._ended()

    def _revoke_soon(self) -> None:
        """Revoke (a broadcast: in the executor) when this stream sent a request not ended."""
        if self._revoke is not None and self._parts is not None and not self._ended():
            asyncio.get_running_loop().run_in_executor(None, self._revoke)

    async def aclose(self) -> None:
        """Stop reading; a request this stream sent and that has not ended is revoked."""
        if self._closed:
            return
        self._closed = True
        if self._parts is not None:
            aclose = getattr(self._parts, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._revoke is not None and not self._ended():
                await asyncio.get_running_loop().run_in_executor(None, self._revoke)

    async def __aenter__(self) -> AsyncResponseStream:
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "_parts", None) is None:
            return
        if self._revoke is not None and not self._ended():
            try:
                self._revoke()
            except Exception:  # noqa: BLE001 - nothing to raise to at garbage collection
                pass

    def __repr__(self) -> str:
        return f"<AsyncResponseStream {self.request_id}{' ended' if self._ended() else ''}>"
