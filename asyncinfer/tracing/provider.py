"""Where spans go: the tracer provider of a tracing mode (``ASYNCINFER_TRACING``).

- ``otlp``: OTLP over HTTP (protobuf) to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; OpenTelemetry's own variables, read by its exporter);
- ``console``: one JSON object per span on stdout (a worker's log);
- ``global``: the provider the application installed (``trace.set_tracer_provider``, or
  ``opentelemetry-instrument``), asyncinfer adds none.

Spans leave through a ``BatchSpanProcessor`` (its own thread, its queue bounded: the
``OTEL_BSP_*`` variables), so no thread of asyncinfer waits on the exporter; the provider is
flushed when the process exits. The service is ``OTEL_SERVICE_NAME``, default ``asyncinfer``.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

__all__ = ["provider_for", "DEFAULT_SERVICE_NAME"]

DEFAULT_SERVICE_NAME = "asyncinfer"


def provider_for(mode: str) -> Any:
    """The tracer provider of ``mode``: a new SDK provider with its exporter, or (``global``)
    the application's."""
    if mode == "global":
        return trace.get_tracer_provider()
    provider = TracerProvider(resource=Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(_exporter(mode)))
    return provider


def _exporter(mode: str) -> SpanExporter:
    if mode == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if mode == "console":
        return ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + os.linesep)
    raise ValueError(f"ASYNCINFER_TRACING: no exporter for mode {mode!r}")
