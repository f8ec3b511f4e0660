"""gRPC ``ModelStreamInfer``: Triton's bidirectional stream, for decoupled models.

Each request on the stream is sent as ModelInfer sends it (same checks, priority, ID, expiry;
the stream's deadline is each request's); its answers come back as ``ModelStreamInferResponse``
messages as they are made (gateway/streaming.py), the requests of one stream interleaved, each
response with its request's ``id``:

- a decoupled model: one response per part, in order, each with the parameter
  ``triton_final_response: false``; after the last part, when the request asked for it with
  ``triton_enable_empty_final_response: true`` (tritonclient's ``enable_empty_final_response``),
  an empty response with ``triton_final_response: true`` — as Triton does (it sends no empty
  final response unless asked);
- a model that does not stream: its one response, with ``triton_final_response: true``;
- an error (bad request, unknown model, queue full, the model failed, ...): a response whose
  ``error_message`` names the request, and whose ``infer_response`` holds the request's ``id``,
  model and ``triton_final_response: true``; the stream goes on with its other requests;
- a request whose worker died mid-stream (it goes back to its queue, and its stream resumes with
  the next new part when a worker takes it again): a response whose ``error_message`` says so,
  with ``triton_final_response: false``; more parts follow.

A client that cancels the call (``stop_stream(cancel_requests=True)``), disconnects or whose
deadline passes revokes every request of the stream still running. A client that closes its side
(no more requests) gets the rest of its requests' responses, then the call ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.grpc_messages import infer_call, infer_response
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.proto import inference_pb2 as pb
from asyncinfer.gateway.service import Service, off_loop_if_large
from asyncinfer.gateway.streaming import Interrupted, stream
from asyncinfer.wire import triton_words

__all__ = ["stream_infer_handler", "FINAL_PARAMETER", "EMPTY_FINAL_PARAMETER"]

log = logging.getLogger(__name__)

#: The response parameter that marks a request's last response (Triton's).
FINAL_PARAMETER = "triton_final_response"
#: The request parameter that asks for an empty last response (Triton's).
EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"

#: A request's task has ended (or the client has sent its last request).
_DONE = object()

Put = Callable[[Any], None]


def stream_infer_handler(service: Service) -> grpc.RpcMethodHandler:
    """The ``ModelStreamInfer`` method handler for ``service``."""

    async def model_stream_infer(requests: AsyncIterator[pb.ModelInferRequest],
                                 context: grpc.aio.ServicerContext) -> None:
        await _serve(service, requests, context)

    return grpc.stream_stream_rpc_method_handler(
        model_stream_infer, request_deserializer=pb.ModelInferRequest.FromString,
        response_serializer=pb.ModelStreamInferResponse.SerializeToString)


async def _serve(service: Service, requests: AsyncIterator[pb.ModelInferRequest],
                 context: grpc.aio.ServicerContext) -> None:
    """Answer every request of one stream; its responses are written here, one at a time."""
    timeout_s = context.time_remaining()
    out: asyncio.Queue[Any] = asyncio.Queue()
    tasks: set[asyncio.Task[None]] = set()
    running = 1  # the reader of the requests, and each request's task

    def ended(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        out.put_nowait(_DONE)

    async def read() -> None:
        nonlocal running
        try:
            async for request in requests:
                running += 1
                task = asyncio.create_task(_answer(service, request, timeout_s, out.put_nowait))
                tasks.add(task)
                task.add_done_callback(ended)
        finally:
            out.put_nowait(_DONE)

    reader = asyncio.create_task(read())
    try:
        while running:
            item = await out.get()
            if item is _DONE:
                running -= 1
            else:
                await context.write(item)
    finally:
        # the call ended: cancelled by the client, disconnected, past its deadline (each request
        # still running is revoked when its task is cancelled) or done
        reader.cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(reader, *tasks, return_exceptions=True)


async def _answer(service: Service, request: pb.ModelInferRequest, timeout_s: float | None,
                  put: Put) -> None:
    """Every response of one request of the stream, through ``put``."""
    try:
        call = await off_loop_if_large(request.ByteSize(), infer_call, request, timeout_s)
        empty_final = call.parameters.get(EMPTY_FINAL_PARAMETER) is True
        async with contextlib.aclosing(stream(service, call)) as events:
            async for event in events:
                if isinstance(event, Interrupted):
                    put(_error(request, event.message, final=False))
                    continue
                response = infer_response(event.result)
                response.parameters[FINAL_PARAMETER].bool_param = event.whole
                put(pb.ModelStreamInferResponse(infer_response=response))
                if event.whole:
                    return
        if empty_final:
            put(pb.ModelStreamInferResponse(infer_response=_ids(request, final=True)))
    except GatewayError as exc:
        put(_error(request, exc.message))
    except InvalidRequest as exc:
        put(_error(request, str(exc)))
    except Exception as exc:  # noqa: BLE001 - a bug is told to the caller, not a silent end
        log.exception("gRPC ModelStreamInfer: %s failed", call_label(request.id))
        put(_error(request, f"{type(exc).__name__}: {exc}"))


def _ids(request: pb.ModelInferRequest, *, final: bool) -> pb.ModelInferResponse:
    """An empty response of ``request``: its ``id`` and model, and the final flag."""
    response = pb.ModelInferResponse(model_name=request.model_name,
                                     model_version=request.model_version, id=request.id)
    response.parameters[FINAL_PARAMETER].bool_param = final
    return response


def _error(request: pb.ModelInferRequest, message: str, *, final: bool = True
           ) -> pb.ModelStreamInferResponse:
    """An error response that names its request (its ``id``, or the one it was given): before
    the message, or after it when the message starts with Triton's words (which stay first)."""
    label = call_label(request.id)
    if label not in message if request.id else "request " not in message:
        message = f"{message} ({label})" if triton_words.leads(message) else f"{label}: {message}"
    return pb.ModelStreamInferResponse(error_message=message,
                                       infer_response=_ids(request, final=final))
