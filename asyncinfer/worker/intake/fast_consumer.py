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
from itertools import groupby
from operator import itemgetter
from typing import Any

import redis
from celery import Celery

from asyncinfer.backoff import Backoff
from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.connections import redis_client
from asyncinfer.constants import TASK_NAME, priority_lists, queue_of_list
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.vital import vital_thread
from asyncinfer.errors import AsyncInferError, InvalidRequest, WorkerLost
from asyncinfer.keys import (
    LEASE_DEVICE_KEY,
    LEASE_HOLDERS_KEY,
    LEASES_KEY,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
)
from asyncinfer.policy.policy import Policy
from asyncinfer.policy.time_limits import EXIT_WEDGED
from asyncinfer.wire.envelope import (
    MALFORMED_DROPPED,
    Delivery,
    decode_body,
    malformed_error,
    parse_envelope,
    printable,
    restored_message,
    tag_in,
)
from asyncinfer.wire.protocol import request_kwargs
from asyncinfer.wire.result_json import decode_meta
from asyncinfer.worker.celery_errors import as_celery
from asyncinfer.worker.events import TaskEvents
from asyncinfer.worker.intake.first_attempts import FirstAttempts
from asyncinfer.worker.intake.holdings import Holdings, held_at_most
from asyncinfer.worker.intake.leases import Leases
from asyncinfer.worker.intake.outcomes import Outcomes
from asyncinfer.worker.intake.result_writer import ResultWriter
from asyncinfer.worker.intake.take import MAX_ENVELOPE_DEPTH, Taken, Taker
from asyncinfer.worker.intake.wake import Waker
from asyncinfer.worker.lifecycle import (
    DELAY,
    EXPIRED,
    REFUSED,
    REVOKED,
    Settlement,
    admit,
    already_answered,
    count_started,
)
from asyncinfer.worker.runtime import WorkerRuntime

__all__ = ["FastConsumer"]

log = logging.getLogger(__name__)


