"""``asyncinfer purge MODEL``: remove the requests waiting on a model's queue, answering each.

The queue and its priority lists are read and deleted in one transaction (a worker taking at that
moment takes either before or after it, never half). Every removed request is stored as REVOKED
(reason "purged"), so a producer waiting for it gets ``TaskRevokedError`` instead of silence; a
message that names no request ID is removed all the same.
"""

from __future__ import annotations

import json
from typing import Any

from celery.app.task import Context

from asyncinfer.constants import priority_lists, queue_for
from asyncinfer.wire.envelope import request_id_in
from asyncinfer.wire.keys import TRACES_KEY
from asyncinfer.wire.reply import REPLY_TO, reply_channel_of

__all__ = ["waiting", "purge_queue"]


def _lists(model: str) -> list[str]:
    return priority_lists([queue_for(model)])


def waiting(broker: Any, model: str) -> int:
    """How many requests wait on ``infer.MODEL`` (all priorities); ``broker`` a Redis client."""
    return sum(int(broker.llen(key)) for key in _lists(model))


def purge_queue(broker: Any, backend: Any, model: str) -> int:
    """Remove what waits on ``infer.MODEL``; store REVOKED for each request (in ``backend``, a
    Celery result backend); how many were removed."""
    pipe = broker.pipeline(transaction=True)
    for key in _lists(model):
        pipe.lrange(key, 0, -1)
    for key in _lists(model):
        pipe.delete(key)
    replies = pipe.execute()
    raws = [raw for reply in replies[:len(_lists(model))] for raw in reply]
    purged = []
    for raw in raws:
        request_id, reply_to = _request_of(raw)
        if request_id:  # its reply channel, if it names one, hears of it too (broker/result_announcements.py)
            backend.mark_as_revoked(request_id, reason="purged",
                                    request=Context({REPLY_TO: reply_to}) if reply_to else None)
            purged.append(request_id)
    for start in range(0, len(purged), 1000):  # their REVOKED says they existed: traces go
        broker.hdel(TRACES_KEY, *purged[start:start + 1000])
    return len(raws)


def _request_of(raw: bytes) -> tuple[str, str | None]:
    """The request ID and reply channel a removed message names ("" and None when it does not)."""
    try:
        headers = json.loads(raw).get("headers") or {}
        request_id = headers.get("id")
        if isinstance(request_id, str):
            return request_id, reply_channel_of(headers)
        return request_id_in(raw), None
    except Exception:  # noqa: BLE001 - a malformed message: search its text
        try:
            return request_id_in(raw), None
        except Exception:  # noqa: BLE001
            return "", None
