"""Celery's task messages, written: a new request's (what ``send_task`` would publish, without
Celery's per-send machinery), a retry's (as ``Task.retry`` sends it), a restored one's (as kombu
puts an unacknowledged message back), and one kombu delivered as the Redis lists hold it. Reading
them is :mod:`asyncinfer.wire.envelope`'s."""

from __future__ import annotations

import base64
import json
import math
import os
import socket
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import msgpack
import orjson

from asyncinfer.wire import json_text
from asyncinfer.wire.clock import now_s, now_utc
from asyncinfer.wire.envelope import JSON_TYPE, MSGPACK_TYPES, Message, payload_too_large
from asyncinfer.wire.reply import REPLY_TO

__all__ = ["task_message", "retry_message", "restored_message", "envelope_text", "uuid4_text",
           "SENT_AT"]

#: A task body's embed with no callbacks, errbacks, chain or chord, as JSON text.
_NO_EMBED = b'{"callbacks":null,"errbacks":null,"chain":null,"chord":null}'
_ORIGIN = f"{os.getpid()}@{socket.gethostname()}"
#: The message property holding when a request was sent (epoch seconds), where our producers set it.
SENT_AT = "asyncinfer_sent_at"


def task_message(task: str, request_id: str, kwargs: dict[str, Any], queue: str, *,
                 serializer: str = "json", embed: dict[str, Any] | None = None,
                 expires_s: float | None = None, kwargsrepr: str = "",
                 max_body_bytes: int | None = None,
                 time_limit_s: float | None = None, soft_time_limit_s: float | None = None,
                 priority: int = 0, reply_to: str | None = None,
                 trace: Mapping[str, str] | None = None) -> str:
    """The kombu envelope of a Celery protocol-2 task message, ready to LPUSH on ``queue``.

    The same message ``app.send_task(task, kwargs=kwargs, task_id=request_id, queue=queue)``
    would publish, built without Celery's per-send machinery (``time_limit_s`` and
    ``soft_time_limit_s`` are ``apply_async``'s ``time_limit`` and ``soft_time_limit``;
    ``reply_to`` is the request's reply channel, wire/reply.py; ``trace``: the W3C trace context
    fields to carry as headers, wire/trace_context.py).
    InvalidRequest when its body (as it lies in the envelope) is longer than ``max_body_bytes``.
    """
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None, **(embed or {})}
    if serializer == "json":
        # [args, kwargs, embed], the parts written apart: an embed of nothing but nulls is
        # always the same text, and kwargs (the tensors) rarely hold a null
        body = b"[[]," + json_text.dumps(kwargs) + b"," + (
            _NO_EMBED if not any(embed.values()) else json.dumps(embed).encode()) + b"]"
        content_type = JSON_TYPE
    elif serializer == "msgpack":
        body = msgpack.packb([[], kwargs, embed], use_bin_type=True)
        content_type = MSGPACK_TYPES[0]
    else:
        raise ValueError(f"serializer must be 'json' or 'msgpack', got {serializer!r}")
    encoded_body = base64.b64encode(body).decode()
    if max_body_bytes is not None and len(encoded_body) > max_body_bytes:
        raise payload_too_large(request_id, len(encoded_body), max_body_bytes)
    expires = None
    if expires_s is not None:
        expires = (now_utc() + timedelta(seconds=expires_s)).isoformat()
    envelope: dict[str, Any] = {
        "body": encoded_body,
        "content-encoding": "utf-8" if serializer == "json" else "binary",
        "content-type": content_type,
        "headers": {
            "lang": "py", "task": task, "id": request_id, "shadow": None, "eta": None,
            "expires": expires, "group": None, "group_index": None, "retries": 0,
            "timelimit": [time_limit_s, soft_time_limit_s], "root_id": request_id, "parent_id": None,
            "argsrepr": "()", "kwargsrepr": kwargsrepr, "origin": _ORIGIN, "ignore_result": False,
            "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {},
            **({REPLY_TO: reply_to} if reply_to else {}),
            **(trace or {}),
        },
        "properties": {
            "correlation_id": request_id, "reply_to": "", "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue}, "priority": priority,
            "body_encoding": "base64", "delivery_tag": uuid4_text(),
            # when it was sent (epoch seconds): the gateway's oldest-request-age gauge reads it
            SENT_AT: round(now_s(), 3),
        },
    }
    if all(v is None or (type(v) in (int, float) and math.isfinite(v))
           for v in (time_limit_s, soft_time_limit_s)):
        try:  # its only numbers are finite: orjson's text means what the stdlib's would
            return orjson.dumps(envelope).decode()
        except TypeError:
            pass
    return json.dumps(envelope)


