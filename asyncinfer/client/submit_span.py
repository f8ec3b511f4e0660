"""The client's span of a request: ``asyncinfer.submit``, from the call to its answer.

With tracing on (``ASYNCINFER_TRACING``), each request the client sends gets a PRODUCER span,
child of the trace context the request already carries (the gateway's span, a caller's
``traceparent``) or else of the calling code's current span; the message carries this span's
context (``traceparent``, ``tracestate`` in its headers), so every span the worker records is its
child. It ends when the request's future does (its answer, or what refused it): the span covers
the wait for the result, and a failure marks it failed. With tracing off nothing here runs.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from asyncinfer.client.outgoing import Outgoing

__all__ = ["start_submit_span", "start_span_for", "end_with_future", "end_with_error",
           "SUBMIT_SPAN"]

SUBMIT_SPAN = "asyncinfer.submit"


def start_submit_span(tracing: Any, outgoing: Outgoing) -> Any:
    """Start ``outgoing``'s span and put its context in the message (``outgoing.trace``)."""
    span = start_span_for(tracing, outgoing.request_id, outgoing.queue, outgoing.task,
                          str(outgoing.kwargs.get("model", "")), outgoing.trace)
    outgoing.trace = tracing.fields_of(span)
    return span


def start_span_for(tracing: Any, request_id: str, queue: str, task: str, model: str,
                   parent: dict[str, str] | None = None) -> Any:
    """Start the ``asyncinfer.submit`` span of request ``request_id`` (of ``task`` on
    ``queue``), child of ``parent`` (trace context fields) or else of the current span."""
    return tracing.start(SUBMIT_SPAN, parent, kind="producer", current_parent=True,
                         attributes={"messaging.system": "celery",
                                     "messaging.destination.name": queue,
                                     "messaging.message.id": request_id,
                                     "asyncinfer.task": task, "asyncinfer.model": model})


def end_with_future(tracing: Any, span: Any, future: Future[Any]) -> None:
    """End ``span`` when ``future`` is done, failed if it failed (or was cancelled)."""

    def done(f: Future[Any]) -> None:
        if f.cancelled():
            tracing.fail(span, "cancelled")
        else:
            error = f.exception()
            if error is not None:
                tracing.fail(span, error)
        span.end()

    future.add_done_callback(done)


def end_with_error(tracing: Any, span: Any, error: BaseException) -> None:
    """End ``span`` of a request that was never sent."""
    tracing.fail(span, error)
    span.end()
