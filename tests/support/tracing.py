"""Tracing in the tests: a tiny OTLP/HTTP collector in the test process (what the worker,
gateway and client processes export to), and a model that tells whether OpenTelemetry was
imported in the worker that runs it."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from asyncinfer.models.base import Batch, Model

__all__ = ["Collector", "CollectedSpan", "ModulesProbe", "TRACING_MODULES"]


@dataclass
class CollectedSpan:
    """One span as an OTLP export carried it (IDs in lower-case hex, as a traceparent has them)."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    #: (trace ID, span ID, attributes) of each link.
    links: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    #: OTLP's status code: 0 unset, 1 ok, 2 error.
    status: int = 0


def _value(any_value: Any) -> Any:
    which = any_value.WhichOneof("value")
    return None if which is None else getattr(any_value, which)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class Collector:
    """An OTLP/HTTP endpoint (``POST /v1/traces``, protobuf) on a free local port, keeping every
    span it receives. Stop with :meth:`stop`."""

    def __init__(self) -> None:
        self.spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    collector._add(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="otlp-collector")
        self._thread.start()

    def _add(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest.FromString(body)
        found = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(CollectedSpan(
                        name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(), kind=span.kind, service=service,
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano,
                        attributes=_attributes(span.attributes),
                        links=[(link.trace_id.hex(), link.span_id.hex(),
                                _attributes(link.attributes)) for link in span.links],
                        status=span.status.code))
        with self._lock:
            self.spans += found

    def of_trace(self, trace_id: str) -> list[CollectedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout_s: float = 30.0
                 ) -> dict[str, CollectedSpan]:
        """The spans of ``trace_id`` by name once every one of ``names`` arrived (the first of
        each name); AssertionError naming what is missing after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.of_trace(trace_id)
            by_name: dict[str, CollectedSpan] = {}
            for span in spans:
                by_name.setdefault(span.name, span)
            if names <= by_name.keys():
                return by_name
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: spans {sorted(names - by_name.keys())} "
                                     f"never arrived (got {sorted(by_name)}; all: "
                                     f"{sorted({s.name for s in self.spans})})")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


#: What tracing imports and nothing else does: asyncinfer's span code, OpenTelemetry's tracing
#: SDK, its W3C propagator and its OTLP exporter. (Not OpenTelemetry as a whole: redis-py 8
#: imports its metrics SDK and tracing API on ``import redis`` when they are installed.)
TRACING_MODULES = ("asyncinfer.tracing.spans", "asyncinfer.tracing.provider",
                   "opentelemetry.sdk.trace", "opentelemetry.trace.propagation.tracecontext",
                   "opentelemetry.exporter.otlp.proto.http.trace_exporter")


class ModulesProbe(Model):
    """``input`` (any) → ``loaded`` INT64 [n, 1]: 1 per row when any of :data:`TRACING_MODULES`
    is imported in the worker process that runs it, else 0."""

    name = "probe"
    inputs = None

    def forward(self, batch: Batch) -> Batch:
        import sys

        loaded = any(name in sys.modules for name in TRACING_MODULES)
        rows = len(next(iter(batch.values())))
        return {"loaded": torch.full((rows, 1), int(loaded), dtype=torch.int64)}
