"""Dead letters: requests that failed for good, kept for a human to look at and send again.

A model opts in through ``ASYNCINFER_MODEL_OPTIONS`` (``{"mlp": {"dead_letter": true}}``, or
``"*"`` for every model). Then every request of it that ends in FAILURE — out of retries, retry
budget spent, time limit, the model raised, bad input — is also kept in the Redis list
``asyncinfer:dead:<model>`` on the broker, newest first: its message (kombu's envelope, as it was
taken), the reason (exception type and message), the attempts (retries + 1), the worker and the
time. Bad input is kept too: a malformed or refused request needs a human as much as a poison one
(SQS and Triton users expect it there), and an ``UnknownModel`` or a payload over the limit may run
once the configuration is fixed. REVOKED requests (cancelled, expired) are not kept: nothing failed.

The list holds at most ``dead_letter_max_entries`` (LTRIM) and expires ``dead_letter_ttl_s``
after its newest entry (EXPIRE on every push). The result writer adds the entry in the broker
transaction that writes the FAILURE — and acknowledges the message, on the Redis lists — when
results live on the broker's Redis, the default (:func:`add_failure`, called by
worker/output/result_writer.py for a final FAILURE). With a broker that is not Redis (RabbitMQ)
the list is on the result backend's Redis.

This module is the worker's write side: the entry and how it is pushed. The operator's side (list,
show, requeue, purge: ``asyncinfer dead``) reads the same entries in ops/dead.py.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import Celery

from asyncinfer.config.bound import settings_of
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.constants import model_from_queue, queue_of_list
from asyncinfer.wire.envelope import ACCEPTED_TYPES
from asyncinfer.wire.keys import dead_letter_key
from asyncinfer.worker.requests.taken import TakenMessage

if TYPE_CHECKING:
    from asyncinfer.config.settings import Settings

__all__ = ["DeadLetter", "entry_for", "push", "add_failure", "options_of"]

log = logging.getLogger(__name__)

#: How much of a malformed message's text is kept.
RAW_MAX_CHARS = 4096

@dataclass(frozen=True)
class DeadLetter:
    """One request that failed for good, as kept in ``asyncinfer:dead:<model>``."""

    request_id: str
    model: str
    #: The Redis list the message was taken from (``infer.<model>``, or one of its priority lists).
    queue: str
    #: The exception's type name and its message.
    reason_type: str
    reason: str
    #: How many times it ran (retries + 1).
    attempts: int
    worker: str
    #: When it failed: ISO 8601, UTC.
    failed_at: str
    #: kombu's envelope as it was taken; None when the message was no envelope (then ``raw`` holds
    #: the start of its text). Its body is None when its content type is refused (pickle).
    envelope: dict[str, Any] | None
    raw: str = ""

    def to_json(self) -> str:
        """The entry as stored."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> DeadLetter:
        """An entry as stored (ValueError when it is not one)."""
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("a dead-letter entry is a JSON object")
        return cls(**doc)

    @property
    def requeueable(self) -> str:
        """Why the entry cannot run again as it was, or "" when it can."""
        if not isinstance(self.envelope, dict) or not isinstance(self.envelope.get("properties"), dict):
            return "its message was not a kombu envelope"
        if self.envelope.get("content-type") not in ACCEPTED_TYPES or self.envelope.get("body") is None:
            return f"its content type {self.envelope.get('content-type')!r} is refused"
        return ""


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def _kept_envelope(envelope: dict[str, Any]) -> dict[str, Any]:
    """``envelope`` without the body of a refused content type: never keep what no worker decodes."""
    if envelope.get("content-type") not in ACCEPTED_TYPES:
        return {**envelope, "body": None}
    return envelope


def entry_for(request_id: str, queue: str, exc: BaseException | Any, *, raw: bytes | str,
              retries: int, worker: str, model: str | None = None) -> DeadLetter:
    """The entry of a request that failed with ``exc``, from the message text ``raw``."""
    text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else str(raw)
    envelope: dict[str, Any] | None
    try:
        doc = json.loads(text)
        envelope = _kept_envelope(doc) if isinstance(doc, dict) else None
    except ValueError:
        envelope = None
    return DeadLetter(
        request_id=request_id, model=model or model_from_queue(queue_of_list(queue)) or queue,
        queue=queue, reason_type=type(exc).__name__ if isinstance(exc, BaseException) else "Unknown",
        reason=str(exc), attempts=max(0, int(retries or 0)) + 1, worker=worker,
        failed_at=_now_iso(), envelope=envelope, raw="" if envelope is not None else text[:RAW_MAX_CHARS])


def push(pipe: Any, entry: DeadLetter, options: ModelOptions) -> None:
    """Add ``entry`` to its model's list in ``pipe`` (a pipeline or client of the broker): LPUSH,
    LTRIM to ``dead_letter_max_entries``, EXPIRE ``dead_letter_ttl_s``."""
    key = dead_letter_key(entry.model)
    pipe.lpush(key, entry.to_json())
    pipe.ltrim(key, 0, options.dead_letter_max_entries - 1)
    if options.dead_letter_ttl_s > 0:
        pipe.expire(key, max(1, int(options.dead_letter_ttl_s)))
    else:
        pipe.persist(key)


@functools.lru_cache(maxsize=256)
def _options(settings: Settings, model: str) -> ModelOptions:
    return settings.options_for(model, ModelOptions())


def options_of(app: Celery, model: str) -> ModelOptions:
    """The options of ``model`` under the app's settings (``ASYNCINFER_MODEL_OPTIONS``; a model's
    own defaults never opt it in)."""
    settings = settings_of(app)
    if settings is None:
        return ModelOptions()
    try:
        return _options(settings, model)
    except TypeError:  # settings that cannot be hashed: read them each time
        return settings.options_for(model, ModelOptions())  # type: ignore[no-any-return]


# -- the worker's side ------------------------------------------------------------------------------

def add_failure(pipe: Any, app: Celery, delivery: TakenMessage, exc: BaseException | Any, *,
                worker: str) -> None:
    """Add the dead letter of ``delivery``, which failed for good with ``exc`` on ``worker``, to
    ``pipe`` (the broker's write of that FAILURE) when its model opted in. Never raises: a dead
    letter must not cost a result."""
    try:
        d = delivery
        model = d.model
        if not d.request_id or model is None:
            return
        options = options_of(app, model)
        if not options.dead_letter:
            return
        entry = entry_for(d.request_id, d.list_key, exc, raw=d.raw,
                          retries=_int(d.headers.get("retries")), worker=worker, model=model)
        push(pipe, entry, options)
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("request %s: its dead letter could not be kept",
                      getattr(delivery, "request_id", "?"))


def _int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
