"""Celery's ``link``, ``link_error`` and chains, called as its tracer calls them, on both consumers.

Each callback is sent as a message (for a worker that serves its task), never called inside the
device worker: Celery's tracer calls some errbacks in process (registered tasks that take more
than one argument: ``celery.map``, ``celery.chunks``, ...), which would let a request make a device
worker run something other than inference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery

from asyncinfer.wire.trace_context import TRACEPARENT

__all__ = ["send_callbacks", "send_errbacks"]


def send_callbacks(app: Celery, embed: Mapping[str, Any], request_id: str, root_id: str,
                   response: Any, trace: Mapping[str, str] | None = None) -> None:
    """After a success: each ``link`` with the response, and the next task of a chain. ``trace``:
    the request's trace context (wire/trace_context.py), which the next task of a chain carries
    too when its own options give none (one trace across the chain's stages)."""
    for callback in embed.get("callbacks") or ():
        app.signature(callback).apply_async((response,), parent_id=request_id, root_id=root_id)
    chain = list(embed.get("chain") or ())
    if chain:
        after = app.signature(chain.pop())
        headers = dict(after.options.get("headers") or {})
        if trace and TRACEPARENT not in headers:
            after.options["headers"] = {**headers, **trace}
        after.apply_async((response,), chain=chain, parent_id=request_id, root_id=root_id)


def send_errbacks(app: Celery, errbacks: Iterable[Any] | None, request_id: str,
                  root_id: str) -> None:
    """After a final failure: each ``link_error``, called with the request ID."""
    for errback in errbacks or ():
        app.signature(errback).apply_async((request_id,), parent_id=request_id, root_id=root_id)
