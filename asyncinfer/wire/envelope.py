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
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from typing import Any

import msgpack

from asyncinfer.constants import model_from_queue
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire import json_text
from asyncinfer.wire.clock import now_utc
from asyncinfer.wire.reply import REPLY_TO, reply_rule_broken

__all__ = [
    "Message",
    "JSON_TYPE",
    "MSGPACK_TYPES",
    "ACCEPTED_TYPES",
    "parse_envelope",
    "decode_body",
    "protocol2_body",
    "result_meta",
    "expired",
    "seconds_until",
    "priority_in",
    "refused_content",
    "payload_too_large",
    "undecodable_body",
    "request_id_in",
    "malformed_error",
    "MALFORMED_DROPPED",
    "tag_in",
    "valid_request_id",
    "check_request_id",
    "printable",
    "MAX_REQUEST_ID_CHARS",
]


#: The content types of a task body a worker reads: JSON, and msgpack (by either name).
JSON_TYPE = "application/json"
MSGPACK_TYPES = ("application/x-msgpack", "application/msgpack")
#: Every content type a worker reads, and the only ones the project sends (never pickle).
ACCEPTED_TYPES = (JSON_TYPE, *MSGPACK_TYPES)


@dataclass
class Message:
    """A message as taken from a queue: its text and what :func:`parse_envelope` reads of it (the
    worker's bookkeeping of a taken message is its own:
    :class:`~asyncinfer.worker.requests.taken.TakenMessage`)."""

    raw: bytes
    queue: str
    envelope: dict[str, Any] = field(default_factory=dict)
    tag: str = ""
    request_id: str = ""
    #: The Redis list it came from: the queue's, or one of its priority lists.
    key: str = ""
    #: The bytes of its body that the take left out, over the largest body kept (0: none left
    #: out): refused for its size by :func:`decode_body`.
    body_cut_bytes: int = 0

    @cached_property
    def model(self) -> str | None:
        """The model its queue serves (``infer.<model>``), read once; None on a queue of none."""
        return model_from_queue(self.queue)

    @property
    def list_key(self) -> str:
        """Where the message goes back to (a retry, a restore): the list it came from."""
        return self.key or self.queue

    @property
    def headers(self) -> dict[str, Any]:
        headers = self.envelope.get("headers")
        return headers if isinstance(headers, dict) else {}

    @property
    def unacked_entry(self) -> str:
        """What kombu keeps in its ``unacked`` hash for this message, as the take writes it: its
        text as taken, then its exchange and routing key."""
        info = (self.envelope.get("properties") or {}).get("delivery_info") or {}
        exchange, routing_key = info.get("exchange", ""), info.get("routing_key", self.queue)
        text = self.raw.decode() if isinstance(self.raw, bytes) else str(self.raw)
        return f"[{text}, {json.dumps(exchange)}, {json.dumps(routing_key)}]"


def parse_envelope(delivery: Message, loads: Callable[[Any], Any] = json_text.loads) -> None:
    """Fill the envelope, delivery tag and request ID of ``delivery``; ValueError if malformed.
    ``loads`` reads the JSON text (kombu's own reader, in the project's kombu channel).

    Any other exception (RecursionError of a deeply nested text, MemoryError, ...) may escape
    too: the caller treats every exception as "malformed".
    """
    envelope = loads(delivery.raw)
    if not isinstance(envelope, dict) or not isinstance(envelope.get("properties"), dict):
        raise ValueError("not a kombu message envelope (an object with properties)")
    headers = envelope.get("headers")
    if headers is not None and not isinstance(headers, dict):
        raise ValueError(f"message headers must be an object, not {type(headers).__name__}")
    delivery.envelope = envelope
    tag = envelope["properties"].get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        raise ValueError("message has no delivery tag")
    delivery.tag = tag
    request_id = delivery.headers.get("id")
    delivery.request_id = request_id if isinstance(request_id, str) else ""
    if delivery.request_id and not valid_request_id(delivery.request_id):
        raise ValueError(f"request ID {printable(delivery.request_id)} breaks the rule: 1 to "
                         f"{MAX_REQUEST_ID_CHARS} printable characters, no whitespace")
    _check_headers(delivery.headers)


