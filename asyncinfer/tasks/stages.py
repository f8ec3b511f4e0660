"""A model's CPU stages as Celery tasks of their own, for the cross-worker pipeline.

``asyncinfer.preprocess`` (on a CPU queue) → ``asyncinfer.infer`` (on the model's device queue,
forward only) → ``asyncinfer.postprocess`` (on a CPU queue), as one Celery chain:
``Client.submit_staged()`` sends it. Each stage passes the next a v2 payload, so any worker — or
any other Celery task in between — can take part. The device worker batches the prepared requests
like any others; only its forward runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from celery import Task

from asyncinfer.celery_app import app
from asyncinfer.constants import POSTPROCESS_TASK, PREPROCESS_TASK
from asyncinfer.models.base import Model
from asyncinfer.wire.protocol import (
    FORWARD_STAGE,
    decode_request,
    encode_tensor,
    request_kwargs,
    tensor_from_value,
)
from asyncinfer.wire.trace_context import TRACEPARENT, TRACESTATE, trace_fields
from asyncinfer.worker.worker import worker_of

__all__ = ["preprocess", "postprocess"]

@contextmanager
def _traced(task: Task, name: str) -> Iterator[None]:
    """The stage's span (tracing on), child of the trace context its message carries: the
    chain's one trace (client.submit_staged puts it on every stage's message). A message without
    one is not traced, as on a device worker (worker/output/trace_spans.py)."""
    tracing = worker_of(task.app).tracing
    request = task.request
    parent = None if tracing is None else trace_fields(
        {TRACEPARENT: getattr(request, TRACEPARENT, None),
         TRACESTATE: getattr(request, TRACESTATE, None)})
    if tracing is None or parent is None:
        yield
        return
    span = tracing.start(name, parent, kind="consumer",
                         attributes={"messaging.message.id": str(request.id),
                                     "asyncinfer.worker": str(request.hostname or "")})
    try:
        yield
    except BaseException as exc:
        tracing.fail(span, exc)
        raise
    finally:
        span.end()


def _cpu_model(task: Task, name: str, request_id: str) -> Model:
    """The model's instance for CPU stages in this process (loaded once, on the CPU)."""
    return worker_of(task.app).cpu_model(name, request_id)


def _encode(values: dict[str, Any], binary: bool) -> list[dict[str, Any]]:
    return [encode_tensor(tensor_from_value(name, value), binary) for name, value in values.items()]


@app.task(name=PREPROCESS_TASK, bind=True, typing=False)
def preprocess(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run the model's preprocess on one v2 request; return the prepared v2 request."""
    request_id = str(self.request.id)
    with _traced(self, PREPROCESS_TASK):
        request = decode_request(request_id, request_kwargs(request_id, args, kwargs))
        model = _cpu_model(self, request.model, request_id)
        model.validate(request)
        with torch.inference_mode():
            prepared = model.preprocess({t.name: t.value for t in request.inputs})
    return {"model": request.model, "inputs": _encode(prepared, request.binary_output),
            "parameters": {**request.parameters, "stage": FORWARD_STAGE}}


@app.task(name=POSTPROCESS_TASK, bind=True, typing=False)
def postprocess(self: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run the model's postprocess on the forward-only v2 response of ``asyncinfer.infer``."""
    request_id = str(self.request.id)
    with _traced(self, POSTPROCESS_TASK):
        response = request_kwargs(request_id, args, kwargs)
        model_name = response.get("model_name")
        forward = decode_request(request_id, {"model": model_name,
                                              "inputs": response.get("outputs")})
        model = _cpu_model(self, forward.model, request_id)
        with torch.inference_mode():
            outputs = model.postprocess({t.name: t.value for t in forward.inputs})
    parameters = dict(response.get("parameters") or {})
    parameters["stages"] = [PREPROCESS_TASK, "asyncinfer.infer", POSTPROCESS_TASK]
    return {"model_name": forward.model, "id": request_id,
            "outputs": _encode(outputs, forward.binary_output), "parameters": parameters}
