"""Celery's consumer, answering the messages it refuses instead of dropping them silently.

A message whose content type is not accepted (pickle, say) is never deserialized; Celery logs it
and drops it. Here its request also gets a FAILURE that says why, so the producer is not left
waiting for a result that will never come. A message body over ``ASYNCINFER_MAX_PAYLOAD_BYTES``
is refused the same way, before anything decodes it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.exceptions import ContentDisallowed

from asyncinfer.celery_wire import payload_too_large, refused_content
from asyncinfer.constants import model_from_queue
from asyncinfer.errors import InvalidRequest
from asyncinfer.workers.events import FAILED_FORMAT

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
        elif isinstance(exc, InvalidRequest):
            error = exc
        else:
            error = InvalidRequest(f"request {request_id}: the message breaks the task protocol "
                                   f"({type(exc).__name__}: {exc})")
        try:
            self.app.backend.store_result(request_id, error, states.FAILURE)
        except Exception:  # noqa: BLE001 - the message is dropped either way; say so
            log.exception("request %s: could not store the refusal", request_id)

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)
        settings = getattr(self.app, "asyncinfer_settings", None)
        limit = int(settings.max_payload_bytes) if settings is not None else 0
        if not limit:
            return handle

        def on_task_received(message: Any) -> Any:
            body = message.body
            size = len(body) if isinstance(body, (bytes, str)) else 0
            if size > limit:
                request_id = (message.headers or {}).get("id") or "?"
                error = payload_too_large(str(request_id), size, limit)
                queue = (message.delivery_info or {}).get("routing_key") or ""
                log.warning(FAILED_FORMAT, request_id, model_from_queue(queue) or queue,
                            self.hostname, type(error).__name__, error)
                self._refuse(message, error)
                message.ack()
                return None
            return handle(message)

        return on_task_received

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._refuse(message, exc)
        super().on_decode_error(message, exc)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._refuse(message, exc)
        super().on_invalid_task(body, message, exc)