class _RandomBytes:
    """``os.urandom`` read 4 KiB at a time and handed out 16 bytes at a time (one system call
    per 256 IDs: each one releases the GIL, and on a busy host the caller then waits to take it
    back). Thread-safe; a forked child starts with a fresh pool, never its parent's bytes."""

    POOL_BYTES = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool = b""
        self._at = 0
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._at = b"", 0

    def take16(self) -> bytes:
        with self._lock:
            at = self._at
            if at + 16 > len(self._pool):
                self._pool, at = os.urandom(self.POOL_BYTES), 0
            self._at = at + 16
            return self._pool[at:at + 16]


_random = _RandomBytes()


def uuid4_text() -> str:
    """``str(uuid.uuid4())`` in a fraction of its time: 16 random bytes (``os.urandom``'s, read
    in pools), the version and variant bits set as RFC 4122 says."""
    raw = bytearray(_random.take16())
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def retry_message(delivery: Message, countdown_s: float, now: datetime | None = None) -> str:
    """The message that retries ``delivery`` in ``countdown_s`` seconds, as ``Task.retry`` sends
    it: the same body, ``retries`` one more, an ``eta``, a new delivery tag."""
    envelope = json.loads(delivery.raw)  # a fresh copy of the envelope
    headers = envelope.setdefault("headers", {})
    headers["retries"] = int(headers.get("retries") or 0) + 1
    headers["eta"] = ((now or now_utc()) + timedelta(seconds=countdown_s)).isoformat()
    headers.pop("redelivered", None)
    properties = envelope["properties"]
    properties["delivery_tag"] = uuid4_text()
    (properties.get("delivery_info") or {}).pop("redelivered", None)
    return json.dumps(envelope)


def restored_message(delivery: Message) -> str:
    """``delivery`` as kombu puts an unacknowledged message back on its queue (``redelivered``)."""
    envelope = json.loads(delivery.raw)
    envelope.setdefault("headers", {})["redelivered"] = True
    info = envelope["properties"].setdefault("delivery_info", {})
    info["redelivered"] = True
    return json.dumps(envelope)


def envelope_text(message: Any) -> str:
    """kombu's envelope of ``message`` (a kombu message, of any transport) as the Redis lists hold
    it, so that every rule reads it alike: its body (base64), content type and encoding, headers,
    and properties with where it came from; ``redelivered`` in the headers when the broker says
    so; a delivery tag of its own when the transport's is no text (AMQP's are numbers)."""
    body = message.body
    if isinstance(body, str):
        body = body.encode(message.content_encoding or "utf-8")
    info = message.delivery_info or {}
    headers = dict(message.headers or {})
    if info.get("redelivered"):
        headers["redelivered"] = True
    properties = {k: v for k, v in (message.properties or {}).items()
                  if k not in ("delivery_info", "application_headers")}
    tag = properties.get("delivery_tag")
    properties.update(body_encoding="base64",
                      delivery_tag=tag if isinstance(tag, str) and tag else uuid4_text(),
                      delivery_info={"exchange": info.get("exchange") or "",
                                     "routing_key": info.get("routing_key") or ""})
    return json.dumps({"body": base64.b64encode(body or b"").decode(),
                       "content-encoding": message.content_encoding or "utf-8",
                       "content-type": message.content_type or "",
                       "headers": headers, "properties": properties}, default=str)
