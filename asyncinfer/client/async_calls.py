"""A client's calls from a coroutine (:class:`AsyncCalls`, a part of
:class:`~asyncinfer.client.client.Client`): the same calls as the blocking ones, never blocking
the loop (asyncinfer.client.aio)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from asyncinfer.client import aio
from asyncinfer.client.responses import InferResponse

if TYPE_CHECKING:
    from asyncinfer.client.sender import Sender

__all__ = ["AsyncCalls"]


class AsyncCalls:
    """:class:`~asyncinfer.client.client.Client`'s asyncio calls (its ``aclose`` is its own)."""

    if TYPE_CHECKING:  # the client's own
        def sender_for(self, model: str) -> Sender: ...

    async def asubmit(self, model: str, inputs: Any, **options: Any) -> asyncio.Future[InferResponse]:
        """Send one request from a coroutine; return an asyncio future of its response.

        Takes :meth:`submit`'s options. A small request is published by the loop itself, others
        in the loop's default executor (:func:`asyncinfer.client.aio.submit`); the result
        watcher thread settles the future through ``call_soon_threadsafe``. Cancelling the future
        (or a task awaiting it) revokes the request, as ``InferFuture.cancel()`` does.
        """
        future = await aio.submit(self.sender_for(model), model, inputs, options)
        return asyncio.wrap_future(future, loop=asyncio.get_running_loop())

    async def ainfer(self, model: str, inputs: Any, *, timeout_s: float | None = None,
                     **options: Any) -> InferResponse:
        """Send one request and await its response (``TimeoutError`` after ``timeout_s``; the
        request keeps running). Cancelling the awaiting task revokes the request."""
        future = await aio.submit(self.sender_for(model), model, inputs, options)
        return await aio.wait_response(asyncio.wrap_future(future), timeout_s, future.id)

    def amap(self, model: str, inputs: Iterable[Any], *, timeout_s: float | None = None,
             **options: Any) -> AsyncIterator[InferResponse]:
        """``async for response in client.amap(model, inputs)``: send every request at once,
        yield the responses in input order (``timeout_s`` per response)."""
        return aio.amap(self.sender_for(model), model, inputs, timeout_s, options)

    def as_completed(self, futures: Iterable[aio.AnyFuture], *,
                     timeout_s: float | None = None) -> AsyncIterator[InferResponse]:
        """``async for response in client.as_completed(futures)``: the responses of futures from
        :meth:`submit` or :meth:`asubmit` in completion order. A failed request raises its
        exception from the loop; ``timeout_s`` bounds the whole iteration."""
        return aio.as_completed(futures, timeout_s)
