"""A request's life on a device worker, top to bottom: take → admit → decode → batch → run →
settle → write.

1. **take** — the transport hands over what it took: the fast consumer (the atomic take script,
   leases, the single wake) what it popped and recorded, list by list (:meth:`Pipeline.took`);
   Celery's consumer, through kombu, each message it received (:meth:`Pipeline.received`).
2. **parse** — each message must be a kombu envelope; one that is not fails alone
   (:func:`~asyncinfer.wire.envelope.malformed_error`: a FAILURE for the request ID its text
   names, else a log line) and the others go on.
3. **answered before** — a redelivered request whose final result is already stored (a worker
   died between storing it and the acknowledgement) is acknowledged without running again.
4. **admit** — :func:`~asyncinfer.worker.lifecycle.admit`: held until its ``eta`` (a retry's
   backoff), refused when it is not ``asyncinfer.infer``, revoked or expired; then the fleet's
   rule: a request that saw ``ASYNCINFER_MAX_WORKER_DEATHS`` deaths on a device fails with
   ``WorkerLost``, one that saw any runs in a device batch of its own.
5. **decode** — arguments and payload limit (wire/envelope.py), the v2 request
   (wire/protocol.py); bad input fails naming the request and the rule.
6. **batch, run** — the model's runner (engine/): batcher, device, time limits. A decoupled
   model's request gets its stream's ``start`` first, and each part goes to the writer as its
   step is made (engine/streaming.py, output/stream_write.py).
7. **settle** — outcomes.py: success, failure, revocation or retry (the task's retry options and
   the fleet's retry budget), announced once (lifecycle.py: log line, metrics, events).
8. **write** — result_writer.py: results, acknowledgements, retries and dead letters in one round
   trip per batch; links and errbacks sent after.

Every consumer feeds it: the fast consumer (the Redis lists) and Celery's consumer through kombu
(RabbitMQ, ``ASYNCINFER_CONSUMER=celery``, an ``asyncinfer.infer`` on a stage queue); what
differs is only the transport (docs/architecture.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from itertools import groupby
from operator import itemgetter
from typing import Any

from celery import Celery

from asyncinfer.broker.take import MAX_ENVELOPE_DEPTH, Popped
from asyncinfer.constants import TASK_NAME, queue_of_list
from asyncinfer.errors import AsyncInferError, InvalidRequest, WorkerLost
from asyncinfer.policy.admission import DELAY, EXPIRED, REFUSED, REVOKED
from asyncinfer.policy.policy import Policy
from asyncinfer.wire.clock import now_s
from asyncinfer.wire.envelope import (
    MALFORMED_DROPPED,
    decode_body,
    malformed_error,
    parse_envelope,
    printable,
    priority_in,
    tag_in,
)
from asyncinfer.wire.messages import SENT_AT
from asyncinfer.wire.protocol import request_kwargs
from asyncinfer.worker.events import TaskEvents
from asyncinfer.worker.lifecycle import admit, count_started
from asyncinfer.worker.output.cache_write import cache_key_of
from asyncinfer.worker.output.outcomes import Outcomes
from asyncinfer.worker.output.shard_writers import ShardWriters
from asyncinfer.worker.requests.first_attempts import FirstAttempts
from asyncinfer.worker.requests.holdings import SCHEDULED, Holding, Holdings
from asyncinfer.worker.requests.taken import TakenMessage
from asyncinfer.worker.runtime import WorkerRuntime

__all__ = ["Pipeline"]

log = logging.getLogger(__name__)


class Pipeline:
    """What happens to the requests one consumer takes, from the take to the write.

    ``stopping()``: whether the consumer stops (a request whose ``eta`` comes then stays held,
    and is given back with the rest). ``traced``: tracing is on (each request's headers go to the
    device with it, as its trace tag).
    """

    def __init__(self, app: Celery, runtime: WorkerRuntime, policy: Policy, *, hostname: str,
                 holdings: Holdings, outcomes: Outcomes, writer: ShardWriters, events: TaskEvents,
                 stopping: Callable[[], bool], traced: bool = False) -> None:
        self.app = app
        self.runtime = runtime
        self.policy = policy
        self.hostname = hostname
        self.holdings = holdings
        self.outcomes = outcomes
        self.writer = writer
        self.events = events
        self.stopping = stopping
        #: First attempts, counted towards the fleet's retry budget off the requests' path.
        self.first_attempts = FirstAttempts(policy.retries)
        #: Whether requests carry their headers to the device as their trace tag (tracing on:
        #: their batch's record names them; the result writer records the spans).
        self.traced = traced
        #: The last hang noted against a request ('' for none: policy/hangs.py), named when
        #: its deaths fail it.
        self.death_note: Callable[[TakenMessage], str] = lambda d: ""

    # -- 1-3: take, parse, answered before ---------------------------------------------------------

    def took(self, taken: list[Popped], shard: int = 0) -> None:
        """Start what the take script popped and recorded on ``shard``; store the STARTED states
        it did not."""
        self._go(self._taken(taken, shard))

    def _taken(self, taken: list[Popped], shard: int) -> list[TakenMessage]:
        """What the take script popped on ``shard``, parsed and held (each message that is not a
        kombu envelope answered alone)."""
        received_at = time.perf_counter()
        deliveries: list[TakenMessage] = []
        for key, group in groupby(taken, key=itemgetter(0)):  # the script takes list by list
            queue = queue_of_list(key)
            deliveries += self._parse([(TakenMessage(raw=raw, queue=queue, received_at=received_at,
                                                     key=key, started=started, deaths=died,
                                                     shard=shard,
                                                     body_cut_bytes=max(0, -rec)), rec != 0)
                                       for _, raw, rec, started, died in group])
        return deliveries

    def refuse(self, taken: list[Popped],
               error_of: Callable[[TakenMessage, Mapping[str, Any]], BaseException],
               shard: int = 0) -> None:
        """Fail what the take script popped and recorded, without running any of it (the
        requests a dead worker's own list held: worker/requests/sequence_pins.py); ``error_of(d,
        v2)`` is each one's error (``v2``: its request, ``{}`` when it does not decode)."""
        deliveries = self._taken(taken, shard)
        with self.writer.gathering():
            for d in deliveries:
                try:
                    args, kwargs, _ = decode_body(d, self.policy.max_payload_bytes)
                    v2: Mapping[str, Any] = request_kwargs(d.request_id, args, kwargs)
                except Exception:  # noqa: BLE001 - it fails either way; its error says less
                    v2 = {}
                self.outcomes.fail(d, error_of(d, v2), retry=False)

    def received(self, messages: list[TakenMessage]) -> None:
        """Start ``messages`` that a transport other than the take script received (kombu:
        Celery's consumer on RabbitMQ, or with ``ASYNCINFER_CONSUMER=celery``), each holding its
        text as a kombu envelope, recorded as unacknowledged by the transport itself."""
        self._go(self._parse([(m, True) for m in messages]))

    def _go(self, deliveries: list[TakenMessage]) -> None:
        # before STARTED is stored over the answer a redelivered request may already have
        deliveries = self._skip_answered(deliveries)
        if self.policy.track_started:  # those the take did not store: before they run
            self.writer.store_started([d for d in deliveries
                                       if not d.started and self._should_start(d)], self.hostname)
        self._start_all(deliveries)
        self.first_attempts.add(deliveries)  # after: the budget's count is not on their path
        self._count_redis_waits(deliveries)

    def _count_redis_waits(self, deliveries: list[TakenMessage]) -> None:
        """Add how long each message lay in Redis (its ``asyncinfer_sent_at`` → now) to the
        statistics of its model, one call per model of the take."""
        now = now_s()  # both on the broker's clock
        waits: dict[str, list[float]] = {}
        for d in deliveries:
            sent = (d.envelope.get("properties") or {}).get(SENT_AT)
            model = d.model
            if isinstance(sent, (int, float)) and model is not None:
                waits.setdefault(model, []).append(now - sent)
        for model, model_waits in waits.items():
            self.runtime.metrics.stats.record_redis_waits(model, model_waits)

    def _parse(self, taken: list[tuple[TakenMessage, bool]]) -> list[TakenMessage]:
        """The messages of ``taken`` that are kombu envelopes, held; each other one answered
        alone. ``recorded``: whether the transport recorded it as unacknowledged."""
        deliveries = []
        for d, recorded in taken:
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

    def _malformed(self, d: TakenMessage, exc: Exception, recorded: bool) -> None:
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
            if d.tag or d.message is not None:  # recorded by its transport: acknowledged there
                self.holdings.add(d)
                self.outcomes.acknowledge(d)
            return
        self.holdings.add(d)
        self.outcomes.fail(d, error, retry=False)

    @staticmethod
    def _should_start(d: TakenMessage) -> bool:
        return bool(d.request_id) and d.headers.get("task") == TASK_NAME and not d.headers.get("eta")

    def _skip_answered(self, deliveries: list[TakenMessage]) -> list[TakenMessage]:
        """Acknowledge, without running them again, redelivered requests whose result is already
        stored (a worker died between storing the result and the acknowledgement)."""
        again = [d for d in deliveries if d.headers.get("redelivered") and d.request_id]
        if not again:
            return deliveries
        answered = self.writer.answered_before(self.app.backend, again)
        if not answered:
            return deliveries
        for d in again:
            if d.request_id in answered:
                self.outcomes.acknowledge(d, answered[d.request_id])
        return [d for d in deliveries if d.request_id not in answered]

    def forget(self, tags: list[str]) -> int:
        """The messages of ``tags`` are leased to another worker now (this one renewed too late:
        frozen, or cut off from Redis), and back on their queues or taken there: give up those
        that have not started here — waiting for their eta, or in a batcher — so that they run
        once, there. Those on the device run on (at least once). Nothing is written or
        acknowledged for them here. How many were given up."""
        lost = set(tags)
        taken = [h for h in self.holdings.held() if h.delivery.tag in lost]
        for h in taken:  # those in a batch formed already stop at the launch gate
            h.delivery.lost = True
        return self._give_up(taken)

    def forget_kombu(self) -> int:
        """kombu's connection to a broker whose acknowledgements belong to the channel that
        delivered (RabbitMQ) is lost: the broker gives back everything that connection held, to
        other workers at once, so what kombu delivered here and has not started is given up as
        :meth:`forget` gives it up (after the path heals it would run a second time; nothing of
        it could be acknowledged anyway). Those on the device run on. How many were given up."""
        return self._give_up([h for h in self.holdings.held() if h.delivery.message is not None])

    def _give_up(self, taken: list[Holding]) -> int:
        """Give up ``taken`` (held here) that have not started; how many."""
        if not taken:
            return 0
        scheduled = [h.delivery for h in taken if h.state == SCHEDULED]
        withdrawn = self.runtime.withdraw({h.delivery.request_id for h in taken
                                           if h.state != SCHEDULED and h.delivery.request_id})
        given_up = scheduled + [h.delivery for h in taken if h.delivery.request_id in withdrawn]
        self.holdings.release(given_up)
        if given_up:
            log.warning("gave up %d of them that had not started here (they run where they went)",
                        len(given_up))
        return len(given_up)

    def forgotten(self, tags: list[str]) -> list[tuple[str, str, str]]:
        """Redis forgot the messages of ``tags`` (no holder, never put back: restarted without
        its data, or a failover to a replica behind), and nobody else can have them: what to
        lease again — (tag, the list it came from, kombu's unacked entry) — of those held here
        and not answered yet (an answer stored is acknowledged as it is)."""
        forgotten = set(tags)
        held = [h.delivery for h in self.holdings.held() if h.delivery.tag in forgotten]
        answered = self.writer.answered_before(self.app.backend,
                                               [d for d in held if d.request_id])
        return [(d.tag, d.list_key, d.unacked_entry) for d in held
                if d.request_id not in answered]

    # -- 4-6: admit, decode, batch -----------------------------------------------------------------

    def _start_all(self, deliveries: list[TakenMessage]) -> None:
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

    def _stream(self, d: TakenMessage, max_parts: int) -> Callable[[int, list[Any]], None]:
        """``d`` goes to a decoupled model: its stream gets a ``start`` now, each part as it is
        made, and a ``final`` with its outcome (result_writer.py); where its parts go."""
        d.stream_max_parts = max_parts
        self.writer.stream_start(d, self.hostname)
        return lambda index, outputs: self.writer.stream_part(d, index, outputs)

    def _resume(self, d: TakenMessage) -> None:
        if self.stopping():  # left held: sent back to its queue at shutdown
            return
        if not self.holdings.holds(d):  # given up meanwhile (forget)
            return
        self.holdings.resume(d)
        self._start(d, waited=True)

    def _start(self, d: TakenMessage, waited: bool = False) -> None:
        if not d.request_id:
            self.outcomes.acknowledge(d)  # nothing to answer
            log.error("dropped a message without a request ID on %s", d.queue)
            return
        headers = d.headers
        policy = self.policy
        # the shared admission (lifecycle.admit: eta, allow-list, revocation, expiry), then the
        # fleet's rule on deaths
        admission = admit(d.request_id, headers.get("task"), d.queue,
                          eta=None if waited else headers.get("eta"), expires=headers.get("expires"),
                          expiry=policy.expiry)
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
        # a hang is never the host's fault: it counts as two deaths (the rerun with its batch-mates
        # is skipped), and names itself when the request fails for its deaths
        note = self.death_note(d) if d.deaths else ""
        lost = policy.deaths.judge(d.request_id, d.deaths, hung=bool(note))
        if lost is not None:
            error = lost.error or WorkerLost(d.request_id)
            if note:
                error = WorkerLost(f"{error}; the last was a hang: {note}")
            self.outcomes.fail(d, error, retry=False)
            return
        embed: dict[str, Any] | None = None
        try:
            args, kwargs, embed = decode_body(d, self.policy.max_payload_bytes)
            v2 = request_kwargs(d.request_id, args, kwargs)
            request, future = self.runtime.submit(
                d.request_id, v2, received_at=d.received_at,
                expires_in_s=admission.expires_in_s,
                time_limits=self.policy.limits_for(headers.get("timelimit")),
                alone=policy.deaths.alone(d.deaths, bool(note)),
                suspect=policy.deaths.suspect(d.deaths, bool(note)),
                priority=priority_in(d.envelope.get("properties")),
                trace=headers if self.traced else None,
                streaming=lambda max_parts: self._stream(d, max_parts))
        except AsyncInferError as exc:
            self.outcomes.fail(d, exc, embed)
            return
        except Exception as exc:  # noqa: BLE001 - never lose an accepted request
            log.debug("request %s: unexpected error", d.request_id, exc_info=True)  # fail says it
            self.outcomes.fail(d, exc, embed)
            return
        # -- 7-8: settle and write, once the device is done (outcomes.py, result_writer.py)
        d.cache_key = cache_key_of(self.app, d, v2)
        self.holdings.start(d)
        count_started()
        future.add_done_callback(lambda f: self.outcomes.settle(d, request, f, embed))
