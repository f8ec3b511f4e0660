"""Writes finished requests back: results, acknowledgements and callbacks, one round trip per batch.

Everything finished since the last write goes out in one script call (store.py): per request
the result (SETEX + PUBLISH, Celery's format; a second PUBLISH on the request's reply channel when
it names one, wire/reply.py) and the acknowledgement (kombu's unacked bookkeeping removed); two
calls, results first, when the result backend is another Redis than the broker; a transaction
(MULTI, the script, EXEC) when the batch also pushes retries or dead letters. A request is
acknowledged only in the call that stores its result, so a worker that dies earlier leaves it
unacknowledged, and kombu redelivers it after the visibility timeout. All or nothing: Redis out of
memory refuses the script at its first write, before any acknowledgement (a delete it would
otherwise take), so nothing is acked that is not stored.

A decoupled model's requests also have their streams appended to (stream_appends.py,
stream_write.py): the entries queued since the last write (starts, parts) and the ``final`` of
each outcome, in one script call on the results' Redis before the results are stored; nothing is
called for a batch without them. The STARTED states are written by started_states.py.

Whatever Redis says (out of memory, read-only, a lost connection, a timeout), the writer keeps the
batch and tries again with backoff, so the worker recovers by itself once Redis takes writes again;
a result that cannot be encoded becomes that request's FAILURE instead of blocking the others.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from celery import Celery, states
from celery.exceptions import TaskRevokedError

from asyncinfer.backoff import Backoff
from asyncinfer.broker.connections import wait_replicas
from asyncinfer.broker.leases import holder_of_this_process
from asyncinfer.broker.store import (
    GUARDED,
    Entry,
    StoreScript,
    execute_writes,
    log_refusals,
)
from asyncinfer.broker.take import StartedText
from asyncinfer.config.bound import settings_of
from asyncinfer.constants import is_sequence_list
from asyncinfer.errors import ModelError
from asyncinfer.supervision.vital import vital_thread
from asyncinfer.wire.envelope import result_meta
from asyncinfer.wire.reply import reply_channel_of
from asyncinfer.wire.result_json import encode_meta
from asyncinfer.wire.trace_context import trace_fields
from asyncinfer.worker.links import send_callbacks, send_errbacks
from asyncinfer.worker.output import cache_write, kombu_acks
from asyncinfer.worker.output.outcome import Outcome, add_dead_letter
from asyncinfer.worker.output.started_states import StartedStates
from asyncinfer.worker.output.stream_appends import StreamAppends
from asyncinfer.worker.output.stream_write import StreamAppend, StreamScript, part_entry, start_entry
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["ResultWriter"]

log = logging.getLogger(__name__)

def _nothing(batch: list[Outcome]) -> None:
    pass


class ResultWriter:
    """A thread that stores outcomes in batches and calls ``on_written(outcomes)`` after each.

    Its own thread, so the device thread never waits for Redis: while one batch's results are
    written, the next batch runs (measured: writing from the device thread cut throughput by a
    third at 64 requests in flight and gained nothing at one).
    """

    max_batch = 256

    def __init__(self, app: Celery, broker: redis.Redis,
                 on_written: Callable[[list[Outcome]], None] | None = None, *,
                 worker: str = "",
                 before_write: Callable[[list[Outcome]], None] | None = None,
                 shared: bool | None = None, spans: Any = None) -> None:
        self.app = app
        #: Records the spans of each written batch (trace_spans.py), with tracing on; None: off.
        self.spans = spans
        #: The worker's name, which its dead letters give.
        self.worker = worker
        self.backend = app.backend
        #: The Redis of the acknowledgements, retries and dead letters (the broker's; with a
        #: broker that is not Redis, the results').
        self.broker = broker
        # Results go to the result backend's Redis; acks to the broker's. One pipeline when they
        # are the same server and database.
        self.shared = (str(app.conf.result_backend) == str(app.conf.broker_url) if shared is None
                       else shared)
        self.results: redis.Redis = broker if self.shared else app.backend.client
        settings = settings_of(app)
        #: ASYNCINFER_SUBMIT_REPLICAS: after each write, wait until this many replicas hold it.
        self.replicas = settings.submit_replicas if settings is not None else 0
        self.replicas_timeout_ms = (max(1, int(settings.submit_replicas_timeout_s * 1000))
                                    if settings is not None else 1000)
        self.expires_s = int(app.conf.result_expires.total_seconds()
                             if hasattr(app.conf.result_expires, "total_seconds")
                             else app.conf.result_expires or 0)
        # acknowledging only what this worker's leases still hold (leases.py's holder name)
        self.store = StoreScript(broker, self.expires_s,
                                 holder_of_this_process(worker) if worker else "")
        #: Decoupled models' streams, where the results live (stream_write.py), and the entries
        #: of the batch being written, not yet appended (stream_appends.py).
        self.streams = StreamScript(self.results, self.expires_s)
        self._appends = StreamAppends()
        #: Successful answers of response-cached models, written with their part.
        self._cache_writes = cache_write.CacheWrites(app)
        #: The STARTED states (started_states.py).
        self._started = StartedStates(self.backend, self.store, self.results, self.shared,
                                      self.expires_s)
        #: Called with each batch before its first write (may change outcomes: the retry budget),
        #: and after it is written.
        self.before_write: Callable[[list[Outcome]], None] = before_write or _nothing
        self.on_written: Callable[[list[Outcome]], None] = on_written or _nothing
        self._queue: queue.SimpleQueue[Outcome | list[Outcome] | StreamAppend | None] = (
            queue.SimpleQueue())
        #: Outcomes a thread is gathering (:meth:`gathering`).
        self._gathered = threading.local()
        self._thread = vital_thread(self._run, "asyncinfer-results")
        self._thread.start()

    def put(self, outcome: Outcome) -> None:
        """Queue one outcome for the next write (at the end of this thread's
        :meth:`gathering`, when it gathers)."""
        gathered = getattr(self._gathered, "outcomes", None)
        if gathered is not None:
            gathered.append(outcome)
        else:
            self._queue.put(outcome)

    def stream_start(self, d: TakenMessage, worker: str) -> None:
        """Queue the ``start`` of ``d``, a decoupled model's request (``d.stream_max_parts``
        set), on ``worker``; before any of its parts."""
        self._queue.put(start_entry(d, worker))

    def stream_part(self, d: TakenMessage, index: int, outputs: list[Any]) -> None:
        """Queue part ``index`` of ``d`` (its v2 output tensors), encoded here (the caller's
        thread: the device's)."""
        self._queue.put(part_entry(d, index, outputs))

    @contextlib.contextmanager
    def gathering(self) -> Iterator[None]:
        """Hand the outcomes this thread puts meanwhile to the writer at once, as it leaves (a
        batch's results: one write for all of them, where the writer would wake at the first and
        write them in two or three parts while the rest are still being made — sim-fast, 256 in
        flight: ~1.7 writes per device batch). Nested, the outermost hands them over."""
        if getattr(self._gathered, "outcomes", None) is not None:
            yield
            return
        gathered: list[Outcome] = []
        self._gathered.outcomes = gathered
        try:
            yield
        finally:
            self._gathered.outcomes = None
            if gathered:
                self._queue.put(gathered)

    def started(self, pipe: Any, deliveries: list[TakenMessage], hostname: str) -> None:
        """Add the STARTED states of ``deliveries`` to ``pipe`` (Celery's
        ``task_track_started``), a plain pipeline of :attr:`results`, as one store call."""
        self._started.add(pipe, deliveries, hostname)

    def store_started(self, deliveries: list[TakenMessage], hostname: str) -> None:
        """Store the STARTED states of ``deliveries`` now (those the take did not: a redelivered
        request not answered yet, a result backend other than the broker). A courtesy: the
        requests are safely recorded whatever Redis says."""
        self._started.store_now(deliveries, hostname)

    def started_for_take(self, hostname: str) -> StartedText | None:
        """What the take stores as STARTED (take.py), when it can: the results live on the
        broker."""
        return self._started.for_take(hostname)

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self.spans is not None:
            self.spans.close()

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            batch: list[Outcome] = []
            appends: list[StreamAppend] = []
            while True:
                if item is None:
                    stopping = True
                    break
                if isinstance(item, list):
                    batch += item
                elif isinstance(item, StreamAppend):
                    appends.append(item)
                else:
                    batch.append(item)
                if len(batch) + len(appends) >= self.max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch or appends:
                self._write(batch, appends)

    def _write(self, batch: list[Outcome], appends: list[StreamAppend] | None = None) -> None:
        self._appends.begin(appends or [])
        write_started = time.perf_counter() if self.spans is not None else 0.0
        self._store_all(batch)
        if not batch:
            return
        self._wait_replicas(batch)
        write_ended = time.perf_counter() if self.spans is not None else 0.0
        delivered = [(o.delivery, o.retry) for o in batch if o.delivery.message is not None]
        if delivered:  # kombu's messages: acknowledged through kombu, now they are stored
            kombu_acks.acknowledge(self.app, delivered)
        self.on_written(batch)
        for outcome in batch:
            if outcome.embed and not outcome.superseded:
                self._call_links(outcome)
        if self.spans is not None:  # made on the spans' own thread: no write waits for them
            self.spans.hand_over(batch, write_started, write_ended)

    def _store_all(self, batch: list[Outcome]) -> None:
        """Store ``batch``, trying again until Redis takes it. A transaction Redis refuses for
        memory is split in halves, down to one request each: queued commands count towards
        ``maxmemory`` until EXEC, so a large batch can be refused where its parts fit."""
        backoff = Backoff()
        budgeted = False
        parts = [batch]  # a batch of stream entries alone: one empty part
        while parts:
            part = parts[0]
            try:
                if not budgeted:  # the retry budget is asked once per batch, however many tries
                    self.before_write(batch)
                    budgeted = True
                self._store_part(part)
                parts.pop(0)
                backoff.reset()
                continue
            except redis.OutOfMemoryError as exc:
                if len(part) > 1:
                    half = len(part) // 2
                    parts[0:1] = [part[:half], part[half:]]
                    log.debug("storing %d results: out of memory, in halves (%s)", len(part), exc)
                    continue
                error: redis.RedisError = exc
            except redis.RedisError as exc:
                error = exc
            # The requests stay unacknowledged until this succeeds: nothing is lost.
            wait_s = backoff.failed()
            log.warning("storing %d results failed (%s: %s); retrying in %.1f s", len(part),
                        type(error).__name__, error, wait_s)
            time.sleep(wait_s)

    def _store_part(self, part: list[Outcome]) -> None:
        """One script call: the results of ``part`` and their acknowledgements (two, results
        first, when the result backend is another Redis than the broker; inside a transaction
        with the retries and dead letters the part pushes, when it pushes any)."""
        pushes = self.broker.pipeline(transaction=True)
        self._cache_writes.clear()  # what a refused try of this part gathered
        entries = [e for e in (self._add_safely(pushes, outcome) for outcome in part)
                   if e[0] or e[3]]  # a result to store or a message to acknowledge
        self._appends.append(part, self.streams)
        # their traces go (a stored result of any state says from now on that each exists):
        # on the broker, where the producers wrote them (publisher.py)
        untraced = [o.delivery.request_id for o in part if o.store and o.delivery.request_id]
        acks = entries
        left: list[str] = []  # the result keys the store left out (store.py: guarded entries)
        if not self.shared:
            results = [(k, v, r, "", g) for k, v, r, _, g in entries if k]
            if results:
                errors, left = self.store.call(results, self.results)
                log_refusals(errors)
            acks = [("", "", "", tag, "") for _, _, _, tag, _ in entries if tag]
        if self._cache_writes and not pushes.command_stack:
            errors, more = cache_write.store_with_cache(self.broker, self.store, acks,
                                                        self._cache_writes, untraced)
            log_refusals(errors)
        elif not pushes.command_stack:
            more = []
            if acks or untraced:
                errors, more = self.store.call(acks, self.broker, untraced)
                log_refusals(errors)
        else:
            self._cache_writes.queue(pushes)
            if acks or untraced:
                self.store(acks, pushes, untraced)
            more = execute_writes(pushes, stored=bool(acks or untraced))
        self._superseded(part, left + more)

    def _superseded(self, part: list[Outcome], keys: list[str]) -> None:
        """Mark the outcomes of ``part`` whose result the store left out: a sequence request
        whose request already had a final state (another worker's sweep failed it with
        SequenceStateLost while this worker was frozen or cut off past its lease)."""
        if not keys:
            return
        left = set(keys)
        for outcome in part:
            d = outcome.delivery
            key = self.backend.get_key_for_task(d.request_id) if d.request_id else ""
            if (key.decode() if isinstance(key, bytes) else key) in left:
                outcome.superseded = True
                log.warning("request %s: not stored: it already has a final state (its sequence's "
                            "worker was taken for gone and the request failed, while this worker "
                            "ran it); the state it left is taken back", d.request_id)

    def _wait_replicas(self, batch: list[Outcome]) -> None:
        """Wait until ``replicas`` replicas hold this batch's results and acks; a shortfall is
        logged (they are written on the master; nothing is undone)."""
        if not self.replicas:
            return
        for client in [self.broker] if self.shared else [self.results, self.broker]:
            try:
                confirmed = wait_replicas(client, self.replicas, self.replicas_timeout_ms)
            except redis.RedisError as exc:
                log.warning("could not wait for replicas of %d results (%s)", len(batch), exc)
                continue
            if confirmed < self.replicas:
                log.warning("%d results are on the Redis master, but %d of %d replicas confirmed "
                            "them within %d ms (ASYNCINFER_SUBMIT_REPLICAS): a failover now could "
                            "lose them", len(batch), confirmed, self.replicas,
                            self.replicas_timeout_ms)

    def _add_safely(self, pushes: Any, outcome: Outcome) -> Entry:
        """:meth:`_add`, or — when the result cannot be encoded — that request's FAILURE."""
        try:
            return self._add(pushes, outcome)
        except redis.RedisError:
            raise
        except Exception as exc:  # noqa: BLE001 - one request's result, not the whole batch
            d = outcome.delivery
            log.exception("request %s: its result could not be stored", d.request_id)
            outcome.state, outcome.result, outcome.retry, outcome.embed = (
                states.FAILURE, ModelError(f"request {d.request_id}: its result could not be "
                                           f"stored ({type(exc).__name__}: {exc})"), None, None)
            return self._add(pushes, outcome)

    def _add(self, pushes: Any, outcome: Outcome) -> Entry:
        """``outcome``'s entry for the store script; its retry message and dead letter, if any,
        on ``pushes`` (a broker transaction)."""
        d = outcome.delivery
        kombu = d.message is not None  # acknowledged (its retry sent) through kombu, after
        if outcome.retry is not None and not kombu:
            pushes.lpush(d.list_key, outcome.retry)
        key, value, reply_to = "", "", ""
        if d.request_id and outcome.store:
            result = outcome.result
            if isinstance(result, BaseException):
                result = self.backend.prepare_exception(result)
            meta = result_meta(d.request_id, outcome.state, result,
                               parent_id=d.headers.get("parent_id"))
            key = self.backend.get_key_for_task(d.request_id)
            value = encode_meta(self.backend, meta)
            if meta["status"] in states.READY_STATES:
                reply_to = reply_channel_of(d.headers) or ""
            if outcome.state == states.SUCCESS and d.cache_key and self.shared:
                self._cache_writes.add(d, outcome.result)
        add_dead_letter(pushes, self.app, outcome, self.worker)
        # no tag: a malformed message never recorded, or one of kombu's; a sequence request's
        # result (taken from a sequence worker's own list) never replaces a final state
        guard = GUARDED if is_sequence_list(d.list_key) else ""
        return key, value, reply_to, "" if kombu else d.tag or "", guard

    def _call_links(self, outcome: Outcome) -> None:
        """Celery's ``link``, ``link_error`` and chains, as its tracer calls them."""
        embed = outcome.embed or {}
        d = outcome.delivery
        root_id = d.headers.get("root_id") or d.request_id
        try:
            if outcome.state == states.SUCCESS:
                send_callbacks(self.app, embed, d.request_id, root_id, outcome.result,
                               trace_fields(d.headers))
            elif outcome.state == states.FAILURE or isinstance(outcome.result, TaskRevokedError):
                send_errbacks(self.app, embed.get("errbacks"), d.request_id, root_id)
                # As Celery does: the tasks a chain would have run next fail with this error too,
                # so whoever waits on the chain's last task hears of it.
                for element in embed.get("chain") or ():
                    task_id = (element.get("options") or {}).get("task_id")
                    if task_id:
                        self.backend.store_result(task_id, outcome.result, outcome.state)
        except Exception:  # noqa: BLE001 - a broken callback must not stop the writer
            log.exception("request %s: calling its callbacks failed", d.request_id)
