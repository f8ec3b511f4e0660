"""Announcing a stored final result on the request's reply channel (wire/reply.py), for every
path that stores results through Celery's result backend.

The fast consumer's result writer publishes on the reply channel in the transaction that stores
the result. Everything else stores through the app's result backend: Celery's tracer (the CPU
stages), its revocations, Celery's consumer's refusals, ``asyncinfer purge``. The app wraps each
Redis result backend it makes (:func:`announcing`) so that a final state stored for a request whose
context names a reply channel is then published there, read back from the key in one script call,
exactly as stored. An announcement that fails is logged at debug level: the client's look-ups of
a request it has waited on for a while are the backstop (client/result_watcher.py).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states

from asyncinfer.broker.scripts import script
from asyncinfer.wire.reply import reply_channel_of

__all__ = ["announce_stored", "announcing"]

log = logging.getLogger(__name__)

_ANNOUNCE = script("announce_result")


def announce_stored(backend: Any, request_id: str, channel: str | None) -> None:
    """Publish the stored result of ``request_id`` on ``channel`` (nothing when None)."""
    if channel is None:
        return
    try:
        key = backend.get_key_for_task(request_id)
        backend.client.eval(_ANNOUNCE, 1, key, channel)
    except Exception as exc:  # noqa: BLE001 - the client's look-up is the backstop
        log.debug("request %s: announcing its result on %s failed (%s)", request_id, channel, exc)


def announcing(backend: Any) -> Any:
    """``backend`` (a Celery result backend), announcing each final state it stores for a request
    whose context names a reply channel. Backends other than Redis are returned unchanged."""
    if not hasattr(backend, "client") or not hasattr(backend, "_store_result"):
        return backend
    store = backend._store_result

    def _store_result(task_id: str, result: Any, state: str, traceback: Any = None,
                      request: Any = None, **kwargs: Any) -> Any:
        stored = store(task_id, result, state, traceback, request=request, **kwargs)
        if request is not None and state in states.READY_STATES:
            announce_stored(backend, task_id, reply_channel_of(request))
        return stored

    backend._store_result = _store_result
    return backend
