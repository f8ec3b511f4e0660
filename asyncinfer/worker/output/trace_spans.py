"""A worker's spans of the requests it answered, recorded after the fact, after each result
write, on a thread of their own (tracing on: ``ASYNCINFER_TRACING``).

Nothing is recorded on the requests' path: the take time, the batch's times (its
:class:`~asyncinfer.engine.completion.BatchRecord`) and the write's are ``perf_counter`` readings
taken anyway; after each write the writer hands its outcomes to this module's thread (a queue
put), which makes the spans with explicit start and end times; the provider's own thread exports
them. So neither the device thread nor the writer waits on OpenTelemetry.

Per request that carries a trace context (the ``traceparent`` header: wire/trace_context.py),
children of the caller's span:

- ``asyncinfer.queue`` (CONSUMER): the wait in Redis, from the message's sent time (its
  ``asyncinfer_sent_at`` property, which asyncinfer's producers set; a message without it has
  no such span) to the take;
- ``asyncinfer.write`` : the write that stored its result (and acknowledged it);

and per device batch, once: ``asyncinfer.batch`` (formed → delivered), child of the first traced
request of the batch, linked to every traced request in it, and its child ``asyncinfer.device``
(on the device → results on the host). A request without a trace context is not traced (the
caller decides; an unsampled ``traceparent`` is honoured the same way by the sampler).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from celery import states

from asyncinfer.wire.messages import SENT_AT
from asyncinfer.wire.trace_context import trace_fields

__all__ = ["WorkerSpans", "QUEUE_SPAN", "BATCH_SPAN", "DEVICE_SPAN", "WRITE_SPAN"]

log = logging.getLogger(__name__)

QUEUE_SPAN, BATCH_SPAN, DEVICE_SPAN, WRITE_SPAN = (
    "asyncinfer.queue", "asyncinfer.batch", "asyncinfer.device", "asyncinfer.write")


def _ns(perf_s: float, offset_s: float) -> int:
    return int((perf_s + offset_s) * 1e9)


class WorkerSpans:
    """Records the spans of worker ``worker``'s written requests through ``tracing``
    (:class:`~asyncinfer.tracing.spans.Tracing`), on a thread of its own: the writer hands each
    written batch over (:meth:`hand_over`, a queue put) and goes on to the next write."""

    #: Written batches waiting for their spans at most; past it a batch's spans are dropped (as
    #: the exporter drops spans past its own queue) rather than held without bound.
    max_waiting = 1024

    def __init__(self, tracing: Any, worker: str) -> None:
        self.tracing = tracing
        self.worker = worker
        #: Written batches whose spans were dropped (the queue was full).
        self.dropped = 0
        self._waiting: queue.Queue[tuple[list[Any], float, float] | None] = queue.Queue(
            self.max_waiting)
        self._thread = threading.Thread(target=self._run, name="asyncinfer-spans", daemon=True)
        self._thread.start()

    def hand_over(self, outcomes: list[Any], write_started: float, write_ended: float) -> None:
        """(The writer's, after each write.) :meth:`record` ``outcomes`` on this thread."""
        try:
            self._waiting.put_nowait((outcomes, write_started, write_ended))
        except queue.Full:
            self.dropped += 1
            log.debug("the spans of %d requests were dropped (%d written batches wait for theirs)",
                      len(outcomes), self.max_waiting)

    def close(self, timeout_s: float = 5.0) -> None:
        """Record what was handed over, then stop."""
        self._waiting.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._waiting.get()) is not None:
            self.record(*item)

    def record(self, outcomes: list[Any], write_started: float, write_ended: float) -> None:
        """The spans of ``outcomes`` (result writer outcomes), written between ``write_started``
        and ``write_ended`` (``perf_counter`` readings). Never raises: a trace must not cost a
        result."""
        offset_s = time.time() - time.perf_counter()
        contexts = _Contexts(self.tracing)  # each request's trace context, read once
        for outcome in outcomes:
            try:
                self._request(outcome, len(outcomes), _ns(write_started, offset_s),
                              _ns(write_ended, offset_s), offset_s, contexts)
            except Exception:  # noqa: BLE001 - tracing is a courtesy
                log.debug("request %s: recording its spans failed",
                          outcome.delivery.request_id, exc_info=True)

    def _request(self, outcome: Any, written: int, write_start_ns: int, write_end_ns: int,
                 offset_s: float, contexts: _Contexts) -> None:
        d = outcome.delivery
        batch = d.batch
        if batch is not None and not batch.recorded:
            batch.recorded = True
            self._batch(batch, offset_s, contexts)
        parent = contexts.of(d.headers)
        if parent is None:
            return
        common = {"messaging.message.id": d.request_id, "messaging.destination.name": d.queue,
                  "asyncinfer.worker": self.worker}
        sent = (d.envelope.get("properties") or {}).get(SENT_AT)
        if isinstance(sent, (int, float)) and d.received_at:
            start_ns = int(sent * 1e9)
            span = self.tracing.start(QUEUE_SPAN, context=parent, kind="consumer",
                                      start_ns=start_ns,
                                      attributes={**common, "asyncinfer.retries": int(
                                          d.headers.get("retries") or 0)})
            # another host's clock sent it: never a span that ends before it starts
            span.end(end_time=max(start_ns, _ns(d.received_at, offset_s)))
        span = self.tracing.start(WRITE_SPAN, context=parent, start_ns=write_start_ns,
                                  attributes={**common, "asyncinfer.state": outcome.state,
                                              "asyncinfer.written": written})
        if outcome.state == states.FAILURE:
            self.tracing.fail(span, str(outcome.result) or type(outcome.result).__name__)
        span.end(end_time=write_end_ns)

    def _batch(self, batch: Any, offset_s: float, contexts: _Contexts) -> None:
        """The spans of one device batch: under its first traced request, linked to all."""
        traced = [(request_id, context)
                  for request_id, tag in zip(batch.request_ids, batch.traces, strict=True)
                  if (context := contexts.of(tag)) is not None]
        if not traced:
            return
        links = [self.tracing.link(None, {"messaging.message.id": request_id}, context=context)
                 for request_id, context in traced]
        span = self.tracing.start(
            BATCH_SPAN, context=traced[0][1], start_ns=_ns(batch.started, offset_s), links=links,
            attributes={"asyncinfer.model": batch.model, "asyncinfer.device": batch.device,
                        "asyncinfer.batch_size": batch.rows,
                        "asyncinfer.batch_requests": len(batch.request_ids),
                        "asyncinfer.worker": self.worker})
        if batch.launched:
            end = (batch.launched + batch.device_s if batch.device_s is not None
                   else batch.finished)
            device = self.tracing.start_child(DEVICE_SPAN, span,
                                              start_ns=_ns(batch.launched, offset_s),
                                              attributes={"asyncinfer.device": batch.device})
            device.end(end_time=_ns(end, offset_s))
        span.end(end_time=_ns(batch.finished, offset_s))


class _Contexts:
    """The parent contexts of the trace tags (message headers) of one write, each read once
    (a request's headers serve its own spans and its batch's link)."""

    def __init__(self, tracing: Any) -> None:
        self.tracing = tracing
        self._read: dict[int, tuple[Any, Any]] = {}

    def of(self, headers: Any) -> Any:
        """The context the trace context in ``headers`` names (None: none)."""
        if not headers:
            return None
        found = self._read.get(id(headers))
        if found is None or found[0] is not headers:
            found = self._read[id(headers)] = (headers, self.tracing.context_of(
                trace_fields(headers)))
        return found[1]
