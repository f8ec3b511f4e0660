"""The device worker's consumer of ``infer.*`` queues: Celery's wire format, a fraction of its cost.

Celery's own per-task path (a BRPOP, a Request object, a pool hand-off, two result writes and an
ack pipeline per message) costs milliseconds of worker CPU per request on a small host — time
taken from the model. This consumer keeps the same messages, results, states and redelivery
bookkeeping, but works in batches:

- one script takes what is waiting (up to the free in-flight room) and records it as
  unacknowledged in the same atomic step (take.py); an idle consumer waits without popping
  (wake.py), so a request is never in the worker's memory unrecorded;
- decoding and validation run right here, and valid requests go straight to the model's batcher
  (no thread per request);
- the :class:`ResultWriter` stores results and acknowledges them in one pipeline per batch.

Revocation (``celery.worker.state.revoked``) and ``expires`` are honoured; ``link``,
``link_error`` and chains are called as Celery's tracer calls them. Used by ``asyncinfer
worker`` on a Redis broker; ``celery -A asyncinfer worker`` keeps Celery's stock path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from itertools import groupby
from operator import itemgetter
from typing import Any

import redis
from celery import Celery, bootsteps, states
from celery.exceptions import TaskRevokedError

from asyncinfer.connections import redis_client
from asyncinfer.constants import TASK_NAME, model_from_queue, priority_lists, queue_of_list
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.runner import Completed
from asyncinfer.engine.vital import vital_thread
from asyncinfer.errors import (
    AsyncInferError,
    InvalidRequest,
    ModelError,
    RequestRevoked,
    RetryBudgetExhausted,
)
from asyncinfer.keys import UNACKED_INDEX_KEY, UNACKED_KEY
from asyncinfer.policy.retries import RetryPolicy, retry_budget_for
from asyncinfer.policy.time_limits import EXIT_WEDGED, TimeLimits, time_limits_of
from asyncinfer.wire.envelope import (
    Delivery,
    decode_body,
    expired,
    parse_envelope,
    printable,
    request_id_in,
    restored_message,
    retry_message,
    seconds_until,
    tag_in,
)
from asyncinfer.wire.protocol import Request, request_kwargs
from asyncinfer.worker import inspection, metrics
from asyncinfer.worker.celery_errors import as_celery
from asyncinfer.worker.events import FAILED_FORMAT, TaskEvents
from asyncinfer.worker.intake.result_writer import Outcome, ResultWriter
from asyncinfer.worker.intake.take import MAX_ENVELOPE_DEPTH, Taker
from asyncinfer.worker.intake.wake import Waker
from asyncinfer.worker.runtime import WorkerRuntime

__all__ = ["FastConsumer", "FastConsumerStep"]

log = logging.getLogger(__name__)


def _is_revoked(request_id: str) -> bool:
    from celery.worker import state

    return request_id in state.revoked


class FastConsumer:
    """Consumes ``queues`` for ``runtime`` until :meth:`stop`; at most ``max_in_flight`` at once."""

    def __init__(self, app: Celery, runtime: WorkerRuntime, queues: Sequence[str], *,
                 hostname: str, max_in_flight: int, track_started: bool = True,
                 max_payload_bytes: int | None = None) -> None:
        self.app = app
        self.runtime = runtime
        self.queues = list(queues)
        #: What it takes from: each queue's list and its priority lists, in kombu's order.
        self._lists = priority_lists(self.queues)
        self.hostname = hostname
        self.max_in_flight = max_in_flight
        self.track_started = track_started
        self.max_payload_bytes = max_payload_bytes
        self.client = redis_client(app.conf.broker_url, getattr(app, "asyncinfer_settings", None),
                                   health_check_interval=30)
        self.writer = ResultWriter(app, self.client, self._written)
        self.taker = Taker(self.client)
        # The watchers block on their own connections (one each), never on the consumer's.
        settings = getattr(app, "asyncinfer_settings", None)
        # Blocking commands need a socket timeout beyond their own (redis-py's default is 5 s).
        blocking = {"health_check_interval": 30, "socket_timeout": Waker.block_s + 5}
        self.waker = Waker(redis_client(app.conf.broker_url, settings, **blocking),
                           redis_client(app.conf.broker_url, settings, single_connection_client=True,
                                        **blocking),
                           self._lists, stopping=self._stopping_now)
        #: Celery task events (Flower); :class:`FastConsumerStep` turns them on with the worker's.
        self.events = TaskEvents(app, hostname, enabled=False)
        self.device = runtime.device.label
        self._task = app.tasks.get(TASK_NAME)
        self.policy = RetryPolicy.of_task(self._task) if self._task else RetryPolicy(max_retries=0)
        self.budget = retry_budget_for(app)
        self._default_limits = time_limits_of(None, self._task, app.conf)
        runtime.on_wedged = self._wedged
        self._in_flight = 0
        #: Messages taken and not yet answered (by ``id()``): sent back on shutdown or a wedge.
        self._held: dict[int, Delivery] = {}
        self._wedge_lock = threading.Lock()
        self._wedged_already = False
        self._cond = threading.Condition()
        self._stopping = threading.Event()
        self._thread = vital_thread(self._run, "asyncinfer-consumer")

    def _stopping_now(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> FastConsumer:
        self.waker.start()
        self._thread.start()
        log.info("fast consumer on %s", ", ".join(self.queues))
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        """Take no more messages; wait up to ``grace_s`` for those in flight to finish."""
        self._stopping.set()
        self.waker.close()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + grace_s
        with self._cond:
            while self._in_flight and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            left = self._in_flight
        self.writer.close()
        self.events.close()
        if left:
            log.warning("%d requests still in flight at shutdown go back to their queues", left)
            self._restore_held()

    def _restore_held(self) -> None:
        """Put every message still held back on its queue at once, as kombu restores an
        unacknowledged message (marked ``redelivered``), instead of leaving it for the visibility
        timeout. One transaction: each message is either back on its queue or still unacked."""
        held = [d for d in list(self._held.values()) if d.tag]
        if not held:
            return
        try:
            pipe = self.client.pipeline(transaction=True)
            for d in held:
                pipe.lpush(d.list_key, restored_message(d))
                pipe.zrem(UNACKED_INDEX_KEY, d.tag)
                pipe.hdel(UNACKED_KEY, d.tag)
            pipe.execute()
            log.warning("sent %d held requests back to their queues", len(held))
        except Exception:  # noqa: BLE001 - they stay unacknowledged: redelivered after the timeout
            log.exception("could not send %d held requests back; they are redelivered after the "
                          "visibility timeout", len(held))

    def _wedged(self, item: WorkItem, exc: BaseException) -> None:
        """A request's hard time limit passed while its batch was on the device: fail it, send
        the other held requests back, and leave so that the supervisor starts a fresh process."""
        d = next((d for d in list(self._held.values()) if d.request_id == item.request.id), None)
        if d is not None and not item.future.done():
            self._fail(d, as_celery(exc), None, retry=False)
            self._held.pop(id(d), None)
        with self._wedge_lock:
            if self._wedged_already:
                return
            self._wedged_already = True
        self._stopping.set()
        self.waker.close()
        log.critical("the device is wedged (%s); this worker process exits to be replaced", exc)
        self._thread.join(timeout=5)  # what its last take took is held, and sent back below
        self.writer.close()
        self._restore_held()
        logging.shutdown()
        os._exit(EXIT_WEDGED)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- intake --------------------------------------------------------------------------------

    def _room(self) -> int:
        with self._cond:
            while self._in_flight >= self.max_in_flight and not self._stopping.is_set():
                self._cond.wait(0.5)
            return self.max_in_flight - self._in_flight

    def _written(self, outcomes: list[Outcome]) -> None:
        for outcome in outcomes:
            self._held.pop(id(outcome.delivery), None)
            if outcome.state == states.FAILURE and isinstance(outcome.result, RetryBudgetExhausted):
                # a retry the writer found no budget for: it failed there, announced here
                self._log_failure(outcome.delivery, outcome.result)
                self._count(outcome)
            elif outcome.state == states.RETRY:
                d = outcome.delivery
                metrics.count_retry(model_from_queue(d.queue) or d.queue, self.device)
                self.events.finished(d, outcome.state, outcome.result)
        with self._cond:
            self._in_flight -= len(outcomes)
            self._cond.notify_all()
        self.events.flush()  # after the results are stored, as Celery's worker sends them

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._stopping.is_set():
            try:
                room = self._room()
                if room <= 0:
                    continue
                # Take atomically with the bookkeeping; once a take leaves the queues empty, wait
                # for the watchers (which never pop) and take again.
                self.waker.clear()
                taken = self.taker.take(self._lists, room)
                if taken:
                    self._took(taken)
                backoff_s = 0.1
                if len(taken) < room:
                    self.waker.arm()
                    self.waker.wait(1.0)
            except redis.RedisError as exc:
                # Lost connection, a timeout, OOM, READONLY (a demoted master), ...: nothing was
                # taken that is not recorded; wait and take again.
                log.warning("consumer: Redis failed (%s: %s); again in %.1f s", type(exc).__name__,
                            exc, backoff_s)
                self._stopping.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)
            except Exception:  # noqa: BLE001 - the consumer must survive whatever comes in
                log.exception("consumer error; going on in %.1f s", backoff_s)
                self._stopping.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 5.0)

    def _took(self, taken: list[tuple[str, bytes, bool]]) -> None:
        """Start messages the take script popped and recorded; write their STARTED states."""
        received_at = time.perf_counter()
        deliveries: list[Delivery] = []
        for key, group in groupby(taken, key=itemgetter(0)):  # the script takes list by list
            deliveries += self._parse(queue_of_list(key), key, [(raw, rec) for _, raw, rec in group],
                                      received_at)
        pipe = self.client.pipeline(transaction=False)
        results = self._record(pipe, deliveries)
        try:
            pipe.execute()
            if results is not None:
                results.execute()
        except redis.RedisError as exc:  # STARTED is a courtesy; the requests are safely recorded
            log.warning("could not store STARTED for %d requests (%s)", len(deliveries), exc)
        self._start_all(deliveries)

    def _start_all(self, taken: list[Delivery]) -> None:
        deliveries = self._skip_answered(taken)
        runners = [r.batcher for r in self.runtime.runners()]
        for batcher in runners:  # batches forming now may wait for these requests
            batcher.hold()
        try:
            for d in deliveries:
                self._start(d)
        finally:
            for batcher in runners:
                batcher.release()
        self.events.flush()

    def _parse(self, queue: str, key: str, raws: list[tuple[Any, bool]],
               received_at: float) -> list[Delivery]:
        deliveries = []
        for raw, recorded in raws:
            d = Delivery(raw=raw, queue=queue, received_at=received_at, key=key)
            try:
                parse_envelope(d)
                if not recorded:
                    raise ValueError(f"the envelope breaks the rules of a kombu message (objects "
                                     f"for headers and properties, nested at most "
                                     f"{MAX_ENVELOPE_DEPTH} deep)")
            except Exception as exc:  # noqa: BLE001 - RecursionError, MemoryError, ...: this one only
                self._malformed(d, exc, recorded)
                continue
            deliveries.append(d)
            self._held[id(d)] = d
        with self._cond:
            self._in_flight += len(deliveries)
        return deliveries

    def _malformed(self, d: Delivery, exc: Exception, recorded: bool) -> None:
        """Answer a message that is no kombu envelope: a FAILURE for the request ID its text names,
        if any; else a log line. Either way it is gone from the queue (a malformed message is never
        redelivered) and from the unacknowledged bookkeeping, if the take recorded it."""
        try:
            request_id = d.request_id or request_id_in(d.raw)
            d.tag = tag_in(d.raw) if recorded else ""
        except Exception:  # noqa: BLE001 - not even its text can be searched
            request_id, d.tag = "", ""
        d.envelope = {}
        if not request_id:
            log.error("dropped a malformed message on %s (%s: %s): %s", d.queue,
                      type(exc).__name__, printable(exc), printable(d.raw))
            if d.tag:
                with self._cond:
                    self._in_flight += 1
                self.writer.put(Outcome(d, states.FAILURE, None, store=False))
            return
        d.request_id = request_id
        with self._cond:
            self._in_flight += 1
        self._fail(d, InvalidRequest(f"request {request_id}: the message on {d.queue} is malformed "
                                     f"and was dropped ({type(exc).__name__}: {printable(exc)})"),
                   None, retry=False)

    def _record(self, pipe: Any, deliveries: list[Delivery]) -> Any:
        """Add STARTED of ``deliveries`` (and their count towards the retry budget) to ``pipe``;
        return a separate results pipeline to execute after it when the result backend is
        elsewhere."""
        starting = [d for d in deliveries if self._should_start(d)] if self.track_started else []
        # First attempts count towards the fleet's retry budget.
        first = sum(1 for d in deliveries
                    if d.headers.get("task") == TASK_NAME and not d.headers.get("retries"))
        if not starting and not first:
            return None
        results = pipe if self.writer.shared else self.writer.results.pipeline(transaction=False)
        for d in starting:
            self.writer.started(results, d, self.hostname)
        self.budget.count_requests(first, results)
        return None if self.writer.shared else results

    def _should_start(self, d: Delivery) -> bool:
        return bool(d.request_id) and d.headers.get("task") == TASK_NAME and not d.headers.get("eta")

    def _skip_answered(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Acknowledge, without running them again, redelivered requests whose result is already
        stored (a worker died between storing the result and the acknowledgement)."""
        again = [d for d in deliveries if d.headers.get("redelivered") and d.request_id]
        if not again:
            return deliveries
        backend = self.app.backend
        try:
            stored = self.writer.results.mget([backend.get_key_for_task(d.request_id) for d in again])
        except redis.RedisError as exc:  # cannot tell: run them again (at least once)
            log.warning("could not look up %d redelivered requests (%s); running them", len(again), exc)
            return deliveries
        answered: set[int] = set()
        for d, raw in zip(again, stored, strict=True):
            if raw is None:
                continue
            try:
                status = backend.decode(raw).get("status")
            except Exception:  # noqa: BLE001 - unreadable: run it again
                continue
            if status in states.READY_STATES:
                log.info("request %s was redelivered but its result (%s) is already stored; "
                         "acknowledged without running it again", d.request_id, status)
                self.writer.put(Outcome(d, status, None, store=False))
                answered.add(id(d))
        return [d for d in deliveries if id(d) not in answered]

    def _limits(self, headers: dict[str, Any]) -> TimeLimits:
        given = headers.get("timelimit")
        if not given or given == [None, None]:
            return self._default_limits
        return time_limits_of(given, self._task, self.app.conf)

    def _delay(self, d: Delivery, eta_s: float) -> None:
        """Hold a message with a future ``eta`` (a retry's backoff) until then, unacknowledged,
        outside the in-flight bound (as Celery's worker holds ETA tasks)."""
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()
        self.runtime.timer.call_later(eta_s, lambda: self._resume(d))

    def _resume(self, d: Delivery) -> None:
        if self._stopping.is_set():  # left held: sent back to its queue at shutdown
            return
        with self._cond:
            self._in_flight += 1
        self._start(d, waited=True)

    def _start(self, d: Delivery, waited: bool = False) -> None:
        headers = d.headers
        if not waited and headers.get("eta"):
            eta_s = seconds_until(headers.get("eta"))
            if eta_s is not None and eta_s > 0 and d.request_id:
                self._delay(d, eta_s)
                return
        if not d.request_id:
            self.writer.put(Outcome(d, states.FAILURE, None))  # nothing to answer; just ack
            log.error("dropped a message without a request ID on %s", d.queue)
            return
        self.events.received(d)
        if headers.get("task") != TASK_NAME:
            self._fail(d, InvalidRequest(f"request {d.request_id}: task {headers.get('task')!r} is not "
                                         f"served on queue {d.queue} (only {TASK_NAME})"), None)
            return
        if _is_revoked(d.request_id):
            self._put(Outcome(d, states.REVOKED, TaskRevokedError("revoked")))
            return
        if expired(headers):
            self._put(Outcome(d, states.REVOKED, TaskRevokedError("expired")))
            return
        embed: dict[str, Any] | None = None
        try:
            args, kwargs, embed = decode_body(d, self.max_payload_bytes)
            request, future = self.runtime.submit(
                d.request_id, request_kwargs(d.request_id, args, kwargs), received_at=d.received_at,
                expires_in_s=seconds_until(headers.get("expires")), time_limits=self._limits(headers))
        except AsyncInferError as exc:
            self._fail(d, exc, embed)
            return
        except Exception as exc:  # noqa: BLE001 - never lose an accepted request
            log.debug("request %s: unexpected error", d.request_id, exc_info=True)  # _fail says it
            self._fail(d, exc, embed)
            return
        self.events.started(d)
        inspection.count_started()
        future.add_done_callback(lambda f: self._finish(d, request, f, embed))

    def _fail(self, d: Delivery, exc: BaseException, embed: dict[str, Any] | None,
              retry: bool = True) -> None:
        if retry and self._retry(d, exc, embed):
            return
        self._log_failure(d, exc)
        self._put(Outcome(d, states.FAILURE, exc, embed))

    def _log_failure(self, d: Delivery, exc: BaseException) -> None:
        """The one log line of a failed request (grep its ID): no other line repeats it."""
        log.warning(FAILED_FORMAT, printable(d.request_id), model_from_queue(d.queue) or d.queue,
                    self.hostname, type(exc).__name__, printable(exc, 1000))

    def _retry(self, d: Delivery, exc: BaseException, embed: dict[str, Any] | None) -> bool:
        """Send a transient failure back on its queue to run again after a backoff, as Celery's
        ``autoretry_for`` does (the writer first asks the fleet's retry budget). True if so."""
        retries = int(d.headers.get("retries") or 0)
        if not (d.tag and d.headers.get("task") == TASK_NAME and self.policy.should_retry(exc, retries)):
            return False
        message = retry_message(d, self.policy.countdown_s(retries))
        self.writer.put(Outcome(d, states.RETRY, exc, embed, retry=message))
        return True

    def _finish(self, d: Delivery, request: Request, future: Future[Completed],
                embed: dict[str, Any] | None) -> None:
        """Settle ``d`` once its future is done (a done-callback: nothing may escape it, or the
        request would stay in flight unanswered)."""
        try:
            self._settle(d, request, future, embed)
        except Exception as exc:  # noqa: BLE001 - the last resort: answer it all the same
            log.exception("request %s: settling it failed", printable(d.request_id))
            self._put(Outcome(d, states.FAILURE, ModelError(
                f"request {d.request_id}: the worker could not settle it ({type(exc).__name__}: "
                f"{exc})")))

    def _settle(self, d: Delivery, request: Request, future: Future[Completed],
                embed: dict[str, Any] | None) -> None:
        exc = future.exception()
        if exc is not None:
            exc = as_celery(exc)
            if isinstance(exc, RequestRevoked):
                self._put(Outcome(d, states.REVOKED, TaskRevokedError(str(exc)), embed))
            else:
                self._fail(d, exc, embed)
            return
        try:
            response = self.runtime.response(request, future.result(), self.hostname)
        except Exception as err:  # noqa: BLE001
            self._fail(d, err, embed)
            return
        self._put(Outcome(d, states.SUCCESS, response, embed))

    def _put(self, outcome: Outcome) -> None:
        """Hand ``outcome`` to the writer; count it (metrics) and announce it (task events)."""
        self._count(outcome)
        self.writer.put(outcome)

    def _count(self, outcome: Outcome) -> None:
        d, result = outcome.delivery, outcome.result
        metrics.record_outcome(model_from_queue(d.queue) or d.queue, self.device, outcome.state,
                               result if isinstance(result, BaseException) else None)
        self.events.finished(d, outcome.state, result)


