"""The worker bootstep that decides what feeds a device worker's pipeline: the fast consumer, or
Celery's own consumer through the kombu intake.

Registered on the app, so it runs in ``asyncinfer worker`` and in ``celery -A asyncinfer worker
-Q infer.mlp`` alike. When the broker is Redis, the consumer setting is ``fast``
(``ASYNCINFER_CONSUMER``, the default) and the pool runs in the worker's own process (threads or
solo, not prefork), the ``infer.*`` queues the worker was told to consume move from Celery's
consumer to the :class:`~asyncinfer.worker.consumers.fast_consumer.FastConsumer`; Celery's consumer
keeps the other queues, and the control queue (``asyncinfer.control``) so that it always has one,
and goes on serving remote control, events and heartbeats. Otherwise (RabbitMQ,
``consumer=celery``) Celery's consumer keeps them and hands each of their messages to the same
pipeline (kombu_intake.py); this step stops that intake before Celery closes its connection. A
device worker whose pool forks (prefork) refuses to start: its models would run in children.

The fast consumer takes nothing before the worker's start-up is complete: it starts when Celery
says the worker is ready (``worker_ready``: Celery's consumer connected, revocations synced with
the other workers by mingle, so a request revoked earlier is not run), after the models were
loaded and announced in the catalogue (bootstrap.py).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from celery import bootsteps, signals
from celery.concurrency import get_implementation
from celery.worker import state as worker_state

from asyncinfer.backoff import Backoff
from asyncinfer.broker.refusals import refusal_reason
from asyncinfer.broker.urls import is_redis_url
from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import CONTROL_QUEUE, model_from_queue
from asyncinfer.supervision.supervisor import CANNOT_START
from asyncinfer.worker.worker import existing_worker, worker_of

__all__ = ["FastConsumerStep", "is_prefork", "uses_fast_consumer"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def is_prefork(pool_cls: Any) -> bool:
    """Whether a worker's pool forks children (tasks then run outside the worker's process)."""
    cls = get_implementation(pool_cls) if isinstance(pool_cls, str) else pool_cls
    return "prefork" in getattr(cls, "__module__", "")


def uses_fast_consumer(settings: Any, broker_url: str) -> bool:
    """Whether a device worker runs the fast consumer: configured (the default), on a Redis
    broker (kombu's Redis transport is what it speaks)."""
    return settings is not None and settings.consumer == "fast" and is_redis_url(broker_url)


def _despite_redis(make: Callable[[], T]) -> T:
    """``make()``, made again with backoff while Redis is unreachable or refuses (a full disk
    refuses even the PING that opens a connection), until the worker is told to stop."""
    backoff = Backoff()
    while True:
        try:
            return make()
        except redis.RedisError as exc:
            if worker_state.should_stop is not None or worker_state.should_terminate is not None:
                raise
            wait_s = backoff.failed()
            log.warning("fast consumer: cannot start, Redis failed (%s); again in %.1f s",
                        refusal_reason(exc) or f"{type(exc).__name__}: {exc}", wait_s)
            time.sleep(wait_s)


class FastConsumerStep(bootsteps.StartStopStep):
    """Runs a fast consumer beside Celery's own consumer, on the worker's ``infer.*`` queues."""

    requires = ("celery.worker.components:Pool",)
    #: Whether Celery's consumer keeps the infer queues and feeds the pipeline (kombu_intake.py).
    kombu = False

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self._refuse_forking(worker)
        self.consumer: Any = None
        self.queues: list[str] = self._take_queues(worker)
        self.kombu = not self.queues and self._feeds_pipeline(worker)
        self._worker: Any = None

    @staticmethod
    def _refuse_forking(worker: Any) -> None:
        """A device worker's models run in its own process: a pool that forks would run them in
        children that own a device their parent may have touched, outside the pipeline."""
        consumed = worker.app.amqp.queues.consume_from or {}
        infer = [name for name in consumed if model_from_queue(name) is not None]
        if infer and is_prefork(worker.pool_cls):
            # one line, and the status a supervisor reads as "cannot start as configured"
            print(f"asyncinfer worker: cannot start: a device worker (queues {', '.join(infer)}) "
                  f"runs the threads or solo pool, not prefork: its models run in its own process, "
                  f"the one that owns the device (asyncinfer worker); serve the CPU stages from a "
                  f"prefork worker of their own", file=sys.stderr, flush=True)
            raise SystemExit(CANNOT_START)

    @staticmethod
    def _feeds_pipeline(worker: Any) -> bool:
        """Whether Celery's consumer may feed the pipeline (an ``asyncinfer.infer`` may come by
        any queue): every worker of the app whose pool does not fork."""
        return not is_prefork(worker.pool_cls)

    @staticmethod
    def _take_queues(worker: Any) -> list[str]:
        app = worker.app
        settings = settings_of(app)
        if not uses_fast_consumer(settings, app.conf.broker_url) or is_prefork(worker.pool_cls):
            return []
        queues = app.amqp.queues
        consumed = list(queues.consume_from or {})
        taken = [name for name in consumed if model_from_queue(name) is not None]
        if not taken:
            return []
        if CONTROL_QUEUE not in consumed:
            queues.select_add(CONTROL_QUEUE)
        for name in taken:
            queues.deselect(name)
        worker_of(app).fast_queues = taken
        return taken

    def include_if(self, worker: Any) -> bool:
        return bool(self.queues) or self.kombu

    def start(self, worker: Any) -> None:
        if not self.queues:  # Celery's consumer makes the kombu intake as it starts
            return
        # Started once the worker is ready (see the module documentation). A broker that cannot
        # be reached now ends the worker at once, non-zero (Celery's "Unrecoverable error"),
        # instead of a hundred reconnection attempts by Celery's consumer over an hour: a
        # supervisor then sees the worker fail and says why.
        self._check_reachable(worker)
        self._worker = worker
        signals.worker_ready.connect(self._on_worker_ready, weak=False)

    @staticmethod
    def _check_reachable(worker: Any) -> None:
        """Raise BrokerUnavailable unless the broker answers a PING within the connect timeout
        (a broker that answers with a refusal, such as a full disk, is ridden out, not refused)."""
        from asyncinfer.client.pinger import Pinger
        from asyncinfer.errors import BrokerRefused

        app = worker.app
        pinger = Pinger(settings_of(app) or Settings.from_env())
        try:
            pinger.ping(str(app.conf.broker_url))
        except BrokerRefused:
            pass
        finally:
            pinger.close()

    def _on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        worker = self._worker
        if worker is None or getattr(sender, "controller", worker) is not worker:
            return  # another worker of this process (tests build several), or stopped already
        signals.worker_ready.disconnect(self._on_worker_ready)
        if self.consumer is None:
            self._start_consumer(worker)

    def _start_consumer(self, worker: Any) -> None:
        from asyncinfer.worker.consumers.fast_consumer import FastConsumer

        device_worker = worker_of(worker.app)
        consumer = _despite_redis(lambda: FastConsumer(
            worker.app, device_worker.runtime, self.queues, hostname=worker.hostname,
            policy=device_worker.policy,
            # task events when the worker sends them (-E, ASYNCINFER_SEND_EVENTS); Celery's own
            # consumer sends the worker's heartbeats
            send_events=bool(worker.task_events), tracing=device_worker.tracing))
        device_worker.serving(consumer)
        self.consumer = consumer.start()

    def stop(self, worker: Any) -> None:
        # Withdrawn from the model catalogue before the held requests go back (also on a stop
        # that no signal began).
        device_worker = existing_worker(worker.app)
        if device_worker is not None:
            device_worker.withdraw()
        signals.worker_ready.disconnect(self._on_worker_ready)
        self._worker = None
        if self.consumer is not None:
            self.consumer.stop()
            self.consumer = None
        elif device_worker is not None and device_worker.consumer is not None:
            if not device_worker.consumer.stopped:  # the kombu intake: before the connection closes
                device_worker.consumer.stop()
