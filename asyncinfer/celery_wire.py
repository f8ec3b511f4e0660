"""Celery's message and result formats on Redis, read and written without Celery's per-task path.

The fast consumer of a device worker speaks exactly what Celery and kombu speak, so producers,
``AsyncResult``, kombu's redelivery of unacknowledged messages and stock Celery workers all keep
working beside it:

- a message is kombu's JSON envelope ``{"body", "content-type", "content-encoding", "headers",
  "properties"}`` pushed (LPUSH) on the queue's list; the body is Celery's task protocol 2,
  ``[args, kwargs, embed]``;
- a message being worked on sits in kombu's ``unacked`` hash (delivery tag → ``[envelope,
  exchange, routing_key]``) and ``unacked_index`` sorted set (tag → time taken), from where any
  kombu Redis channel restores it to its queue once the visibility timeout has passed;
- a result is Celery's meta (``status``, ``result``, ``traceback``, ``children``, ``date_done``,
  ``task_id``) stored under ``celery-task-meta-<id>`` with SETEX and published on the same name.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import msgpack

from asyncinfer.errors import InvalidRequest

__all__ = [
    "UNACKED_KEY",
    "UNACKED_INDEX_KEY",
    "Delivery",
    "parse_envelope",
    "decode_body",
    "result_meta",
    "expired",
    "seconds_until",
    "task_message",
    "refused_content",
]

#: kombu's Redis transport bookkeeping of unacknowledged messages (its defaults).
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"

_JSON = "application/json"
_MSGPACK = ("application/x-msgpack", "application/msgpack")


@dataclass
class Delivery:
    """One message taken from a queue, until its result is stored and it is acknowledged."""

    raw: bytes
    queue: str
    received_at: float
    envelope: dict[str, Any] = field(default_factory=dict)
    tag: str = ""
    request_id: str = ""

    @property
    def headers(self) -> dict[str, Any]:
        return self.envelope.get("headers") or {}

    @property
    def unacked_entry(self) -> str:
        """What kombu keeps in its ``unacked`` hash for this message."""
        info = (self.envelope.get("properties") or {}).get("delivery_info") or {}
        return json.dumps([self.envelope, info.get("exchange", ""), info.get("routing_key", self.queue)])


def parse_envelope(delivery: Delivery) -> None:
    """Fill the envelope, delivery tag and request ID of ``delivery``; ValueError if malformed."""
    envelope = json.loads(delivery.raw)
    if not isinstance(envelope, dict) or not isinstance(envelope.get("properties"), dict):
        raise ValueError("not a kombu message envelope")
    delivery.envelope = envelope
    tag = envelope["properties"].get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        raise ValueError("message has no delivery tag")
    delivery.tag = tag
    request_id = delivery.headers.get("id")
    delivery.request_id = request_id if isinstance(request_id, str) else ""


def decode_body(delivery: Delivery) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """``(args, kwargs, embed)`` of a protocol-2 task message; InvalidRequest when refused."""
    env = delivery.envelope
    rid = delivery.request_id
    content_type = env.get("content-type")
    body: Any = env.get("body")
    if (env.get("properties") or {}).get("body_encoding") == "base64" and isinstance(body, str):
        body = base64.b64decode(body)
    try:
        if content_type == _JSON:
            decoded = json.loads(body)
        elif content_type in _MSGPACK:
            decoded = msgpack.unpackb(body if isinstance(body, bytes) else str(body).encode(),
                                      raw=False)
        else:
            raise refused_content(rid, content_type)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"request {rid}: the message body is not valid {content_type} "
                             f"({type(exc).__name__}: {exc})") from None
    if not (isinstance(decoded, list) and len(decoded) == 3):
        raise InvalidRequest(f"request {rid}: the message body must be [args, kwargs, embed] "
                             f"(Celery task protocol 2)")
    args, kwargs, embed = decoded
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise InvalidRequest(f"request {rid}: the message body must be [args, kwargs, embed] "
                             f"with a list and a mapping")
    return args, kwargs, embed if isinstance(embed, dict) else {}


def refused_content(request_id: str, content_type: object) -> InvalidRequest:
    """The error a message of a refused content type (pickle, say) gets."""
    return InvalidRequest(f"request {request_id}: content type {content_type!r} is refused: "
                          f"only json and msgpack are accepted, never pickle")


def seconds_until(expires: Any, now: datetime | None = None) -> float | None:
    """Seconds left until an ``expires`` value (ISO 8601 string or datetime); None if none."""
    if not expires:
        return None
    try:
        when = expires if isinstance(expires, datetime) else datetime.fromisoformat(str(expires))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (when - (now or datetime.now(timezone.utc))).total_seconds()


def expired(headers: dict[str, Any], now: datetime | None = None) -> bool:
    """Whether the message's ``expires`` header (ISO 8601) has passed."""
    left = seconds_until(headers.get("expires"), now)
    return left is not None and left <= 0


def result_meta(request_id: str, state: str, result: Any, *, traceback: str | None = None,
                parent_id: str | None = None) -> dict[str, Any]:
    """Celery's result meta, as ``Backend._store_result`` builds it."""
    meta: dict[str, Any] = {
        "status": state,
        "result": result,
        "traceback": traceback,
        "children": [],
        "date_done": datetime.now(timezone.utc).isoformat() if state != "STARTED" else None,
    }
    if parent_id:
        meta["parent_id"] = parent_id
    meta["task_id"] = request_id
    return meta


_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"


def task_message(task: str, request_id: str, kwargs: dict[str, Any], queue: str, *,
                 serializer: str = "json", embed: dict[str, Any] | None = None,
                 expires_s: float | None = None, kwargsrepr: str = "") -> str:
    """The kombu envelope of a Celery protocol-2 task message, ready to LPUSH on ``queue``.

    The same message ``app.send_task(task, kwargs=kwargs, task_id=request_id, queue=queue)``
    would publish, built without Celery's per-send machinery.
    """
    body_parts = [[], kwargs, {"callbacks": None, "errbacks": None, "chain": None, "chord": None,
                               **(embed or {})}]
    if serializer == "json":
        body = json.dumps(body_parts).encode()
        content_type = _JSON
    elif serializer == "msgpack":
        body = msgpack.packb(body_parts, use_bin_type=True)
        content_type = _MSGPACK[0]
    else:
        raise ValueError(f"serializer must be 'json' or 'msgpack', got {serializer!r}")
    expires = None
    if expires_s is not None:
        expires = (datetime.now(timezone.utc) + timedelta(seconds=expires_s)).isoformat()
    envelope: dict[str, Any] = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8" if serializer == "json" else "binary",
        "content-type": content_type,
        "headers": {
            "lang": "py", "task": task, "id": request_id, "shadow": None, "eta": None,
            "expires": expires, "group": None, "group_index": None, "retries": 0,
            "timelimit": [None, None], "root_id": request_id, "parent_id": None,
            "argsrepr": "()", "kwargsrepr": kwargsrepr, "origin": _ORIGIN, "ignore_result": False,
            "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
        },
        "properties": {
            "correlation_id": request_id, "reply_to": "", "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue}, "priority": 0,
            "body_encoding": "base64", "delivery_tag": str(uuid.uuid4()),
        },
    }
    return json.dumps(envelope)
