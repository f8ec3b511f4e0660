"""Tracing without processes: the trace context on the wire, the switch that imports nothing when
off, the batch record the engine hands back, and the worker's spans made from it (an in-memory
exporter)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from celery import Celery, states
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from asyncinfer.client.outgoing import Outgoing
from asyncinfer.config.settings import Settings
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.completion import BatchRecord, deliver
from asyncinfer.errors import ModelError
from asyncinfer.tracing import tracing_for
from asyncinfer.tracing.spans import Tracing
from asyncinfer.wire.envelope import parse_envelope
from asyncinfer.wire.messages import SENT_AT, task_message
from asyncinfer.wire.protocol import decode_request
from asyncinfer.wire.trace_context import (
    TRACEPARENT,
    TRACESTATE,
    trace_fields,
    trace_fields_of_pairs,
    valid_traceparent,
)
from asyncinfer.worker.links import send_callbacks
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.trace_spans import WorkerSpans
from asyncinfer.worker.requests.taken import TakenMessage

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


# -- the trace context on the wire ---------------------------------------------------------------

@pytest.mark.parametrize("text, valid", [
    (PARENT, True),
    (f"00-{TRACE_ID}-{SPAN_ID}-00", True),  # not sampled: still a context
    (f"01-{TRACE_ID}-{SPAN_ID}-01-later", True),  # a later version may add fields
    (f"00-{TRACE_ID}-{SPAN_ID}-01-more", False),  # version 00 has none
    (f"ff-{TRACE_ID}-{SPAN_ID}-01", False),
    (f"00-{'0' * 32}-{SPAN_ID}-01", False),
    (f"00-{TRACE_ID}-{'0' * 16}-01", False),
    (f"00-{TRACE_ID.upper()}-{SPAN_ID}-01", False),
    ("00-abc-def-01", False), ("", False), (None, False), (42, False), ("x" * 1000, False),
])
def test_a_traceparent_is_read_as_w3c_says(text: Any, valid: bool) -> None:
    assert valid_traceparent(text) is valid


def test_trace_fields_keep_a_valid_context_and_its_state_only() -> None:
    assert trace_fields({TRACEPARENT: PARENT, TRACESTATE: "a=1", "other": "x"}) == {
        TRACEPARENT: PARENT, TRACESTATE: "a=1"}
    assert trace_fields({TRACEPARENT: PARENT}) == {TRACEPARENT: PARENT}
    # an invalid traceparent is ignored, and the tracestate beside it
    assert trace_fields({TRACEPARENT: "garbage", TRACESTATE: "a=1"}) is None
    assert trace_fields({}) is None and trace_fields(None) is None
    # gRPC metadata: pairs, the first of a repeated key counts
    assert trace_fields_of_pairs([("user-agent", "x"), (TRACEPARENT, PARENT),
                                  (TRACEPARENT, "00-other")]) == {TRACEPARENT: PARENT}
    assert trace_fields_of_pairs(None) is None


def test_the_message_carries_the_trace_in_its_headers() -> None:
    # Given a request with a trace context
    outgoing = Outgoing.infer("identity", [1.0], "r1", False, "json", binary=False,
                              trace={TRACEPARENT: PARENT, TRACESTATE: "a=1"})
    # Then its Redis message has it in Celery's headers, where Celery's producers put it
    headers = json.loads(outgoing.message("reply", None))["headers"]
    assert headers[TRACEPARENT] == PARENT and headers[TRACESTATE] == "a=1"
    assert headers["id"] == "r1"  # and Celery's own headers are kept
    # and so has send_task's (a broker other than Redis)
    assert outgoing.send_task_options("reply")["headers"][TRACEPARENT] == PARENT
    # and a request without one carries none
    plain = Outgoing.infer("identity", [1.0], "r2", False, "json", binary=False)
    assert TRACEPARENT not in json.loads(plain.message("reply", None))["headers"]


# -- the switch ----------------------------------------------------------------------------------

def test_tracing_off_is_none() -> None:
    assert tracing_for(Settings(tracing="off")) is None


def test_an_unknown_tracing_mode_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="ASYNCINFER_TRACING must be one of off, otlp, console, "
                                         "global, got 'jaeger'"):
        Settings(tracing="jaeger")


# -- the engine hands each request its batch's record --------------------------------------------

def _item(request_id: str, trace: Any) -> WorkItem:
    request = decode_request(request_id, {"model": "m", "inputs": [
        {"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]})
    return WorkItem(request=request, rows=1, signature=(), trace=trace)


def _deliver(items: list[WorkItem], record: bool) -> None:
    started = time.perf_counter() - 0.01  # formed 10 ms ago, on the device 1 ms after
    deliver(items, {"y": torch.ones((len(items), 1))}, started, "m", "cpu",
            lambda *args: None, started + 0.001, 0.0005, record)


def test_a_recorded_batch_names_its_requests_and_their_trace_tags() -> None:
    items = [_item("a", {"tag": 1}), _item("b", None)]
    _deliver(items, record=True)
    batch = items[0].future.result().batch
    assert isinstance(batch, BatchRecord) and items[1].future.result().batch is batch
    assert (batch.model, batch.device, batch.rows) == ("m", "cpu", 2)
    assert batch.request_ids == ["a", "b"] and batch.traces == [{"tag": 1}, None]
    assert batch.started < batch.launched < batch.finished and batch.device_s == 0.0005


def test_an_unrecorded_batch_costs_no_record() -> None:
    items = [_item("a", None)]
    _deliver(items, record=False)
    assert items[0].future.result().batch is None


# -- the worker's spans --------------------------------------------------------------------------

@pytest.fixture()
def exported() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _taken(request_id: str, headers: dict[str, Any], sent_at: float | None,
           received_at: float) -> TakenMessage:
    envelope = json.loads(task_message("asyncinfer.infer", request_id, {"model": "m"}, "infer.m"))
    envelope["headers"].update(headers)
    if sent_at is None:
        del envelope["properties"][SENT_AT]
    else:
        envelope["properties"][SENT_AT] = sent_at
    d = TakenMessage(raw=json.dumps(envelope).encode(), queue="infer.m", received_at=received_at)
    parse_envelope(d)
    return d


def test_the_worker_records_queue_batch_device_and_write_under_the_callers_span(
        exported: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = exported
    now = time.perf_counter()
    offset_s = time.time() - now
    other = f"00-{'1' * 32}-{'2' * 16}-01"
    # Given two traced requests (one without a sent time: no queue span) and one untraced,
    # in one device batch, sent 0.2 s before they were taken
    a = _taken("a", {TRACEPARENT: PARENT, TRACESTATE: "v=1"}, now + offset_s - 0.2, now)
    b = _taken("b", {TRACEPARENT: other}, None, now)
    c = _taken("c", {}, now + offset_s - 0.2, now)
    batch = BatchRecord("m", "cpu", 3, now + 0.01, now + 0.02, 0.005, now + 0.03, ["a", "b", "c"],
                        [a.headers, b.headers, c.headers])
    for d in (a, b, c):
        d.batch = batch
    outcomes = [Outcome(a, states.SUCCESS, {}), Outcome(b, states.FAILURE, ModelError("boom")),
                Outcome(c, states.SUCCESS, {})]
    # When the writer has written them
    recorder = WorkerSpans(tracing, "w@h")
    recorder.hand_over(outcomes, now + 0.04, now + 0.05)  # as the writer does, after its write
    recorder.close()  # made on its own thread: wait for them
    spans = exporter.get_finished_spans()
    # Then: a's queue and write, b's write, one batch and its device; nothing of c's own
    names = sorted(s.name for s in spans)
    assert names == ["asyncinfer.batch", "asyncinfer.device", "asyncinfer.queue",
                     "asyncinfer.write", "asyncinfer.write"]
    by_name = {s.name: s for s in spans}
    queue, batch_span, device = (by_name["asyncinfer.queue"], by_name["asyncinfer.batch"],
                                 by_name["asyncinfer.device"])
    writes = {s.attributes["messaging.message.id"]: s for s in spans if s.name == "asyncinfer.write"}
    caller = int(SPAN_ID, 16)
    assert queue.parent.span_id == caller and queue.context.trace_id == int(TRACE_ID, 16)
    assert queue.kind == SpanKind.CONSUMER
    assert queue.parent.is_remote and str(queue.context.trace_state) == str(
        queue.parent.trace_state)
    assert queue.end_time - queue.start_time == pytest.approx(0.2e9, abs=2e6)  # 1 ms: sent_at
    assert writes["a"].parent.span_id == caller and writes["a"].status.status_code != StatusCode.ERROR
    assert writes["b"].parent.span_id == int("2" * 16, 16)
    assert writes["b"].status.status_code == StatusCode.ERROR
    assert writes["a"].end_time - writes["a"].start_time == pytest.approx(0.01e9, abs=1e5)
    # the batch: under its first traced request, linked to both traced requests
    assert batch_span.parent.span_id == caller
    assert [(link.context.trace_id, link.context.span_id) for link in batch_span.links] == [
        (int(TRACE_ID, 16), caller), (int("1" * 32, 16), int("2" * 16, 16))]
    assert batch_span.attributes["asyncinfer.batch_size"] == 3
    assert batch_span.attributes["asyncinfer.batch_requests"] == 3
    assert batch_span.attributes["asyncinfer.model"] == "m"
    assert batch_span.end_time - batch_span.start_time == pytest.approx(0.02e9, abs=1e5)
    assert device.parent.span_id == batch_span.context.span_id
    assert device.end_time - device.start_time == pytest.approx(0.005e9, abs=1e5)
    assert batch_span.start_time < device.start_time < device.end_time < batch_span.end_time
    assert batch.recorded


def test_a_batch_is_recorded_once_across_writes(
        exported: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = exported
    now = time.perf_counter()
    a, b = (_taken(i, {TRACEPARENT: PARENT}, None, now) for i in "ab")
    batch = BatchRecord("m", "cpu", 2, now, now, None, now, ["a", "b"], [a.headers, b.headers])
    a.batch = b.batch = batch
    spans = WorkerSpans(tracing, "w@h")
    spans.record([Outcome(a, states.SUCCESS, {})], now, now)
    spans.record([Outcome(b, states.SUCCESS, {})], now, now)
    spans.close()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names.count("asyncinfer.batch") == 1 and names.count("asyncinfer.write") == 2


def test_a_span_that_cannot_be_made_costs_no_result(
        exported: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, _ = exported
    d = _taken("a", {TRACEPARENT: PARENT}, None, time.perf_counter())
    d.batch = object()  # not a batch record: recording it raises inside
    spans = WorkerSpans(tracing, "w@h")
    spans.record([Outcome(d, states.SUCCESS, {})], 0.0, 0.0)  # no raise
    spans.close()


# -- a chain's next stage carries the trace ------------------------------------------------------

def test_the_next_stage_of_a_chain_carries_the_requests_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery(set_as_current=False)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr("celery.canvas.Signature.apply_async",
                        lambda self, args=None, **options: sent.append(dict(self.options)))
    nxt = app.signature("asyncinfer.postprocess", queue="cpu")
    own = app.signature("asyncinfer.postprocess", queue="cpu",
                        headers={TRACEPARENT: f"00-{'3' * 32}-{'4' * 16}-01"})
    # When a traced request's chain goes on: its next stage carries the request's trace...
    send_callbacks(app, {"chain": [dict(nxt)]}, "r", "r", {}, {TRACEPARENT: PARENT})
    # ...unless that stage's message was given one of its own
    send_callbacks(app, {"chain": [dict(own)]}, "r", "r", {}, {TRACEPARENT: PARENT})
    assert sent[0]["headers"] == {TRACEPARENT: PARENT}
    assert sent[1]["headers"][TRACEPARENT].startswith("00-333")


def test_a_future_ends_the_client_span(exported: tuple[Tracing, InMemorySpanExporter]) -> None:
    from asyncinfer.client.submit_span import end_with_future, start_submit_span

    tracing, exporter = exported
    outgoing = Outgoing.infer("identity", [1.0], "r1", False, "json", binary=False,
                              trace={TRACEPARENT: PARENT})
    span = start_submit_span(tracing, outgoing)
    # the message now carries the client's span, a child of the given context
    assert outgoing.trace is not None
    assert outgoing.trace[TRACEPARENT].startswith(f"00-{TRACE_ID}-")
    assert outgoing.trace[TRACEPARENT] != PARENT
    future: Future[Any] = Future()
    end_with_future(tracing, span, future)
    assert exporter.get_finished_spans() == ()
    future.set_exception(ModelError("request r1: boom"))
    (ended,) = exporter.get_finished_spans()
    assert ended.name == "asyncinfer.submit" and ended.kind == SpanKind.PRODUCER
    assert ended.parent.span_id == int(SPAN_ID, 16)
    assert ended.status.status_code == StatusCode.ERROR
    assert ended.attributes["messaging.destination.name"] == "infer.identity"


def test_an_unsampled_caller_is_not_recorded(
        exported: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = exported
    now = time.perf_counter()
    unsampled = f"00-{TRACE_ID}-{SPAN_ID}-00"  # the caller decided not to record this trace
    d = _taken("a", {TRACEPARENT: unsampled}, time.time() - 0.1, now)
    d.batch = BatchRecord("m", "cpu", 1, now, now, 0.0, now, ["a"], [d.headers])
    spans = WorkerSpans(tracing, "w@h")
    spans.record([Outcome(d, states.SUCCESS, {})], now, now)
    spans.close()
    assert exporter.get_finished_spans() == ()


def test_written_batches_past_the_bound_are_dropped_not_held(
        exported: tuple[Tracing, InMemorySpanExporter], monkeypatch: pytest.MonkeyPatch) -> None:
    tracing, exporter = exported
    gate = threading.Event()
    spans = WorkerSpans(tracing, "w@h")
    monkeypatch.setattr(spans, "record", lambda *args: gate.wait(10))  # the thread is busy
    spans.hand_over([], 0.0, 0.0)  # taken by the thread, which waits
    for _ in range(WorkerSpans.max_waiting + 5):  # the queue fills, then 5 more
        spans.hand_over([], 0.0, 0.0)
    assert 5 <= spans.dropped <= 6  # (the first may still be in the queue when the rest come)
    gate.set()
    spans.close()
