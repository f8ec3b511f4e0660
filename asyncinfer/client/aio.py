"""asyncio forms of the client's calls: ``ainfer``, ``asubmit``, ``amap``, ``as_completed``.

Nothing here polls. A request's :class:`~asyncinfer.client.client.InferFuture` is settled by the client's
result watcher thread; ``asyncio.wrap_future`` hands that to the event loop through
``call_soon_threadsafe``. Publishing runs in the loop's default executor, so a broker that is slow
to answer (or down, until ``ASYNCINFER_CONNECT_TIMEOUT_S``) never blocks the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, Union

from asyncinfer.errors import RequestTimeout

if TYPE_CHECKING:
    from asyncinfer.client.client import Client, InferFuture, InferResponse

__all__ = ["publish", "wait_response", "amap", "as_completed"]

T = TypeVar("T")
#: What :func:`as_completed` accepts: the futures of ``submit`` or of ``asubmit``.
AnyFuture = Union["asyncio.Future[Any]", "concurrent.futures.Future[Any]"]


async def publish(client: Client, send: Callable[[], T]) -> T:
    """Run ``send`` (one or more ``client.submit`` calls) in the loop's default executor.

    If the awaiting task is cancelled while ``send`` runs, ``send`` still completes, and every
    future it returned is then cancelled (so its request is revoked).
    """
    loop = asyncio.get_running_loop()
    client.watcher  # noqa: B018 - start the watcher here, not in racing executor threads
    sending = loop.run_in_executor(None, send)
    try:
        return await asyncio.shield(sending)
    except asyncio.CancelledError:
        sending.add_done_callback(_cancel_sent)
        raise


def _cancel_sent(sending: asyncio.Future[Any]) -> None:
    if sending.cancelled() or sending.exception() is not None:
        return
    sent = sending.result()
    for future in sent if isinstance(sent, list) else [sent]:
        future.cancel()


async def wait_response(future: asyncio.Future[InferResponse], timeout_s: float | None,
                        request_id: str) -> InferResponse:
    """Await ``future``; TimeoutError (naming the request) after ``timeout_s``.

    A timeout leaves the request running, as ``future.result(timeout)`` does; cancelling the
    awaiting task cancels ``future`` and so revokes the request.
    """
    if timeout_s is None:
        return await future
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s)
    except asyncio.TimeoutError:
        raise RequestTimeout(f"request {request_id}: no response within {timeout_s} s") from None
    except asyncio.CancelledError:
        future.cancel()
        raise


async def amap(client: Client, model: str, inputs: Iterable[Any], timeout_s: float | None,
               options: dict[str, Any]) -> AsyncIterator[InferResponse]:
    """Send every request (one executor call), then yield the responses in input order."""
    sent: list[InferFuture] = await publish(
        client, lambda: [client.submit(model, one, **options) for one in inputs])
    loop = asyncio.get_running_loop()
    try:
        for future in sent:
            yield await wait_response(asyncio.wrap_future(future, loop=loop), timeout_s, future.id)
    finally:
        for future in sent:
            if not future.done():
                client.watcher.unwatch(future.id)


async def as_completed(futures: Iterable[AnyFuture],
                       timeout_s: float | None) -> AsyncIterator[InferResponse]:
    """Yield each future's response as it arrives (completion order).

    A failed request raises its exception from the iteration; ``timeout_s`` bounds the whole
    iteration (TimeoutError), like ``concurrent.futures.as_completed``.
    """
    loop = asyncio.get_running_loop()
    waiting = [asyncio.wrap_future(f, loop=loop) if isinstance(f, concurrent.futures.Future) else f
               for f in futures]
    try:
        for next_done in asyncio.as_completed(waiting, timeout=timeout_s):
            yield await next_done
    except asyncio.TimeoutError:
        pending = sum(1 for f in waiting if not f.done())
        raise RequestTimeout(f"{pending} of {len(waiting)} requests still pending after "
                           f"{timeout_s} s") from None
