"""The device worker's consumer of ``infer.*`` queues: Celery's wire format, a fraction of its cost.

Celery's own per-task path (a BRPOP, a Request object, a pool hand-off, two result writes and an
ack pipeline per message) costs milliseconds of worker CPU per request on a small host — time
taken from the model. This consumer keeps the same messages, results, states and redelivery
bookkeeping, but works in batches:

- one BRPOP wakes it, one RPOP with a count takes what else is waiting (up to the free
  in-flight room), one pipeline records them all as unacknowledged (and STARTED);
- decoding and validation run right here, and valid requests go straight to the model's batcher
  (no thread per request);
- the :class:`ResultWriter` stores results and acknowledges them in one pipeline per batch.

Revocation (``celery.worker.state.revoked``) and ``expires`` are honoured; ``link``,
``link_error`` and chains are called as Celery's tracer calls them. Used by ``asyncinfer
worker`` on a Redis broker; ``celery -A asyncinfer worker`` keeps Celery's stock path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import redis
from celery import Celery, bootsteps, states
from celery.exceptions import TaskRevokedError

from asyncinfer.celery_wire import (
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
    Delivery,
    decode_body,
    expired,
    parse_envelope,
    seconds_until,
)
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import AsyncInferError, InvalidRequest, RequestRevoked
from asyncinfer.protocol import Request, request_kwargs
from asyncinfer.workers.result_writer import Outcome, ResultWriter
from asyncinfer.workers.runner import Completed
from asyncinfer.workers.runtime import WorkerRuntime

__all__ = ["FastConsumer", "FastConsumerStep"]

log = logging.getLogger(__name__)


def _is_revoked(request_id: str) -> bool:
    from celery.worker import state

    return request_id in state.revoked


class FastConsumer:
    """Consumes ``queues`` for ``runtime`` until :meth:`stop`; at most ``max_in_flight`` at once."""

    def __init__(self, app: Celery, runtime: WorkerRuntime, queues: Sequence[str], *,
                 hostname: str, max_in_flight: int, track_started: bool = True) -> None:
        self.app = app
        self.runtime = runtime
        self.queues = list(queues)
        self.hostname = hostname
        self.max_in_flight = max_in_flight
        self.track_started = track_started
        self.client = redis.Redis.from_url(app.conf.broker_url, health_check_interval=30)
        self.writer = ResultWriter(app, self.client, self._written)
        self._in_flight = 0
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="asyncinfer-consumer", daemon=True)

    def start(self) -> FastConsumer:
        self._thread.start()
        log.info("fast consumer on %s", ", ".join(self.queues))
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        """Take no more messages; wait up to ``grace_s`` for those in flight to finish."""
        self._stopping.set()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + grace_s
        with self._cond:
            while self._in_flight and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            left = self._in_flight
        if left:
            log.warning("%d requests still in flight at shutdown stay unacknowledged; "
                        "they are redelivered after the visibility timeout", left)
        self.writer.close()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- intake --------------------------------------------------------------------------------

    def _room(self) -> int:
        with self._cond:
            while self._in_flight >= self.max_in_flight and not self._stopping.is_set():
                self._cond.wait(0.5)
            return self.max_in_flight - self._in_flight

    def _written(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n
            self._cond.notify_all()

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._stopping.is_set():
            try:
                room = self._room()
                if room <= 0:
                    continue
                reply = self.client.brpop(self.queues, timeout=1)
                if reply is None:
                    continue
                key, first = reply
                queue = key.decode() if isinstance(key, bytes) else str(key)
                self._take(queue, first, room - 1)
                backoff_s = 0.1
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("consumer lost Redis (%s); retrying in %.1f s", exc, backoff_s)
                self._stopping.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)
            except Exception:  # noqa: BLE001 - the consumer must survive whatever comes in
                log.exception("consumer error; going on")

    def _take(self, queue: str, first: Any, more: int) -> None:
        """Record ``first`` and up to ``more`` further waiting messages as taken, then start them.

        The first message's bookkeeping rides in the same round trip as the RPOP of the others,
        so a lone request costs one round trip here; the others' bookkeeping takes a second.
        """
        received_at = time.perf_counter()
        head = self._parse(queue, [first], received_at)
        pipe = self.client.pipeline(transaction=False)
        if more > 0:
            pipe.rpop(queue, more)
        results = self._record(pipe, head)
        replies = self._execute(pipe, results, head)
        extra: Any = replies[0] if more > 0 else None
        rest = self._parse(queue, list(extra or []), received_at)
        if rest:
            pipe = self.client.pipeline(transaction=False)
            results = self._record(pipe, rest)
            self._execute(pipe, results, rest)
        deliveries = head + rest
        runners = [r.batcher for r in self.runtime.runners()]
        for batcher in runners:  # batches forming now may wait for these requests
            batcher.hold()
        try:
            for d in deliveries:
                self._start(d)
        finally:
            for batcher in runners:
                batcher.release()

    def _execute(self, pipe: Any, results: Any, deliveries: list[Delivery]) -> list[Any]:
        try:
            replies: list[Any] = pipe.execute()
            if results is not None:
                results.execute()
            return replies
        except Exception:
            # Like kombu's own BRPOP-then-bookkeeping, a message popped just before Redis went
            # away is not recorded; it is not counted as in flight either.
            log.error("could not record %d taken messages as unacknowledged", len(deliveries))
            with self._cond:
                self._in_flight -= len(deliveries)
                self._cond.notify_all()
            raise

    def _parse(self, queue: str, raws: list[Any], received_at: float) -> list[Delivery]:
        deliveries = []
        for raw in raws:
            d = Delivery(raw=raw, queue=queue, received_at=received_at)
            try:
                parse_envelope(d)
            except (ValueError, TypeError, AttributeError) as exc:
                log.error("dropped a malformed message on %s (%s): %.200r", queue, exc, raw)
                continue
            deliveries.append(d)
        with self._cond:
            self._in_flight += len(deliveries)
        return deliveries

    def _record(self, pipe: Any, deliveries: list[Delivery]) -> Any:
        """Add kombu's unacked bookkeeping (and STARTED) of ``deliveries`` to ``pipe``; return a
        separate results pipeline to execute after it when the result backend is elsewhere."""
        now = time.time()
        for d in deliveries:
            pipe.zadd(UNACKED_INDEX_KEY, {d.tag: now})
            pipe.hset(UNACKED_KEY, d.tag, d.unacked_entry)
        starting = [d for d in deliveries if self._should_start(d)] if self.track_started else []
        if not starting:
            return None
        results = pipe if self.writer.shared else self.writer.results.pipeline(transaction=False)
        for d in starting:
            self.writer.started(results, d, self.hostname)
        return None if self.writer.shared else results

    def _should_start(self, d: Delivery) -> bool:
        return bool(d.request_id) and d.headers.get("task") == TASK_NAME

    def _start(self, d: Delivery) -> None:
        headers = d.headers
        if not d.request_id:
            self.writer.put(Outcome(d, states.FAILURE, None))  # nothing to answer; just ack
            log.error("dropped a message without a request ID on %s", d.queue)
            return
        if headers.get("task") != TASK_NAME:
            self._fail(d, InvalidRequest(f"request {d.request_id}: task {headers.get('task')!r} is not "
                                         f"served on queue {d.queue} (only {TASK_NAME})"), None)
            return
        if _is_revoked(d.request_id):
            self.writer.put(Outcome(d, states.REVOKED, TaskRevokedError("revoked")))
            return
        if expired(headers):
            self.writer.put(Outcome(d, states.REVOKED, TaskRevokedError("expired")))
            return
        embed: dict[str, Any] | None = None
        try:
            args, kwargs, embed = decode_body(d)
            request, future = self.runtime.submit(
                d.request_id, request_kwargs(d.request_id, args, kwargs), received_at=d.received_at,
                expires_in_s=seconds_until(headers.get("expires")))
        except AsyncInferError as exc:
            self._fail(d, exc, embed)
            return
        except Exception as exc:  # noqa: BLE001 - never lose an accepted request
            log.exception("request %s: unexpected error", d.request_id)
            self._fail(d, exc, embed)
            return
        future.add_done_callback(lambda f: self._finish(d, request, f, embed))

    def _fail(self, d: Delivery, exc: BaseException, embed: dict[str, Any] | None) -> None:
        log.warning("request %s failed on %s: %s", d.request_id, self.hostname, exc)
        self.writer.put(Outcome(d, states.FAILURE, exc, embed))

    def _finish(self, d: Delivery, request: Request, future: Future[Completed],
                embed: dict[str, Any] | None) -> None:
        exc = future.exception()
        if exc is not None:
            if isinstance(exc, RequestRevoked):
                self.writer.put(Outcome(d, states.REVOKED, TaskRevokedError(str(exc)), embed))
            else:
                self._fail(d, exc, embed)
            return
        try:
            response = self.runtime.response(request, future.result(), self.hostname)
        except Exception as err:  # noqa: BLE001
            self._fail(d, err, embed)
            return
        self.writer.put(Outcome(d, states.SUCCESS, response, embed))


class FastConsumerStep(bootsteps.StartStopStep):
    """Worker bootstep that runs a :class:`FastConsumer` beside Celery's own consumer."""

    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.consumer: FastConsumer | None = None
        self.queues: list[str] = list(getattr(worker.app, "asyncinfer_fast_queues", ()))

    def include_if(self, worker: Any) -> bool:
        return bool(self.queues)

    def start(self, worker: Any) -> None:
        from asyncinfer.workers.runtime import get_runtime

        settings = worker.app.asyncinfer_settings
        self.consumer = FastConsumer(
            worker.app, get_runtime(), self.queues, hostname=worker.hostname,
            max_in_flight=settings.concurrency * settings.prefetch_multiplier,
            track_started=bool(worker.app.conf.task_track_started)).start()

    def stop(self, worker: Any) -> None:
        if self.consumer is not None:
            self.consumer.stop()
            self.consumer = None
