"""A device worker's entry in the model catalogue (broker/catalogue.py): announced once its models are
loaded and before it takes any request, again every third of the TTL, withdrawn before it gives its
requests back on a clean stop.

The catalogue lives on the result backend's Redis (where the gateway and clients also read
results). The first announcement is made before :meth:`Announcer.start` returns, tried again until
Redis takes it: a worker whose first answer came before its entry would have the gateway answer
404 ("no worker announced it") for a model being served, and ``asyncinfer up --detach`` could not
tell when a fleet serves. A later beat that fails is logged and tried again at the next; it never
stops the worker serving. Without a Redis result backend there is no catalogue, and nothing is
announced.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis

from asyncinfer.backoff import Backoff
from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.broker.connections import bounded_client
from asyncinfer.broker.urls import is_redis_url
from asyncinfer.config.settings import Settings

__all__ = ["Announcer", "announcer_for"]

log = logging.getLogger(__name__)


class Announcer:
    """Announces ``models()`` (their metadata dicts) for ``worker`` until :meth:`stop`."""

    def __init__(self, catalogue: Catalogue, worker: str, models: Callable[[], Sequence[Mapping[str, Any]]],
                 *, device: str) -> None:
        self.catalogue = catalogue
        self.worker = worker
        self.models = models
        self.device = device
        self.interval_s = max(0.2, catalogue.ttl_s / 3)
        self._stopped = threading.Event()
        self._announced: list[str] = []
        self._thread = threading.Thread(target=self._run, name="asyncinfer-announcer", daemon=True)

    #: Between two tries of the first announcement (seconds): from the first to the last.
    first_retry_s = (0.1, 2.0)

    def start(self, unreachable_for_s: float = 5.0) -> Announcer:
        """Announce, trying again while Redis refuses it (a worker that cannot write to its
        result backend could not store an answer either), then keep announcing in a thread.
        A Redis that cannot be reached for ``unreachable_for_s`` is left to the worker's own
        connection, which ends it with an error saying so; the thread keeps trying."""
        backoff = Backoff(*self.first_retry_s)
        deadline = time.monotonic() + unreachable_for_s
        while (failure := self.beat(retry_in_s=backoff.next_s)) is not None:
            if isinstance(failure, (redis.ConnectionError, redis.TimeoutError)) \
                    and time.monotonic() >= deadline:
                break
            time.sleep(backoff.failed())
        self._thread.start()
        return self

    def beat(self, retry_in_s: float | None = None) -> redis.RedisError | None:
        """Announce once (errors logged, not raised); None once Redis took it, else its error."""
        try:
            models = self.models()
            self.catalogue.announce(self.worker, models, device=self.device, pid=os.getpid())
            self._announced = [str(m["name"]) for m in models]
            return None
        except redis.RedisError as exc:
            log.warning("model catalogue: announcement failed (%s: %s); next try in %.1f s",
                        type(exc).__name__, exc, self.interval_s if retry_in_s is None else retry_in_s)
            return exc

    def withdraw_model(self, model: str) -> None:
        """``model`` leaves this worker's entry now (an unload); ``models()`` no longer names it.

        Raises:
            redis.RedisError: the catalogue could not be written (the entry lapses within the TTL).
        """
        self._announced = [m for m in self._announced if m != model]
        self.catalogue.withdraw(self.worker, [model])

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        """Stop announcing and withdraw what was announced."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        try:
            self.catalogue.withdraw(self.worker, self._announced)
        except redis.RedisError as exc:
            log.warning("model catalogue: withdrawal failed (%s); the entry lapses in %.0f s",
                        exc, self.catalogue.ttl_s)
        self.catalogue.client.close()


def announcer_for(settings: Settings, worker: str, device: str,
                  models: Callable[[], Sequence[Mapping[str, Any]]]) -> Announcer | None:
    """A started announcer of ``models()`` for ``worker`` (none without a Redis result backend);
    returns once its models are in the catalogue."""
    backend = settings.resolved_result_backend()
    if not is_redis_url(backend):
        log.info("model catalogue: the result backend is not Redis; nothing is announced")
        return None
    catalogue = Catalogue(bounded_client(backend, settings), ttl_s=settings.catalogue_ttl_s,
                          retention_s=settings.model_retention_s)
    return Announcer(catalogue, worker, models, device=device).start(
        unreachable_for_s=settings.connect_timeout_s)
