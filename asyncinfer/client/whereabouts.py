"""Where a request that has no result is, in one phrase for a timeout's message: running (on
which worker), taken by a worker, queued (how many ahead of it), sent but neither, or unknown.
Read from the result backend, kombu's unacknowledged entries, the request's claim and its
queue's lists."""

from __future__ import annotations

import json
from typing import Any

from celery import states

from asyncinfer.client.responses import decode_stored
from asyncinfer.constants import QUEUE_PREFIX, priority_lists, queue_of_list
from asyncinfer.wire.keys import CLAIM_PREFIX, TRACES_KEY, UNACKED_KEY
from asyncinfer.wire.request_identity import queue_of

__all__ = ["whereabouts"]


def whereabouts(request_id: str, results: Any, backend: Any, broker: Any | None) -> str:
    """Where a request that has no result is: running (on which worker), taken by a worker,
    queued, or unknown; one phrase for a timeout's message.

    ``results`` is the result backend's Redis client, ``backend`` Celery's result backend (it
    decodes the stored state), ``broker`` the Redis broker's client (None: not a Redis broker).
    """
    payload = results.get(backend.get_key_for_task(request_id))
    if payload is not None:
        try:
            meta = decode_stored(backend, payload)
        except Exception as exc:  # noqa: BLE001 - what a tool wrote there
            return f"its stored result cannot be read ({type(exc).__name__}: {exc})"
        status, result = meta.get("status"), meta.get("result")
        info: dict[str, Any] = result if isinstance(result, dict) else {}
        if status == states.STARTED:
            return f"it is running on worker {info.get('hostname') or '?'} (STARTED)"
        return f"its state is {status}"
    if broker is None:
        return "it has no stored state yet (queued, or unknown to the result backend)"
    needle = request_id.encode()
    for tag, entry in broker.hscan_iter(UNACKED_KEY, count=1000):
        if needle in entry and _envelope_id(entry) == request_id:
            return (f"it is taken by a worker (unacknowledged, delivery tag "
                    f"{tag.decode(errors='replace')}) and not started yet")
    claim = broker.get(CLAIM_PREFIX + request_id) or broker.hget(TRACES_KEY, request_id)
    claimed = queue_of(claim.decode(errors="replace")) if claim else ""
    queues = ([claimed] if claimed else
              sorted({queue_of_list(k.decode(errors="replace"))
                      for k in broker.scan_iter(match=QUEUE_PREFIX + "*", count=1000)}))
    for key in priority_lists(queues):
        length = int(broker.llen(key))
        for start in range(0, length, 1000):
            for offset, entry in enumerate(broker.lrange(key, start, start + 999)):
                if needle in entry and _envelope_id(entry) == request_id:
                    ahead = length - 1 - (start + offset)  # consumers pop from the tail
                    return f"it is queued on {queue_of_list(key)} ({ahead} requests ahead of it)"
    if claimed:
        return (f"it was sent to {claimed} but is neither queued, taken "
                f"nor stored (in transit, or its result expired)")
    return "no request with this ID is known (no result, claim, queue entry or unacked entry)"


def _envelope_id(entry: bytes) -> str | None:
    """The task ID in kombu's message (a queue entry) or ``[message, exchange, key]`` (unacked)."""
    try:
        doc = json.loads(entry)
    except ValueError:
        return None
    message = doc[0] if isinstance(doc, list) and doc else doc
    headers = message.get("headers") if isinstance(message, dict) else None
    return headers.get("id") if isinstance(headers, dict) else None
