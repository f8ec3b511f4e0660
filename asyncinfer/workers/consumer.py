"""Celery's consumer, answering messages it refuses instead of dropping them silently.

A message whose content type is not accepted (pickle, say) is never deserialized; Celery logs and
acknowledges it. Here its request also gets a FAILURE that says why, so the producer is not left
waiting for a result that will never come.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from celery.worker.consumer import Consumer as CeleryConsumer

from asyncinfer.errors import InvalidRequest

__all__ = ["Consumer"]

log = logging.getLogger(__name__)


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer plus a FAILURE result for every refused message that has an ID."""

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        headers = message.headers or {}
        request_id = headers.get("id")
        if isinstance(request_id, str) and request_id:
            error = InvalidRequest(
                f"request {request_id}: content type {message.content_type!r} is refused; "
                f"send json or msgpack ({type(exc).__name__})")
            try:
                self.app.backend.store_result(request_id, error, states.FAILURE)
            except Exception:  # noqa: BLE001 - the message is dropped either way; say so
                log.exception("request %s: could not store the refusal", request_id)
        super().on_decode_error(message, exc)
