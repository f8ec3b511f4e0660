"""The STARTED states of requests (Celery's ``task_track_started``): their stored text and its
writes, where the take (broker/take.py) does not store them itself.

The STARTED meta is the same for every request of a worker but its ID (it has no date): it is
encoded once, around a mark, and each request's ID put in its place.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import redis
from celery import states

from asyncinfer.broker.store import QUIET, StoreScript
from asyncinfer.broker.take import StartedText
from asyncinfer.constants import TASK_NAME
from asyncinfer.wire.envelope import result_meta
from asyncinfer.wire.result_json import encode_meta
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["StartedStates"]

log = logging.getLogger(__name__)

#: Where the request ID goes in the STARTED meta's text.
_MARK = "@request-id@"


class StartedStates:
    """Stores STARTED states with ``store`` (the results' script) on ``results`` (their Redis),
    expiring after ``expires_s``; ``shared``: the results live on the broker."""

    def __init__(self, backend: Any, store: StoreScript, results: redis.Redis, shared: bool,
                 expires_s: int) -> None:
        self.backend = backend
        self.store = store
        self.results = results
        self.shared = shared
        self.expires_s = expires_s
        self._started: tuple[str, str, str] | None = None
        self._for_take: StartedText | None = None

    def add(self, pipe: Any, deliveries: list[TakenMessage], hostname: str) -> None:
        """Add the STARTED states of ``deliveries`` to ``pipe``, a plain pipeline of
        :attr:`results`, as one store call."""
        prefix, suffix = self._text(hostname)
        self.store.queue(pipe, [(self.backend.get_key_for_task(d.request_id),
                                 prefix + json.dumps(d.request_id) + suffix, "", "", QUIET)
                                for d in deliveries])

    def store_now(self, deliveries: list[TakenMessage], hostname: str) -> None:
        """Store the STARTED states of ``deliveries`` now. A courtesy: the requests are safely
        recorded whatever Redis says."""
        if not deliveries:
            return
        pipe = self.results.pipeline(transaction=False)
        self.add(pipe, deliveries, hostname)
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:
            replies = [exc]
        for reply in replies:
            if isinstance(reply, redis.exceptions.NoScriptError):  # a restarted or new master
                self.store.load(self.results)
            elif isinstance(reply, Exception):
                log.warning("could not store STARTED for %d requests (%s)", len(deliveries), reply)

    def for_take(self, hostname: str) -> StartedText | None:
        """What the take stores as STARTED (take.py), when it can: the results live on the
        broker."""
        if not self.shared:
            return None
        if self._for_take is None:
            head, tail = self._text(hostname)
            key = self.backend.get_key_for_task("@")  # Celery refuses an empty ID
            self._for_take = StartedText(key[:-1], head, tail, self.expires_s, TASK_NAME)
        return self._for_take

    def _text(self, hostname: str) -> tuple[str, str]:
        """The stored STARTED meta around its request ID (the same for every request of this
        worker: the meta has no date)."""
        if self._started is None or self._started[0] != hostname:
            text = encode_meta(self.backend, result_meta(_MARK, states.STARTED, {
                "pid": os.getpid(), "hostname": hostname}))
            if isinstance(text, bytes):
                text = text.decode()
            prefix, _, suffix = text.partition(json.dumps(_MARK))
            self._started = (hostname, prefix, suffix)
        return self._started[1], self._started[2]
