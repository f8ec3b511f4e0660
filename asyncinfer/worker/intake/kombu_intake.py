"""The kombu transport of the pipeline: the messages Celery's own consumer receives on a device
worker's ``infer.*`` queues — a RabbitMQ broker, or ``ASYNCINFER_CONSUMER=celery`` on Redis — go
through the one pipeline (worker/pipeline.py), as the fast consumer's do.

What differs from the fast consumer (fast_consumer.py) is only the transport's part:

- **take**: Celery's consumer receives each message (kombu, bounded by its prefetch window:
  ``ASYNCINFER_CONCURRENCY`` × ``ASYNCINFER_PREFETCH_MULTIPLIER``) and hands it here
  (worker/intake/celery_consumer.py) instead of to Celery's request and pool; its envelope is
  written as the Redis lists hold it (:func:`envelope_text`), so every rule reads it the same way;
- **acknowledge**: once the result writer stored a batch's results, each message is acknowledged
  through kombu (``message.ack``, from the writer's thread, as Celery's thread pool acknowledges
  from its threads); a retry is published to the message's exchange and routing key first;
- **give back**: what is held at a stop or when the device wedges is left unacknowledged: the
  broker gives it back when the connection closes (RabbitMQ), or the project's kombu transport
  restores it (Redis), marked ``redelivered``;
- a held message waiting for its ``eta`` widens the prefetch window by one while it waits, as
  Celery's consumer does for its ETA tasks;
- no leases or death counts (the fast consumer's Redis scripts): kombu's redelivery is the broker's.

The prefork pool keeps Celery's stock request path (tasks/infer.py, stock_path.py): there the
model runs in the pool's children, each owning its device, and no pipeline lives in the process
that receives the messages.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery

from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.connections import is_redis_url, redis_client
from asyncinfer.policy.policy import Policy
from asyncinfer.wire.messages import uuid4_text
from asyncinfer.worker.intake.consumer import PipelineConsumer
from asyncinfer.worker.intake.taken import TakenMessage
from asyncinfer.worker.output.result_writer import Outcome
from asyncinfer.worker.runtime import WorkerRuntime

__all__ = ["KombuIntake", "KombuMessage", "envelope_text"]

log = logging.getLogger(__name__)


@dataclass
class KombuMessage(TakenMessage):
    """A message Celery's consumer received, with kombu's message for its acknowledgement."""

    message: Any = None


def envelope_text(message: Any) -> str:
    """kombu's envelope of ``message`` as the Redis lists hold it (what every rule of the
    pipeline reads): its body (base64), content type and encoding, headers, and properties with
    where it came from; ``redelivered`` in the headers when the broker says so."""
    body = message.body
    if isinstance(body, str):
        body = body.encode(message.content_encoding or "utf-8")
    info = message.delivery_info or {}
    headers = dict(message.headers or {})
    if info.get("redelivered") or getattr(message, "redelivered", False):
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


class KombuIntake(PipelineConsumer):
    """The pipeline of the ``infer.*`` messages Celery's consumer of ``app`` receives."""

    def __init__(self, app: Celery, runtime: WorkerRuntime, *, hostname: str, policy: Policy,
                 send_events: bool = False, qos: Any = None) -> None:
        settings = settings_of(app) or Settings.from_env()
        broker_url = str(app.conf.broker_url)
        on_redis = is_redis_url(broker_url)
        # Dead letters go to the broker's Redis; with a broker that is not Redis, to the results'.
        results = redis_client(broker_url if on_redis else str(app.conf.result_backend), settings,
                               health_check_interval=30, single_connection_client=True)
        #: ``qos()``: Celery's consumer's prefetch window now (a new one after a reconnection).
        self._qos = qos
        super().__init__(app, runtime, hostname=hostname, policy=policy, send_events=send_events,
                         results=results, acknowledge=self._acknowledge,
                         shared=None if on_redis else True, on_scheduled=self._on_scheduled)
        self.use_device(self._give_back_all)

    def start(self) -> KombuIntake:
        log.info("the pipeline serves what Celery's consumer receives on the infer queues")
        return self

    def took(self, message: Any) -> None:
        """(Celery's consumer, for each message of an ``infer.*`` queue.)"""
        if self._stopping.is_set():  # left unacknowledged: the broker gives it back
            return
        info = message.delivery_info or {}
        queue = str(info.get("routing_key") or "")
        try:
            raw = envelope_text(message)
        except Exception as exc:  # noqa: BLE001 - no envelope can be written: its text only
            raw = f"message of {queue}: {type(exc).__name__}: {exc}"
        self.pipeline.received([KombuMessage(raw=raw.encode(), queue=queue,
                                              received_at=time.perf_counter(), message=message)])
        self.pipeline.first_attempts.send(due_only=True)

    def stop(self, grace_s: float = 30.0) -> None:
        """Take no more; wait up to ``grace_s`` for what is in flight; what is left stays
        unacknowledged, for the broker to give back."""
        self._stopping.set()
        left = self.holdings.drain(grace_s)
        self._close_output()
        if left:
            log.warning("%d requests still in flight at shutdown go back to their queues", left)

    def _give_back_all(self) -> None:
        """The device is wedged and the process leaves: take no more, write what is finished;
        the rest the broker gives back when the connection drops."""
        self._stopping.set()
        self.writer.close()

    # -- the transport's part of the write --------------------------------------------------------

    def _acknowledge(self, batch: list[Outcome]) -> None:
        """(The writer's thread, once ``batch`` is stored.) Publish its retries, then acknowledge
        each of its messages; a retry that cannot be published leaves its message
        unacknowledged (the broker gives it back: at least once)."""
        retries = [o for o in batch if o.retry is not None]
        failed: set[int] = set()
        if retries:
            failed = self._publish_retries(retries)
        for outcome in batch:
            message = getattr(outcome.delivery, "message", None)
            if message is None or id(outcome) in failed or message.acknowledged:
                continue
            try:
                message.ack()
            except Exception as exc:  # noqa: BLE001 - a lost connection: the broker gives it back
                log.warning("request %s: could not acknowledge it (%s: %s); it is redelivered",
                            outcome.delivery.request_id or "?", type(exc).__name__, exc)

    def _publish_retries(self, retries: list[Outcome]) -> set[int]:
        failed: set[int] = set()
        with self.app.producer_or_acquire() as producer:
            for outcome in retries:
                envelope = json.loads(outcome.retry or "{}")
                properties = envelope.get("properties") or {}
                info = properties.get("delivery_info") or {}
                try:
                    producer.publish(
                        base64.b64decode(envelope["body"]), exchange=info.get("exchange") or "",
                        routing_key=info.get("routing_key") or outcome.delivery.queue,
                        headers=envelope.get("headers") or {},
                        content_type=envelope.get("content-type"),
                        content_encoding=envelope.get("content-encoding"),
                        correlation_id=properties.get("correlation_id"),
                        reply_to=properties.get("reply_to") or None,
                        priority=properties.get("priority"), delivery_mode=2, retry=True)
                except Exception:  # noqa: BLE001 - this one stays unacknowledged
                    log.exception("request %s: its retry could not be published; it is "
                                  "redelivered", outcome.delivery.request_id)
                    failed.add(id(outcome))
        return failed

    def _on_scheduled(self, n: int) -> None:
        qos = self._qos() if self._qos is not None else None
        if qos is None:
            return
        if n > 0:
            qos.increment_eventually(n)
        elif n < 0:
            qos.decrement_eventually(-n)
