"""The kombu transport of the pipeline, alone: on a RabbitMQ broker, or with
``ASYNCINFER_CONSUMER=celery`` on Redis, Celery's own consumer receives a device worker's
``infer.*`` messages and hands each to the one pipeline (worker/pipeline.py), as the fast
consumer hands over what it takes.

What differs from the fast consumer (fast_consumer.py) is only the transport's part:

- **take**: Celery's consumer receives each message (kombu, bounded by its prefetch window:
  ``ASYNCINFER_CONCURRENCY`` × ``ASYNCINFER_PREFETCH_MULTIPLIER``) and hands it over
  (worker/celery_consumer.py) instead of to Celery's request and pool, those of one turn
  of kombu's event loop (one take) together, as the fast consumer hands over a take; its envelope
  is written as the Redis lists hold it (:func:`~asyncinfer.wire.messages.envelope_text`), so every
  rule reads it the same way;
- **acknowledge**: once the result writer stored a batch's results, each message is acknowledged
  through kombu, a retry published first (output/kombu_acks.py);
- **give back**: what is held at a stop or when the device wedges is left unacknowledged: the
  broker gives it back when the connection closes (RabbitMQ), or the project's kombu transport
  restores it (Redis), marked ``redelivered``;
- a held message waiting for its ``eta`` widens the prefetch window by one while it waits, as
  Celery's consumer does for its ETA tasks;
- leases and death counts on Redis only: the project's kombu channel takes, leases and reads
  each redelivered request's deaths with the fast consumer's script (broker/atomic_take.py), and
  this pipeline marks each batch on the device in that channel's leases, so a request that kills
  its workers is isolated and failed as on the fast consumer; on RabbitMQ redelivery is the
  broker's, and deaths are not counted;
- a lost connection: on RabbitMQ what it delivered goes back to the broker's other consumers,
  so what has not started here is given up (it would run twice after the path heals); on Redis
  it stays leased here and is acknowledged on the next connection.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery import Celery

from asyncinfer.broker.connections import redis_client
from asyncinfer.broker.urls import is_redis_url
from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.hooks import ignore_launch
from asyncinfer.policy.policy import Policy
from asyncinfer.worker.consumers.consumer import STOP_GRACE_S, PipelineConsumer
from asyncinfer.worker.runtime import WorkerRuntime

if TYPE_CHECKING:
    from asyncinfer.tracing.spans import Tracing

__all__ = ["KombuIntake"]

log = logging.getLogger(__name__)


class KombuIntake(PipelineConsumer):
    """The pipeline of what Celery's consumer of ``app`` receives for it."""

    def __init__(self, app: Celery, runtime: WorkerRuntime, *, hostname: str, policy: Policy,
                 send_events: bool = False, tracing: Tracing | None = None) -> None:
        settings = settings_of(app) or Settings.from_env()
        broker_url = str(app.conf.broker_url)
        on_redis = is_redis_url(broker_url)
        # Dead letters go to the broker's Redis; with a broker that is not Redis, to the results'.
        results = redis_client(broker_url if on_redis else str(app.conf.result_backend), settings,
                               health_check_interval=30, single_connection_client=True)
        #: Whether an acknowledgement belongs to the channel that delivered (not Redis).
        self._channel_bound = not on_redis
        super().__init__(app, runtime, hostname=hostname, policy=policy, send_events=send_events,
                         tracing=tracing,
                         results=[results], shared=None if on_redis else True)
        # On Redis the channel that took a message leases it (broker/atomic_take.py): a batch
        # on the device is marked in those leases, so a death counts against its requests
        self.use_device(self._give_back_all,
                        on_launch=self._on_launch if on_redis and settings.lease_s
                        and policy.deaths.max_deaths > 0 else ignore_launch)
        log.info("the pipeline serves what Celery's consumer receives on the infer queues")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Take no more; wait up to ``grace_s`` for what is in flight; what is left stays
        unacknowledged, for the broker to give back."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._drain(grace_s)
        self._let_go()

    def kombu_connection_lost(self) -> None:
        """On RabbitMQ, what the lost connection delivered is the broker's to give back (to
        other workers, as soon as it sees the connection dead): what has not started here is
        given up, so it runs once, there; what is on the device runs on (at least once)."""
        if not self._channel_bound:
            return
        given_up = self.pipeline.forget_kombu()
        if given_up:
            log.warning("the connection to the broker was lost: the %d requests it delivered "
                        "that had not started here are the broker's to give back", given_up)

    def _mark_on_device(self, items: Sequence[WorkItem], wait: bool) -> None:
        """Mark ``items`` on the device in the leases of the channel that took each."""
        by_leases: dict[int, tuple[Any, list[tuple[str, str, WorkItem]]]] = {}
        for item in items:
            d = self.holdings.find(item.request.id)
            message: Any = d.message if d is not None else None
            leases = getattr(getattr(message, "channel", None), "leases", None)
            if leases is None or not message.delivery_tag:
                continue
            by_leases.setdefault(id(leases), (leases, []))[1].append(
                (str(message.delivery_tag), item.request.id, item))
        for leases, marks in by_leases.values():
            leases.on_device(marks, wait=wait)

    def _give_back_all(self) -> None:
        """The device is wedged and the process leaves: take no more, write what is finished;
        the rest the broker gives back when the connection drops."""
        self._stopping.set()
        self.writer.close()