def _check_headers(headers: dict[str, Any]) -> None:
    """ValueError naming the first header of the wrong type (those the worker acts on)."""
    for name in ("task", "eta", "expires", "parent_id", "root_id"):
        if headers.get(name) is not None and not isinstance(headers[name], str):
            raise ValueError(f"header {name!r} must be a string, not {type(headers[name]).__name__}")
    retries = headers.get("retries")
    if retries is not None and (type(retries) is not int or retries < 0):
        raise ValueError(f"header 'retries' must be a whole number >= 0, not {printable(retries)}")
    limits = headers.get("timelimit")
    if limits is not None and not (
            isinstance(limits, list) and len(limits) == 2
            and all(v is None or (type(v) in (int, float) and v >= 0) for v in limits)):
        raise ValueError(f"header 'timelimit' must be [hard seconds or null, soft seconds or null], "
                         f"not {printable(limits)}")
    broken = reply_rule_broken(headers.get(REPLY_TO))
    if broken:
        raise ValueError(broken)


#: Longest request ID accepted (a UUID has 36 characters).
MAX_REQUEST_ID_CHARS = 200

def valid_request_id(request_id: str) -> bool:
    """Whether ``request_id`` is 1 to 200 printable characters without whitespace or controls."""
    return (0 < len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isprintable()
            and " " not in request_id)


def check_request_id(request_id: str, shown_chars: int = 200) -> None:
    """Raise InvalidRequest, showing at most ``shown_chars`` of it, unless ``request_id`` is valid."""
    if not valid_request_id(request_id):
        raise InvalidRequest(f"request {printable(request_id, shown_chars)}: a request ID must be 1 "
                             f"to {MAX_REQUEST_ID_CHARS} printable characters without whitespace")


def printable(text: object, limit: int = 200) -> str:
    """``text`` as it may appear in a log line: control characters and line breaks escaped (so
    no request can forge a line), cut to ``limit`` characters."""
    whole = str(text)
    if whole.isprintable() and len(whole) <= limit:
        return whole
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in whole[:limit])
    return shown + ("..." if len(whole) > limit else "")


def decode_body(delivery: Message, max_body_bytes: int | None = None
                ) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """``(args, kwargs, embed)`` of a protocol-2 task message; InvalidRequest when refused.

    A body longer than ``max_body_bytes`` (as it lies in the envelope, or as the take found it
    before it left it out: ``body_cut_bytes``) is refused undecoded.
    """
    env = delivery.envelope
    rid = delivery.request_id
    content_type = env.get("content-type")
    body: Any = env.get("body")
    size = delivery.body_cut_bytes or (len(body) if isinstance(body, (str, bytes)) else 0)
    if max_body_bytes is not None and size > max_body_bytes:
        raise payload_too_large(rid, size, max_body_bytes)
    try:
        if (env.get("properties") or {}).get("body_encoding") == "base64" and isinstance(body, str):
            try:
                body = base64.b64decode(body)
            except ValueError as exc:
                raise InvalidRequest(f"request {rid}: the message body is not valid base64 (its "
                                     f"body_encoding): {exc}") from None
        if content_type == JSON_TYPE:
            decoded = json_text.loads(body)
        elif content_type in MSGPACK_TYPES:
            decoded = msgpack.unpackb(body if isinstance(body, bytes) else str(body).encode(),
                                      raw=False)
        else:
            raise refused_content(rid, content_type)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise undecodable_body(rid, content_type, exc) from None
    return protocol2_body(rid, decoded)


def protocol2_body(request_id: str, decoded: Any) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """``(args, kwargs, embed)`` of a decoded task protocol-2 body; InvalidRequest when it is not
    ``[args, kwargs, embed]`` with a list and a mapping."""
    if not (isinstance(decoded, (list, tuple)) and len(decoded) == 3):
        raise InvalidRequest(f"request {request_id}: the message body must be [args, kwargs, embed] "
                             f"(Celery task protocol 2)")
    args, kwargs, embed = decoded
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise InvalidRequest(f"request {request_id}: the message body must be [args, kwargs, embed] "
                             f"with a list and a mapping")
    return list(args), kwargs, embed if isinstance(embed, dict) else {}


