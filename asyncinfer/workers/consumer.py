"""Celery's consumer, answering the messages it refuses instead of dropping them silently.

A message whose content type is not accepted (pickle, say) is never deserialized; Celery logs it
and drops it. Here its request also gets a FAILURE that says why, so the producer is not left
waiting for a result that will never come.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.exceptions import ContentDisallowed

from asyncinfer.celery_wire import refused_content
from asyncinfer.errors import InvalidRequest

__all__ = ["Consumer"]

log = logging.getLogger(__name__)


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer plus a FAILURE result for every refused message that has an ID."""

    def _refuse(self, message: Any, exc: Exception) -> None:
        headers = message.headers or {}
        request_id = headers.get("id")
        if not isinstance(request_id, str) or not request_id:
            return
        if isinstance(exc, ContentDisallowed):
            error = refused_content(request_id, message.content_type)
        else:
            error = InvalidRequest(f"request {request_id}: the message breaks the task protocol "
                                   f"({type(exc).__name__}: {exc})")
        try:
            self.app.backend.store_result(request_id, error, states.FAILURE)
        except Exception:  # noqa: BLE001 - the message is dropped either way; say so
            log.exception("request %s: could not store the refusal", request_id)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._refuse(message, exc)
        super().on_decode_error(message, exc)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._refuse(message, exc)
        super().on_invalid_task(body, message, exc)
