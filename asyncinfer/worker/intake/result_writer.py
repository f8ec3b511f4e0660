"""Writes finished requests back: results, acknowledgements and callbacks, one round trip per batch.

Everything finished since the last write goes out in one Redis transaction (MULTI/EXEC): per
request the result (SETEX + PUBLISH, Celery's format; a second PUBLISH on the request's reply
channel when it names one, wire/reply.py) and the acknowledgement (kombu's unacked
bookkeeping removed); two transactions, results first, when the result backend is another Redis
than the broker. A request is acknowledged only in the transaction that stores its result, so a
worker that dies earlier leaves it unacknowledged, and kombu redelivers it after the visibility
timeout. A transaction, not a plain pipeline: Redis out of memory refuses the SETEX but would take
the acknowledgement (a delete) — inside MULTI it refuses the whole write, and nothing is acked.

Whatever Redis says (out of memory, read-only, a lost connection, a timeout), the writer keeps the
batch and tries again with backoff, so the worker recovers by itself once Redis takes writes again;
a result that cannot be encoded becomes that request's FAILURE instead of blocking the others.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery, states
from celery.exceptions import TaskRevokedError

from asyncinfer.config.bound import settings_of
from asyncinfer.connections import wait_replicas
from asyncinfer.engine.vital import vital_thread
from asyncinfer.errors import ModelError
from asyncinfer.keys import UNACKED_INDEX_KEY, UNACKED_KEY
from asyncinfer.wire.envelope import Delivery, result_meta
from asyncinfer.wire.reply import reply_channel_of
from asyncinfer.wire.result_json import encode_meta
from asyncinfer.worker import dead_letters

__all__ = ["Outcome", "ResultWriter"]

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """How one request ended: a state and its result (a response, or an exception)."""

    delivery: Delivery
    state: str
    result: Any
    embed: dict[str, Any] | None = None
    #: For state RETRY: the message that retries the request (:func:`retry_message`).
    retry: str | None = None
    #: False to acknowledge only (the result is already stored: a redelivered duplicate).
    store: bool = True


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
                 on_written: Callable[[list[Outcome]], None] | None = None) -> None:
        self.app = app
        self.backend = app.backend
        self.broker = broker
        # Results go to the result backend's Redis; acks to the broker's. One pipeline when they
        # are the same server and database.
        self.shared = str(app.conf.result_backend) == str(app.conf.broker_url)
        self.results: redis.Redis = broker if self.shared else app.backend.client
        settings = settings_of(app)
        #: ASYNCINFER_SUBMIT_REPLICAS: after each write, wait until this many replicas hold it.
        self.replicas = settings.submit_replicas if settings is not None else 0
        self.replicas_timeout_ms = (max(1, int(settings.submit_replicas_timeout_s * 1000))
                                    if settings is not None else 1000)
        self.expires_s = int(app.conf.result_expires.total_seconds()
                             if hasattr(app.conf.result_expires, "total_seconds")
                             else app.conf.result_expires or 0)
        #: Called with each batch before its first write (may change outcomes: the retry budget),
        #: and after it is written.
        self.before_write: Callable[[list[Outcome]], None] = _nothing
        self.on_written: Callable[[list[Outcome]], None] = on_written or _nothing
        self._queue: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self._thread = vital_thread(self._run, "asyncinfer-results")
        self._thread.start()

    def put(self, outcome: Outcome) -> None:
        """Queue one outcome for the next write."""
        self._queue.put(outcome)

    def started(self, pipe: Any, delivery: Delivery, hostname: str) -> None:
        """Add the STARTED state of ``delivery`` to ``pipe`` (Celery's ``task_track_started``);
        ``pipe`` is a pipeline of :attr:`results`."""
        meta = result_meta(delivery.request_id, states.STARTED,
                           {"pid": os.getpid(), "hostname": hostname})
        self._store(pipe, delivery.request_id, meta)

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _store(self, pipe: Any, request_id: str, meta: dict[str, Any],
               reply_to: str | None = None) -> None:
        key = self.backend.get_key_for_task(request_id)
        value = encode_meta(self.backend, meta)
        if self.expires_s:
            pipe.setex(key, self.expires_s, value)
        else:
            pipe.set(key, value)
        pipe.publish(key, value)
        if reply_to is not None and meta["status"] in states.READY_STATES:
            pipe.publish(reply_to, value)  # the producer's reply channel (wire/reply.py)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            batch = [] if first is None else [first]
            stopping = first is None
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            if batch:
                self._write(batch)

    def _write(self, batch: list[Outcome]) -> None:
        self._store_all(batch)
        self._wait_replicas(batch)
        self.on_written(batch)
        for outcome in batch:
            if outcome.embed:
                self._call_links(outcome)

    def _store_all(self, batch: list[Outcome]) -> None:
        """Store ``batch``, trying again until Redis takes it. A transaction Redis refuses for
        memory is split in halves, down to one request each: queued commands count towards
        ``maxmemory`` until EXEC, so a large batch can be refused where its parts fit."""
        backoff_s = 0.1
        budgeted = False
        parts = [batch]
        while parts:
            part = parts[0]
            try:
                if not budgeted:  # the retry budget is asked once per batch, however many tries
                    self.before_write(batch)
                    budgeted = True
                self._store_part(part)
                parts.pop(0)
                backoff_s = 0.1
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
            log.warning("storing %d results failed (%s: %s); retrying in %.1f s", len(part),
                        type(error).__name__, error, backoff_s)
            time.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)

    def _store_part(self, part: list[Outcome]) -> None:
        """One transaction: the results of ``part`` and their acknowledgements (two, results
        first, when the result backend is another Redis than the broker)."""
        acks = self.broker.pipeline(transaction=True)
        results = acks if self.shared else self.results.pipeline(transaction=True)
        for outcome in part:
            self._add_safely(results, acks, outcome)
        if not self.shared:
            self._execute(results)  # results first: an ack never precedes its result
        self._execute(acks)

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

    @staticmethod
    def _execute(pipe: Any) -> None:
        """EXEC a transaction. A refusal before EXEC (out of memory, read-only: nothing was
        written) raises, to be tried again; an error reply of one command inside it (all others
        done) is logged, as trying again would repeat the others."""
        for reply in pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception):
                log.error("a result write was refused by Redis: %s", reply)

    def _add_safely(self, results: Any, acks: Any, outcome: Outcome) -> None:
        """:meth:`_add`, or — when the result cannot be encoded — that request's FAILURE."""
        try:
            self._add(results, acks, outcome)
        except redis.RedisError:
            raise
        except Exception as exc:  # noqa: BLE001 - one request's result, not the whole batch
            d = outcome.delivery
            log.exception("request %s: its result could not be stored", d.request_id)
            outcome.state, outcome.result, outcome.retry, outcome.embed = (
                states.FAILURE, ModelError(f"request {d.request_id}: its result could not be "
                                           f"stored ({type(exc).__name__}: {exc})"), None, None)
            self._add(results, acks, outcome)

    def _add(self, results: Any, acks: Any, outcome: Outcome) -> None:
        d = outcome.delivery
        if outcome.retry is not None:
            acks.lpush(d.list_key, outcome.retry)
        if d.request_id and outcome.store:
            result = outcome.result
            if isinstance(result, BaseException):
                result = self.backend.prepare_exception(result)
            meta = result_meta(d.request_id, outcome.state, result,
                               parent_id=d.headers.get("parent_id"))
            self._store(results, d.request_id, meta, reply_channel_of(d.headers))
        dead_letters.add_to(acks, self.app, outcome)  # a final FAILURE of a model that opted in
        if d.tag:  # a malformed message was never recorded as unacknowledged
            acks.zrem(UNACKED_INDEX_KEY, d.tag)
            acks.hdel(UNACKED_KEY, d.tag)

    def _call_links(self, outcome: Outcome) -> None:
        """Celery's ``link``, ``link_error`` and chains, as its tracer calls them."""
        embed = outcome.embed or {}
        d = outcome.delivery
        root_id = d.headers.get("root_id") or d.request_id
        try:
            if outcome.state == states.SUCCESS:
                for callback in embed.get("callbacks") or ():
                    self.app.signature(callback).apply_async(
                        (outcome.result,), parent_id=d.request_id, root_id=root_id)
                chain = list(embed.get("chain") or ())
                if chain:
                    nxt = self.app.signature(chain.pop())
                    nxt.apply_async((outcome.result,), chain=chain, parent_id=d.request_id,
                                    root_id=root_id)
            elif outcome.state == states.FAILURE or isinstance(outcome.result, TaskRevokedError):
                for errback in embed.get("errbacks") or ():
                    self.app.signature(errback).apply_async(
                        (d.request_id,), parent_id=d.request_id, root_id=root_id)
                # As Celery does: the tasks a chain would have run next fail with this error too,
                # so whoever waits on the chain's last task hears of it.
                for element in embed.get("chain") or ():
                    task_id = (element.get("options") or {}).get("task_id")
                    if task_id:
                        self.backend.store_result(task_id, outcome.result, outcome.state)
        except Exception:  # noqa: BLE001 - a broken callback must not stop the writer
            log.exception("request %s: calling its callbacks failed", d.request_id)