def undecodable_body(request_id: str, content_type: object, exc: BaseException) -> InvalidRequest:
    """The error a message body that does not decode as its content type gets (``exc``: what the
    decoder raised)."""
    return InvalidRequest(f"request {request_id}: the message body is not valid {content_type} "
                          f"({type(exc).__name__}: {printable(exc)})")


def payload_too_large(request_id: str, size_bytes: int, limit_bytes: int, *,
                      at_least: bool = False) -> InvalidRequest:
    """The error a request larger than the configured limit gets (at submit or in the worker);
    ``at_least``: ``size_bytes`` is the least its body could be (the client's estimate before
    encoding)."""
    size = f"at least {size_bytes}" if at_least else str(size_bytes)
    return InvalidRequest(f"request {request_id}: message body of {size} bytes is over the "
                          f"limit of {limit_bytes} bytes (ASYNCINFER_MAX_PAYLOAD_BYTES)")


#: A request ID in the text of a message that is not valid JSON (a truncated envelope, say).
_ID_IN_TEXT = re.compile(rb'"(?:id|correlation_id)"\s*:\s*"([A-Za-z0-9][A-Za-z0-9._:@-]{0,199})"')


#: A delivery tag in the text of a message, as the take script finds it (kombu's envelope).
_TAG_IN_TEXT = re.compile(rb'"delivery_tag"\s*:\s*"([^"\\]+)"')


def tag_in(raw: bytes | str) -> str:
    """The delivery tag the text of a (possibly malformed) message names, or ""."""
    text = raw.encode() if isinstance(raw, str) else bytes(raw)
    match = _TAG_IN_TEXT.search(text)
    return match.group(1).decode(errors="replace") if match else ""


def request_id_in(raw: bytes | str) -> str:
    """The request ID that the text of a malformed message names, or "" when none is found."""
    text = raw.encode() if isinstance(raw, str) else bytes(raw)
    match = _ID_IN_TEXT.search(text)
    return match.group(1).decode() if match else ""


#: The log line of a malformed message that names no request: queue, error type, error, text.
MALFORMED_DROPPED = "dropped a malformed message on %s (%s: %s): %s"


def malformed_error(delivery: Message, exc: BaseException) -> InvalidRequest | None:
    """What every consumer answers a message that is no valid kombu envelope with (``exc`` says
    which rule it broke): an InvalidRequest naming the request ID its text holds (then set on
    ``delivery``), or None when its text names none (it is logged, with :data:`MALFORMED_DROPPED`,
    and dropped). A malformed message is never redelivered."""
    try:
        request_id = delivery.request_id or request_id_in(delivery.raw)
    except Exception:  # noqa: BLE001 - not even its text can be searched
        request_id = ""
    if not request_id:
        return None
    delivery.request_id = request_id
    if isinstance(exc, InvalidRequest):
        return exc
    return InvalidRequest(f"request {request_id}: the message on {delivery.queue} is malformed and "
                          f"was dropped ({type(exc).__name__}: {printable(exc)})")


def refused_content(request_id: str, content_type: object) -> InvalidRequest:
    """The error a message of a refused content type (pickle, say) gets."""
    return InvalidRequest(f"request {request_id}: content type {content_type!r} is refused: "
                          f"only json and msgpack are accepted, never pickle")


def priority_in(info: Any) -> int:
    """The Celery priority (0-9; on Redis 0 is served first) in a message's ``properties`` (or
    Celery's ``delivery_info``, which copies it); 0 when none or not a number in range."""
    value = info.get("priority") if isinstance(info, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return 0
    return max(0, min(9, int(value)))


def seconds_until(expires: Any, now: datetime | None = None) -> float | None:
    """Seconds left until an ``expires`` value (ISO 8601 string or datetime), on the broker's
    clock (wire/clock.py) unless ``now`` is given; None if none."""
    if not expires:
        return None
    try:
        when = expires if isinstance(expires, datetime) else datetime.fromisoformat(str(expires))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (when - (now or now_utc())).total_seconds()


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