class FastConsumerStep(bootsteps.StartStopStep):
    """Worker bootstep that runs a :class:`FastConsumer` beside Celery's own consumer."""

    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.consumer: FastConsumer | None = None
        self.queues: list[str] = list(getattr(worker.app, "asyncinfer_fast_queues", ()))

    def include_if(self, worker: Any) -> bool:
        return bool(self.queues)

    def start(self, worker: Any) -> None:
        from asyncinfer.worker.runtime import get_runtime

        settings = worker.app.asyncinfer_settings
        consumer = FastConsumer(
            worker.app, get_runtime(), self.queues, hostname=worker.hostname,
            max_in_flight=settings.concurrency * settings.prefetch_multiplier,
            track_started=bool(worker.app.conf.task_track_started),
            max_payload_bytes=settings.max_payload_bytes)
        # Task events when the worker sends them (-E, ASYNCINFER_SEND_EVENTS); its own consumer
        # sends the worker's heartbeats.
        consumer.events = TaskEvents(worker.app, worker.hostname, enabled=bool(worker.task_events))
        metrics.watch(in_flight=lambda: consumer.in_flight)
        inspection.serve(self.queues, consumer.max_in_flight)
        self.consumer = consumer.start()

    def stop(self, worker: Any) -> None:
        if self.consumer is not None:
            self.consumer.stop()
            self.consumer = None
