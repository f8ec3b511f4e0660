"""One thread per client that learns of finished requests through Redis pub/sub.

Celery's Redis backend stores a result with SET and publishes the same payload on a channel named
after the key. The watcher subscribes to the channel of every request a client waits on, then
reads the key once (a result stored before the subscription is not missed), and wakes when either
arrives. It blocks in ``select`` on the pub/sub socket and a wake-up pipe: no polling loop.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from celery import states

from asyncinfer.keys import WATCHER_CHANNEL
from asyncinfer.wire.result_json import decode_result

__all__ = ["ResultWatcher"]

log = logging.getLogger(__name__)

#: How a JSON-stored STARTED state begins (Celery's meta: ``{"status": "STARTED", ...``).
_STARTED = b'"STARTED"'

#: Called with the decoded result meta (``status``, ``result``, ...) once the request is done.
Callback = Callable[[dict[str, Any]], None]


class ResultWatcher:
    """Delivers each watched request's final result meta to its callback, once."""

    #: How long the rest of a message that has begun to arrive may take (seconds).
    read_timeout_s = 30.0

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._client: redis.Redis = backend.client
        self._callbacks: dict[str, list[Callback]] = {}
        self._new: list[str] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="asyncinfer-results", daemon=True)
        self._thread.start()

    def key(self, request_id: str) -> str:
        """The result key (and pub/sub channel) of a request."""
        key = self.backend.get_key_for_task(request_id)
        return key.decode() if isinstance(key, bytes) else str(key)

    def watch(self, request_id: str, callback: Callback) -> None:
        """Call ``callback(meta)`` once ``request_id`` is ready (at once if it already is).
        Several callbacks may wait on one request (the same ID submitted twice, say)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("result watcher is closed")
            self._callbacks.setdefault(request_id, []).append(callback)
            self._new.append(request_id)
        os.write(self._wake_w, b"x")

    def unwatch(self, request_id: str) -> None:
        """Stop watching ``request_id`` (its callbacks will not be called)."""
        with self._lock:
            self._callbacks.pop(request_id, None)

    def close(self) -> None:
        """Stop the thread and close the pub/sub connection."""
        with self._lock:
            self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- watcher thread ------------------------------------------------------------------------

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._closed:
            pubsub = self._client.pubsub()
            try:
                self._serve(pubsub)
                backoff_s = 0.1
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if self._closed:
                    break
                if isinstance(exc, redis.TimeoutError) and self._answers():
                    # A read that timed out on a server that answers: the connection was slow
                    # (a loaded client or server), not lost. Nothing to warn about; a new
                    # connection resubscribes and reads every watched key again.
                    log.debug("result watcher: a pub/sub read timed out (%s); resubscribing", exc)
                else:
                    log.warning("result watcher lost Redis (%s); reconnecting in %.1f s", exc,
                                backoff_s)
                    time.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, 5.0)
                with self._lock:  # resubscribe everything still waited on
                    self._new = list(self._callbacks)
            finally:
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001
                    pass

    def _answers(self) -> bool:
        """Whether Redis answers a PING now (so a timeout was not a lost connection)."""
        try:
            return bool(self._client.ping())
        except (redis.RedisError, OSError):
            return False

    def _serve(self, pubsub: Any) -> None:
        pubsub.subscribe(WATCHER_CHANNEL)  # opens the connection
        while not self._closed:
            finished = self._subscribe_new(pubsub)
            # Read while anything is buffered or readable (subscribe replies are messages too),
            # so the select below never sleeps on data already read. Once a message has begun to
            # arrive, the rest of it may take a while (a large result): read it with a real
            # timeout, not the zero one that only asks whether something is there.
            while pubsub.connection.can_read(timeout=0):
                message = pubsub.get_message(timeout=self.read_timeout_s)
                if message is None:
                    break
                if message.get("type") == "message" and self._deliver_payload(message["data"]):
                    finished.append(message["channel"])
            if finished:
                pubsub.unsubscribe(*finished)
            sock = pubsub.connection._sock
            readable, _, _ = select.select([sock, self._wake_r], [], [], 1.0)
            if self._wake_r in readable:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass

    def _subscribe_new(self, pubsub: Any) -> list[Any]:
        """Subscribe to the new requests' channels; return the keys already finished."""
        with self._lock:
            ids, self._new = self._new, []
        if not ids:
            return []
        keys = [self.key(i) for i in ids]
        pubsub.subscribe(*keys)
        return [key for key, payload in zip(keys, self._client.mget(keys), strict=True)
                if payload is not None and self._deliver_payload(payload)]

    def _deliver_payload(self, payload: Any) -> bool:
        """Hand a stored result to its callback; True when the request is finished."""
        if isinstance(payload, bytes) and _STARTED in payload[:32]:
            return False  # the STARTED state (task_track_started): not worth decoding
        meta = decode_result(self.backend, payload)
        if meta.get("status") not in states.READY_STATES:
            return False
        request_id = meta.get("task_id")
        with self._lock:
            callbacks = self._callbacks.pop(request_id, None) or []
        for callback in callbacks:
            try:
                callback(meta)
            except Exception:  # noqa: BLE001 - a callback's error must not stop the watcher
                log.exception("callback for request %s raised", request_id)
        return True
