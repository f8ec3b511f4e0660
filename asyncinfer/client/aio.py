"""asyncio forms of the client's calls: ``ainfer``, ``asubmit``, ``amap``, ``as_completed``.

Nothing here polls. A request's :class:`~asyncinfer.client.responses.InferFuture` is settled by the client's
result watcher thread; ``asyncio.wrap_future`` hands that to the event loop through
``call_soon_threadsafe``. Nothing blocks the loop: a small request on a plain Redis broker is
published by the loop itself, on a ``redis.asyncio`` connection of its own (:func:`send_on_loop`:
no thread hop), in the loop's next group — every request the loop's coroutines sent while the
last group's round trip was out goes in one pipeline (client/loop_publisher.py); everything else
(a large tensor to encode, a Sentinel broker, replica waits, another broker, an unknown-model
check that must read the catalogue) runs in the loop's default executor, so a broker that is slow
to answer (or down, until ``ASYNCINFER_CONNECT_TIMEOUT_S``) never blocks the loop. Either way
``asubmit`` returns once the request is on its queue, and raises what refused it (``QueueFull``,
say).

The functions take the client's :class:`~asyncinfer.client.sender.Sender` (``client.sender``), the
core that the blocking :class:`~asyncinfer.client.client.Client` stands on too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any, TypeVar, Union

from asyncinfer.client.outgoing import Outgoing
from asyncinfer.client.responses import InferFuture, InferResponse
from asyncinfer.client.sender import Sender
from asyncinfer.client.submit_span import end_with_error, end_with_future, start_submit_span
from asyncinfer.errors import RequestTimeout

__all__ = ["publish", "submit", "send_on_loop", "wait_response", "amap", "as_completed"]

T = TypeVar("T")
#: What :func:`as_completed` accepts: the futures of ``submit`` or of ``asubmit``.
AnyFuture = Union["asyncio.Future[Any]", "concurrent.futures.Future[Any]"]


async def publish(sender: Sender, send: Callable[[], T]) -> T:
    """Run ``send`` (one or more ``sender.submit`` calls) in the loop's default executor.

    If the awaiting task is cancelled while ``send`` runs, ``send`` still completes, and every
    future it returned is then cancelled (so its request is revoked).
    """
    loop = asyncio.get_running_loop()
    sender.watcher  # noqa: B018 - start the watcher here, not in racing executor threads
    sending = loop.run_in_executor(None, send)
    try:
        return await asyncio.shield(sending)
    except asyncio.CancelledError:
        sending.add_done_callback(_cancel_sent)
        raise


#: A request whose tensors hold more than this (bytes) is encoded in the executor, not on the loop.
ON_LOOP_BYTES = 256 * 1024


async def submit(sender: Sender, model: str, inputs: Any, options: dict[str, Any]) -> InferFuture:
    """``sender.submit(model, inputs, **options)`` (what :meth:`Client.submit` does) from the
    running loop, without blocking it: on the loop itself (:func:`send_on_loop`) when the inputs
    are small and the unknown-model check needs no catalogue read, else in the executor."""
    if nbytes(inputs) > ON_LOOP_BYTES or not sender.knows_now(model):
        if sender.tracing is not None and options.get("trace") is None:  # the executor has none
            options = {**options, "trace": sender.tracing.current_fields()}
        return await publish(sender, lambda: sender.submit(model, inputs, **options).sent())
    return await send_on_loop(sender, sender.submission(model, inputs, **options))


def nbytes(inputs: Any) -> int:
    """How many bytes ``inputs`` (as :meth:`Client.submit` takes them) hold; a large number when
    that is not known without walking them (nested lists)."""
    if isinstance(inputs, (bytes, bytearray, memoryview, str)):
        return len(inputs)
    if hasattr(inputs, "nbytes"):
        return int(inputs.nbytes)
    if isinstance(inputs, Mapping):
        return sum(nbytes(v) for v in inputs.values())
    if isinstance(inputs, list) and all(isinstance(i, Mapping) and "data" in i for i in inputs):
        return sum(nbytes(i["data"]) for i in inputs)  # v2 input payloads
    return ON_LOOP_BYTES + 1


async def send_on_loop(sender: Sender, outgoing: Outgoing) -> InferFuture:
    """Send ``outgoing`` from the running loop and return its future once the request is on its
    queue (raising what refused it): published by the loop itself, in its next group, where it
    can (:class:`~asyncinfer.client.loop_publisher.LoopPublishers`), else by
    :meth:`Sender.send_watched` in the executor. The request is watched before it is published.
    If the awaiting task is cancelled while the push is under way (it may reach Redis), the
    request is revoked."""
    publisher = sender.loop_publishers.for_running_loop()
    if publisher is None:
        if sender.tracing is not None and outgoing.trace is None:  # the executor has no context
            outgoing.trace = sender.tracing.current_fields()
        return await publish(sender, lambda: sender.send_watched(outgoing).sent())
    span = None if sender.tracing is None else start_submit_span(sender.tracing, outgoing)
    try:
        sender.deadline_clock(outgoing)  # once a process, and only for a request with expires
        message = outgoing.message(sender.watcher.channel, sender.settings.max_payload_bytes)
        future = sender.watched(outgoing)
    except BaseException as exc:
        if span is not None:
            end_with_error(sender.tracing, span, exc)
        raise
    if span is not None:
        end_with_future(sender.tracing, span, future)
    try:
        status = await publisher.publish(message=message, **sender.publish_options(outgoing))
    except asyncio.CancelledError:
        sender.watcher.unwatch(outgoing.request_id, future._settle)
        asyncio.get_running_loop().run_in_executor(None, future.cancel)  # a revoke: a broadcast
        raise
    except BaseException as exc:
        sender.watcher.unwatch(outgoing.request_id, future._settle)
        if span is not None and not future.done():  # its span ends with it
            future.set_exception(exc)
        raise
    sender.sent(outgoing, status)
    return future


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


async def amap(sender: Sender, model: str, inputs: Iterable[Any], timeout_s: float | None,
               options: dict[str, Any]) -> AsyncIterator[InferResponse]:
    """Send every request (one executor call: they go out in groups), then yield the responses
    in input order; a request refused (``QueueFull``, say) raises its error at its turn."""
    sent: list[InferFuture] = await publish(
        sender, lambda: [sender.submit(model, one, **options) for one in inputs])
    loop = asyncio.get_running_loop()
    try:
        for future in sent:
            yield await wait_response(asyncio.wrap_future(future, loop=loop), timeout_s, future.id)
    finally:
        for future in sent:
            if not future.done():
                sender.watcher.unwatch(future.id, future._settle)


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
