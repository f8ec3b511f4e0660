"""A streaming call, whichever front it came through (gRPC ModelStreamInfer, HTTP generate_stream).

A call for a decoupled model (the catalogue's ``decoupled``) is sent as any call is
(:meth:`Service.submit`: same checks, priority, ID and expiry), and its parts are read from the
request's stream (wire/stream.py) with the client's own reader (``Client.aread_stream``) as the
worker appends them: each part is a :class:`Part` (an :class:`InferResult`: the request's ID when
the caller gave one, the part's outputs), in order, each once. When the request's worker dies mid-stream the
reader says so and goes on when another worker takes the request again (no part is shown twice):
that becomes an :class:`Interrupted` event, which the fronts tell their callers. A call for a
model that does not stream is answered as ``infer`` answers it, as one part.

The stream ends after the last part; the request's error (the model failed, it was revoked or
expired, the queue was full) is raised as the :class:`GatewayError` it maps to. A caller that
goes away (its task cancelled, or the iterator closed early) revokes the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery.exceptions import TaskRevokedError

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.client.responses import InferFuture
from asyncinfer.client.stream_progress import Interruption
from asyncinfer.gateway.call_errors import revoked_error
from asyncinfer.gateway.classification import classify_outputs, wants_classes
from asyncinfer.gateway.model_config import is_decoupled
from asyncinfer.gateway.service import Service
from asyncinfer.gateway.shared_memory_tensors import refuse_streamed_outputs
from asyncinfer.gateway.tensors import InferCall, InferResult, output_tensor

__all__ = ["Part", "Interrupted", "StreamEvent", "stream"]

#: Seconds the reader is given to show the parts and end of a request whose answer is already
#: stored (its ``final`` entry is written before the result, so it is normally there at once).
READER_GRACE_S = 2.0


@dataclass(frozen=True)
class Interrupted:
    """The request's run ended without its end (its worker died or froze); the request is back
    on its queue and its stream goes on, from its next new part, when a worker takes it again."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Part:
    """One part of the answer (``whole``: the one answer of a model that does not stream)."""

    result: InferResult
    whole: bool = False


StreamEvent = Part | Interrupted

_END = object()


async def stream(service: Service, call: InferCall) -> AsyncGenerator[StreamEvent, None]:
    """The events of ``call``: a :class:`Part` per part, :class:`Interrupted` when a run stops
    short. Close the iterator (``contextlib.aclosing``) when done with it early: that
    revokes the request.

    Raises:
        GatewayError: the call is refused (unknown model 404, bad input 400, queue full 429, ...)
            or the request ends with an error (model 500, expired 504, revoked 499).
    """
    entry = await service.entry(call.model, call.version)
    if not is_decoupled(entry):
        yield Part(await service.infer(call), whole=True)
        return
    refuse_streamed_outputs(call)
    with service.accounted(call):
        async with contextlib.aclosing(_parts(service, call, entry)) as parts:
            async for event in parts:
                yield event


async def _parts(service: Service, call: InferCall, entry: CatalogueEntry
                 ) -> AsyncGenerator[StreamEvent, None]:
    sent = await service.submit(call, entry)
    version = call.version or entry.versions[0]
    events: asyncio.Queue[Any] = asyncio.Queue()
    wanted = None if call.outputs is None else {o.name for o in call.outputs}

    loop = asyncio.get_running_loop()

    def on_interrupted(interruption: Interruption) -> None:
        # on the loop (the asyncio reader) or in its executor (Sentinel's blocking reader)
        event = Interrupted(sent.id, _interrupted_message(interruption))
        if _on_loop(loop):
            events.put_nowait(event)
        else:
            loop.call_soon_threadsafe(events.put_nowait, event)

    reader = asyncio.create_task(_read(service, sent, call.model, on_interrupted, events))
    answer = service.wait(sent)  # its end: a refusal (queue full, expired) before any part
    finished = False
    try:
        while True:
            event = await _next(events, answer, sent.id)
            if event is _END:
                finished = True
                return
            if isinstance(event, BaseException):
                finished = True
                raise event
            if isinstance(event, Interrupted):
                yield event
                continue
            outputs = _outputs(sent.id, event.outputs, wanted)
            if wants_classes(call):  # Triton's classification extension, part by part
                outputs = classify_outputs(call, entry, outputs)
            yield Part(InferResult(model_name=call.model, model_version=version, id=call.id,
                                   outputs=outputs))
    finally:
        reader.cancel()
        if answer.done() and not answer.cancelled():
            answer.exception()  # seen: the reader told the same end
        answer.cancel()
        if not finished:  # the caller went away, or a part could not be shown
            service.revoke(sent)


async def _read(service: Service, sent: InferFuture, model: str,
                on_interrupted: Callable[[Interruption], None],
                events: asyncio.Queue[Any]) -> None:
    """Every part of ``sent``'s stream into ``events``, then ``_END`` (or the error)."""
    try:
        async for part in service.client.aread_stream(sent.id, model=model,
                                                      on_interrupted=on_interrupted):
            events.put_nowait(part)
    except asyncio.CancelledError:
        raise
    except TaskRevokedError as exc:
        events.put_nowait(revoked_error(sent.id, exc))
    except Exception as exc:  # noqa: BLE001 - the request's error, told to the caller
        events.put_nowait(exc)
    else:
        events.put_nowait(_END)


async def _next(events: asyncio.Queue[Any], answer: asyncio.Future[Any], request_id: str) -> Any:
    """The next event. A request refused after it was handed over (queue full), or expired in its
    queue, never gets a stream: when its answer is an error and the reader has nothing more
    within ``READER_GRACE_S`` (a request that ran has its end written before its answer), that
    error is the next event."""
    getter = asyncio.ensure_future(events.get())
    try:
        if not answer.done():
            await asyncio.wait([getter, answer], return_when=asyncio.FIRST_COMPLETED)
        if not getter.done() and _failed(answer):
            await asyncio.wait([getter], timeout=READER_GRACE_S)
            if not getter.done():
                error = answer.exception()
                return (revoked_error(request_id, error) if isinstance(error, TaskRevokedError)
                        else error)
        return await getter
    finally:
        if not getter.done():
            getter.cancel()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _failed(answer: asyncio.Future[Any]) -> bool:
    return answer.done() and not answer.cancelled() and answer.exception() is not None


def _outputs(request_id: str, outputs: Mapping[str, Mapping[str, Any]],
             wanted: set[str] | None) -> list[Any]:
    return [output_tensor(request_id, {**tensor, "name": name}) for name, tensor in outputs.items()
            if wanted is None or name in wanted]


def _interrupted_message(interruption: Interruption) -> str:
    worker = f"its worker {interruption.worker}" if interruption.worker else "its worker"
    return (f"request {interruption.request_id}: interrupted after part {interruption.after_part}: "
            f"{worker} stopped mid-stream ({interruption.reason}); the request goes back to its "
            f"queue and its stream resumes with the next part")
