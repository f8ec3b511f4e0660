"""The acknowledgement of a message kombu delivered (Celery's consumer received it), once the
result writer stored its batch: its retry published first — to the exchange and routing key it
came by, as ``Task.retry`` sends it — then ``message.ack()``, from the writer's thread, as Celery's
thread pool acknowledges from its threads. A retry that cannot be published leaves its message
unacknowledged (the broker gives it back: at least once). The Redis lists' messages are
acknowledged by the store script instead (store.py)."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Sequence
from typing import Any

from celery import Celery

from asyncinfer.wire.envelope import ACCEPTED_TYPES
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["acknowledge", "publish_envelope"]

log = logging.getLogger(__name__)


def acknowledge(app: Celery, done: list[tuple[TakenMessage, str | None]]) -> None:
    """Acknowledge each message of ``done`` (a delivery and its retry message, if retried),
    each retry published first."""
    retries = [(d, retry) for d, retry in done if retry is not None]
    unpublished = _publish(app, retries) if retries else set()
    for d, _ in done:
        message = d.message
        if message is None or id(d) in unpublished or message.acknowledged:
            continue
        try:
            message.ack()
        except Exception as exc:  # noqa: BLE001 - a lost connection: the broker gives it back
            log.warning("request %s: could not acknowledge it (%s: %s); it is redelivered",
                        d.request_id or "?", type(exc).__name__, exc)


def _publish(app: Celery, retries: Sequence[tuple[TakenMessage, str | None]]) -> set[int]:
    """Publish each retry message; the ids of the deliveries whose retry could not be."""
    unpublished: set[int] = set()
    with app.producer_or_acquire() as producer:
        for d, retry in retries:
            try:
                publish_envelope(producer, json.loads(retry or "{}"), d.queue)
            except Exception:  # noqa: BLE001 - this one stays unacknowledged
                log.exception("request %s: its retry could not be published; it is redelivered",
                              d.request_id or "?")
                unpublished.add(id(d))
    return unpublished


def publish_envelope(producer: Any, envelope: dict[str, Any], queue: str) -> None:
    """Publish a kombu envelope as the Redis lists hold it (wire/messages.py) through ``producer``,
    its body as it is (no second serialisation), to the exchange and routing key it names, else
    to ``queue``. A body of any content type but json's or msgpack's (pickle, say) is never sent:
    ValueError naming the request."""
    content_type = envelope.get("content-type")
    if content_type not in ACCEPTED_TYPES:
        request_id = (envelope.get("headers") or {}).get("id")
        raise ValueError(f"request {request_id}: content type {content_type!r} is never sent "
                         f"(only {', '.join(ACCEPTED_TYPES)})")
    properties = envelope.get("properties") or {}
    info = properties.get("delivery_info") or {}
    producer.publish(base64.b64decode(envelope["body"]), exchange=info.get("exchange") or "",
                     routing_key=info.get("routing_key") or queue,
                     headers=envelope.get("headers") or {},
                     content_type=content_type,
                     content_encoding=envelope.get("content-encoding"),
                     correlation_id=properties.get("correlation_id"),
                     reply_to=properties.get("reply_to") or None,
                     priority=properties.get("priority"), delivery_mode=2, retry=True)
