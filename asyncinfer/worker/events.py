"""Celery task events of the fast consumer, so Flower and ``celery events`` see every request.

The fast consumer bypasses Celery's request path, which is what sends ``task-received``,
``task-started``, ``task-succeeded``, ``task-failed``, ``task-revoked`` and ``task-retried``;
this sends the same events with the fields Celery's worker gives them
(``celery/worker/strategy.py``, ``celery/worker/request.py``) and those Celery's dispatcher adds
(hostname, utcoffset, pid, the app's Lamport clock, timestamp), on the dispatcher's exchange and
producer, buffered as Celery's worker buffers task events: one publish of a list of events
(routing key ``task.multi``, which ``EventReceiver`` and Flower read).
The publishing is paced: what is buffered goes out at once after a quiet spell, then at most once
per ``FLUSH_INTERVAL_S`` while requests keep coming (a flusher thread of its own), so an event is
at most that late. Publishing once per intake and per written batch instead cost 16 % of the
worker's CPU on sim-fast at 256 in flight (a kombu publish is ~0.5 ms: message, UUID, JSON, pool
check-out, PUBLISH); and the events are buffered and written here (orjson) rather than by the
dispatcher and kombu's JSON, which cost as much again. Nothing is built when events are off.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Any

import orjson
from celery import Celery, states
from celery.utils.saferepr import saferepr
from celery.utils.time import utcoffset

from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["TaskEvents"]

log = logging.getLogger(__name__)

#: Celery's ``resultrepr_maxsize``: a result is shown as a repr cut to this many characters.
_RESULT_REPR_MAX = 1024
#: Events buffered before a publish even without a flush.
_BUFFER_LIMIT = 512
#: While events keep coming, they are published at most this often (seconds).
FLUSH_INTERVAL_S = 0.1
#: Events kept for the next try while the broker cannot take them; older ones are dropped.
_KEPT_LIMIT = 10_000
#: A publish that finds the connection gone (the broker restarted, closed it, a partition healed)
#: connects again once, at once, then publishes: without it the connection stays dead and every
#: event after it is dropped until the worker restarts. A broker still away fails the flush (the
#: events are kept); the next flush tries again.
_RECONNECT_ONCE = {"max_retries": 1, "interval_start": 0, "interval_step": 1, "interval_max": 1}


class TaskEvents:
    """Task events of one worker; every method does nothing when ``enabled`` is false."""

    def __init__(self, app: Celery, hostname: str, enabled: bool) -> None:
        self.enabled = enabled
        self._connection: Any = None
        self._dispatcher: Any = None
        #: Events not yet published (appended from any thread; taken by the flusher).
        self._buffer: list[dict[str, Any]] = []
        if enabled:
            self._connection = app.connection_for_write()
            self._dispatcher = app.events.Dispatcher(
                self._connection, hostname=hostname, groups=["task"], buffer_group=["task"],
                buffer_limit=_BUFFER_LIMIT)
            self.enabled = bool(self._dispatcher.enabled)  # off on transports without fanout
        self._hostname = hostname
        self._pid = os.getpid()
        self._utcoffset = utcoffset()  # read again at each publish (a DST change)
        self._due = threading.Event()  # something is buffered and wants publishing
        self._closing = False
        self._flushed_at = 0.0
        self._flusher: threading.Thread | None = None
        if self.enabled:
            self._clock = self._dispatcher.clock
            self._flusher = threading.Thread(target=self._flush_paced, name="task-events",
                                             daemon=True)
            self._flusher.start()

    def _send(self, type_: str, **fields: Any) -> None:
        """Buffer one event, with the fields Celery's dispatcher gives it (``Dispatcher.send``)."""
        fields.update(hostname=self._hostname, utcoffset=self._utcoffset, pid=self._pid,
                      clock=self._clock.forward(), timestamp=time.time(), type=type_)
        self._buffer.append(fields)

    def received(self, d: TakenMessage) -> None:
        """``task-received`` of a message the worker took."""
        if not self.enabled:
            return
        h = d.headers
        self._send("task-received", uuid=d.request_id, name=h.get("task"),
                   args=h.get("argsrepr", ""), kwargs=h.get("kwargsrepr", ""),
                   root_id=h.get("root_id"), parent_id=h.get("parent_id"),
                   retries=h.get("retries", 0), eta=h.get("eta"), expires=h.get("expires"))

    def started(self, d: TakenMessage) -> None:
        """``task-started`` of a request that went to its model."""
        if self.enabled:
            self._send("task-started", uuid=d.request_id)

    def finished(self, d: TakenMessage, state: str, result: Any, expired: bool = False) -> None:
        """``task-succeeded`` (with its runtime), ``task-failed``, ``task-revoked`` or
        ``task-retried``."""
        if not self.enabled or not d.request_id:
            return
        send = self._send
        if state == states.SUCCESS:
            send("task-succeeded", uuid=d.request_id, result=_summary(result),
                 runtime=time.perf_counter() - d.received_at)
        elif state == states.REVOKED:
            send("task-revoked", uuid=d.request_id, terminated=False, signum=None,
                 expired=expired)
        elif state == states.FAILURE:
            send("task-failed", uuid=d.request_id, exception=saferepr(result),
                 traceback=_traceback_of(result))
        elif state == states.RETRY:
            send("task-retried", uuid=d.request_id, exception=saferepr(result),
                 traceback=_traceback_of(result))

    def flush(self) -> None:
        """Have what is buffered published: now if nothing was published in the last
        ``FLUSH_INTERVAL_S``, else once that interval is over (with whatever comes meanwhile)."""
        if self.enabled and not self._due.is_set():
            self._due.set()

    def _flush_paced(self) -> None:
        while True:
            self._due.wait()
            if self._closing:
                return
            wait_s = self._flushed_at + FLUSH_INTERVAL_S - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
            self._due.clear()  # events buffered from here on ask again; those before go now
            if self._closing:  # close() came meanwhile: its wake-up was just cleared, and it
                return         # publishes what is left itself once this thread has ended
            self._publish()

    def _publish(self) -> None:
        """Publish what is buffered as one ``task.multi`` message, as the dispatcher's flush does
        (the JSON written by orjson); kept for the next try when the broker is away, up to
        ``_KEPT_LIMIT`` events."""
        self._flushed_at = time.monotonic()
        self._utcoffset = utcoffset()
        taken = len(self._buffer)
        if not taken:
            return
        events = self._buffer[:taken]
        dispatcher = self._dispatcher
        body: Any
        try:
            try:
                body, options = orjson.dumps(events), {"content_type": "application/json",
                                                        "content_encoding": "utf-8"}
            except TypeError:  # a field orjson does not write: kombu's own serializer
                body, options = events, {"serializer": dispatcher.serializer}
            dispatcher.producer.publish(
                body, routing_key="task.multi", exchange=dispatcher.exchange.name,
                declare=[dispatcher.exchange], headers=dispatcher.headers,
                delivery_mode=dispatcher.delivery_mode, retry=True,
                retry_policy=_RECONNECT_ONCE, **options)
        except Exception as exc:  # noqa: BLE001 - events are best effort, requests are not
            dropped = max(0, taken - _KEPT_LIMIT)
            log.warning("could not send %d task events (%s)%s", taken, exc,
                        f"; dropped the {dropped} oldest" if dropped else "")
            del self._buffer[:dropped]
            return
        del self._buffer[:taken]  # list operations are atomic: appends meanwhile stay

    def close(self) -> None:
        """Publish what is buffered, then let go of the connection."""
        if self._dispatcher is not None:
            self._closing = True
            self._due.set()
            if self._flusher is not None:
                self._flusher.join(timeout=FLUSH_INTERVAL_S + 5.0)
            self._publish()
            self._dispatcher.close()
            self._connection.release()
            self._dispatcher = None
            self.enabled = False


def _summary(result: Any) -> str:
    """The event's ``result``: a v2 response shown without its data. (Celery shows a repr cut to
    1 KiB; building that repr costs ~50 µs a request here, more than the rest of the events.)"""
    if isinstance(result, dict) and isinstance(result.get("outputs"), list):
        outputs = ", ".join(f"{o.get('name')!r}: {o.get('datatype')} {o.get('shape')}"
                            for o in result["outputs"] if isinstance(o, dict))
        return (f"{{'model_name': {result.get('model_name')!r}, 'id': {result.get('id')!r}, "
                f"'outputs': {{{outputs}}}, 'parameters': {result.get('parameters')!r}}}")
    return saferepr(result, _RESULT_REPR_MAX)


def _traceback_of(exc: Any) -> str:
    """The formatted traceback, as Celery's event carries it (with the model's own exception that
    caused it; a failure found before the model ran has just its exception line)."""
    if isinstance(exc, BaseException):
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ""