class FastConsumer:
    """Consumes ``queues`` for ``runtime`` until :meth:`stop`; at most ``max_in_flight`` at once."""

    def __init__(self, app: Celery, runtime: WorkerRuntime, queues: Sequence[str], *,
                 hostname: str, policy: Policy, send_events: bool = False) -> None:
        self.app = app
        self.runtime = runtime
        self.queues = list(queues)
        #: What it takes from: each queue's list and its priority lists, in kombu's order.
        self._lists = priority_lists(self.queues)
        self.hostname = hostname
        #: Retries and budget, time limits, the in-flight bound, the payload limit.
        self.policy = policy
        settings = settings_of(app) or Settings.from_env()
        # The consumer thread's own connection, and the result writer's: a pool check-out per
        # command costs a poll() and redis-py's argument checks (~8 % of the worker's CPU).
        self.client = redis_client(app.conf.broker_url, settings, health_check_interval=30,
                                   single_connection_client=True)
        self.taker = Taker(self.client)
        # The watchers block on their own connections (one each), never on the consumer's.
        # Blocking commands need a socket timeout beyond their own (redis-py's default is 5 s).
        blocking = {"health_check_interval": 30, "socket_timeout": Waker.block_s + 5}
        self.waker = Waker(redis_client(app.conf.broker_url, settings, **blocking),
                           redis_client(app.conf.broker_url, settings, single_connection_client=True,
                                        **blocking),
                           self._lists, stopping=self._stopping_now)
        #: Everything taken and not yet answered: the one in-flight account.
        self.holdings = Holdings(lambda: held_at_most(policy.max_in_flight, settings.hold_batches,
                                                      settings.hold_s, runtime.runners()))
        #: Celery task events (Flower), when the worker sends them (-E, ASYNCINFER_SEND_EVENTS).
        self.events = TaskEvents(app, hostname, enabled=send_events)
        self.settlement = Settlement(hostname, runtime.device.label, policy, events=self.events,
                                     metrics=runtime.metrics)
        self.writer = ResultWriter(app, redis_client(app.conf.broker_url, settings,
                                                     health_check_interval=30,
                                                     single_connection_client=True),
                                   worker=hostname)
        self.outcomes = Outcomes(self.writer, self.settlement, self.holdings, runtime.response)
        #: Deaths on the device a request may see before it fails for good (0: not counted).
        self.max_worker_deaths = settings.max_worker_deaths
        #: What this worker takes is leased to it, renewed while it lives (None: no leases).
        self.leases = None if not settings.lease_s else Leases(
            redis_client(app.conf.broker_url, settings, health_check_interval=30,
                         single_connection_client=True),
            redis_client(app.conf.broker_url, settings, health_check_interval=30),
            node=hostname, lease_s=settings.lease_s, deaths_ttl_s=settings.result_expires_s,
            count_deaths=self.max_worker_deaths > 0, held=self.holdings.tags)
        runtime.on_wedged = self._wedged
        runtime.settling = self.writer.gathering  # a batch's results: one write
        if self.leases is not None and self.leases.count_deaths:
            runtime.on_launch = self._on_launch
        self._wedge_lock = threading.Lock()
        self._wedged_already = False
        self._stopping = threading.Event()
        self.first_attempts = FirstAttempts(policy.budget)
        self._thread = vital_thread(self._run, "asyncinfer-consumer")

    @property
    def max_in_flight(self) -> int:
        return self.holdings.max_in_flight

    @property
    def in_flight(self) -> int:
        return self.holdings.in_flight

    def _stopping_now(self) -> bool:
        return self._stopping.is_set()

    def start(self) -> FastConsumer:
        if self.leases is not None:  # what a dead predecessor on this host held comes back first
            self.leases.start()
        self.waker.start()
        self._thread.start()
        log.info("fast consumer on %s", ", ".join(self.queues))
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        """Take no more messages; wait up to ``grace_s`` for those in flight to finish."""
        self._stopping.set()
        self.waker.close()
        self._thread.join(timeout=5)
        self.first_attempts.send(due_only=False)
        left = self.holdings.drain(grace_s)
        self.writer.close()
        self.events.close()
        if left:
            log.warning("%d requests still in flight at shutdown go back to their queues", left)
            self._restore_held()
        if self.leases is not None:
            self.leases.stop()

    def _restore_held(self) -> None:
        """Put every message still held back on its queue at once, as kombu restores an
        unacknowledged message (marked ``redelivered``), instead of leaving it for the visibility
        timeout. One transaction: each message is either back on its queue or still unacked."""
        held = [h.delivery for h in self.holdings.held() if h.delivery.tag]
        if not held:
            return
        try:
            pipe = self.client.pipeline(transaction=True)
            for d in held:
                pipe.lpush(d.list_key, restored_message(d))
                pipe.zrem(UNACKED_INDEX_KEY, d.tag)
                pipe.hdel(UNACKED_KEY, d.tag)
                pipe.zrem(LEASES_KEY, d.tag)
                pipe.hdel(LEASE_HOLDERS_KEY, d.tag)
                pipe.hdel(LEASE_DEVICE_KEY, d.tag)
            pipe.execute()
            log.warning("sent %d held requests back to their queues", len(held))
        except Exception:  # noqa: BLE001 - they stay unacknowledged: redelivered after the timeout
            log.exception("could not send %d held requests back; they are redelivered after the "
                          "visibility timeout", len(held))

    def _on_launch(self, items: Sequence[WorkItem]) -> None:
        """A batch goes onto the device: a death from now on counts against its requests."""
        assert self.leases is not None
        self.leases.on_device(self.holdings.tags_of(items))

    def _wedged(self, item: WorkItem, exc: BaseException) -> None:
        """A request's hard time limit passed while its batch was on the device: fail it, send
        the other held requests back, and leave so that the supervisor starts a fresh process."""
        d = self.holdings.find(item.request.id)
        if d is not None and not item.future.done():
            self.outcomes.fail(d, as_celery(exc), None, retry=False)
            self.holdings.release([d])
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

    # -- intake --------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            try:
                room = self.holdings.room(self._stopping_now)
                if room <= 0:
                    continue
                # Take atomically with the bookkeeping; once a take leaves the queues empty, wait
                # for the watchers (which never pop) and take again.
                self.waker.clear()
                started = (self.writer.started_for_take(self.hostname) if self.policy.track_started
                           else None)
                taken = self.taker.take(self._lists, room, started,
                                        self.leases.terms if self.leases is not None else None,
                                        watcher=self.waker.token, watched=self.waker.passable())
                if self.taker.passed:
                    self.waker.watch_passed(self.taker.passed)
                if taken:
                    self._took(taken)
                backoff.reset()
                if len(taken) < room:
                    self.first_attempts.send(due_only=True)  # idle, it wakes at least every 1 s
                    self.waker.arm()
                    self.waker.wait(1.0)
            except redis.RedisError as exc:
                # Lost connection, a timeout, OOM, READONLY (a demoted master), ...: nothing was
                # taken that is not recorded; wait and take again.
                wait_s = backoff.failed()
                log.warning("consumer: Redis failed (%s: %s); again in %.1f s", type(exc).__name__,
                            exc, wait_s)
                self._stopping.wait(wait_s)
            except Exception:  # noqa: BLE001 - the consumer must survive whatever comes in
                wait_s = backoff.failed()
                log.exception("consumer error; going on in %.1f s", wait_s)
                self._stopping.wait(wait_s)

    def _took(self, taken: list[Taken]) -> None:
        """Start messages the take script popped and recorded; write the STARTED states it did
        not."""
        received_at = time.perf_counter()
        deliveries: list[Delivery] = []
        for key, group in groupby(taken, key=itemgetter(0)):  # the script takes list by list
            deliveries += self._parse(queue_of_list(key), key,
                                      [(raw, rec, started, died)
                                       for _, raw, rec, started, died in group], received_at)
        # before STARTED is stored over the answer a redelivered request may already have
        deliveries = self._skip_answered(deliveries)
        if self.policy.track_started:  # those the take did not store: before they run
            self.writer.store_started([d for d in deliveries
                                       if not d.started and self._should_start(d)], self.hostname)
        self._start_all(deliveries)
        self.first_attempts.add(deliveries)  # after: the budget's count is not on their path

    def _start_all(self, deliveries: list[Delivery]) -> None:
        runners = [r.batcher for r in self.runtime.runners()]
        for batcher in runners:  # batches forming now may wait for these requests
            batcher.hold()
        try:
            with self.writer.gathering():  # those answered at once (bad input, revoked): one write
                for d in deliveries:
                    self._start(d)
        finally:
            for batcher in runners:
                batcher.release()
        self.events.flush()

    def _parse(self, queue: str, key: str, raws: list[tuple[Any, bool, bool, int]],
               received_at: float) -> list[Delivery]:
        deliveries = []
        for raw, recorded, started, died in raws:
            d = Delivery(raw=raw, queue=queue, received_at=received_at, key=key, started=started,
                         deaths=died)
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
        self.holdings.add(*deliveries)  # one lock for the whole take
        return deliveries

    def _malformed(self, d: Delivery, exc: Exception, recorded: bool) -> None:
        """Answer a message that is no kombu envelope as every consumer does
        (:func:`~asyncinfer.wire.envelope.malformed_error`): a FAILURE for the request ID its text
        names, if any; else a log line. Either way it is gone from the queue and from the
        unacknowledged bookkeeping, if the take recorded it."""
        try:
            d.tag = tag_in(d.raw) if recorded else ""
        except Exception:  # noqa: BLE001 - not even its text can be searched
            d.tag = ""
        error = malformed_error(d, exc)
        d.envelope = {}
        if error is None:
            log.error(MALFORMED_DROPPED, d.queue, type(exc).__name__, printable(exc), printable(d.raw))
            if d.tag:
                self.holdings.add(d)
                self.outcomes.acknowledge(d)
            return
        self.holdings.add(d)
        self.outcomes.fail(d, error, retry=False)

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
                status = decode_meta(backend, raw).get("status")
            except Exception:  # noqa: BLE001 - unreadable: run it again
                continue
            if already_answered(status):
                log.info("request %s was redelivered but its result (%s) is already stored; "
                         "acknowledged without running it again", d.request_id, status)
                self.outcomes.acknowledge(d, status)
                answered.add(id(d))
        return [d for d in deliveries if id(d) not in answered]

    # -- admission -----------------------------------------------------------------------------

    def _resume(self, d: Delivery) -> None:
        if self._stopping.is_set():  # left held: sent back to its queue at shutdown
            return
        self.holdings.resume(d)
        self._start(d, waited=True)

    def _start(self, d: Delivery, waited: bool = False) -> None:
        if not d.request_id:
            self.outcomes.acknowledge(d)  # nothing to answer
            log.error("dropped a message without a request ID on %s", d.queue)
            return
        headers = d.headers
        admission = admit(d.request_id, headers.get("task"), d.queue,
                          eta=None if waited else headers.get("eta"), expires=headers.get("expires"))
        if admission.verdict == DELAY:
            # Held, unacknowledged, outside the in-flight bound, until its eta (a retry's backoff).
            self.holdings.schedule(d)
            self.runtime.timer.call_later(admission.delay_s, lambda: self._resume(d))
            return
        self.events.received(d)
        if admission.verdict in (REVOKED, EXPIRED):
            self.outcomes.revoke(d, expired=admission.verdict == EXPIRED)
            return
        # started before it can fail, as a Celery task starts before it raises: Flower counts a
        # request received and never started as prefetched for good
        self.events.started(d)
        if admission.verdict == REFUSED:
            self.outcomes.fail(d, admission.error or InvalidRequest(d.request_id))
            return
        if self.max_worker_deaths and d.deaths >= self.max_worker_deaths:
            self.outcomes.fail(d, WorkerLost(
                f"request {d.request_id}: worker processes died {d.deaths} times while this "
                f"request was on their device (ASYNCINFER_MAX_WORKER_DEATHS={self.max_worker_deaths}"
                f"); it may be what kills them, so it is not run again"), retry=False)
            return
        embed: dict[str, Any] | None = None
        try:
            args, kwargs, embed = decode_body(d, self.policy.max_payload_bytes)
            request, future = self.runtime.submit(
                d.request_id, request_kwargs(d.request_id, args, kwargs), received_at=d.received_at,
                expires_in_s=admission.expires_in_s,
                time_limits=self.policy.limits_for(headers.get("timelimit")),
                alone=d.deaths > 0)  # a worker died with it on the device: no bystanders now
        except AsyncInferError as exc:
            self.outcomes.fail(d, exc, embed)
            return
        except Exception as exc:  # noqa: BLE001 - never lose an accepted request
            log.debug("request %s: unexpected error", d.request_id, exc_info=True)  # fail says it
            self.outcomes.fail(d, exc, embed)
            return
        self.holdings.start(d)
        count_started()
        future.add_done_callback(lambda f: self.outcomes.settle(d, request, f, embed))
