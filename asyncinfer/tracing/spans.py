"""Spans from W3C trace context fields, for every side of a request (imported only with tracing
on: it imports OpenTelemetry).

The fields travel as text (wire/trace_context.py): :meth:`Tracing.context_of` reads them into a
parent context, :meth:`Tracing.fields_of` writes a span's. Spans may be made after the fact
with explicit start and end times (:meth:`Tracing.start` ``start_ns``, ``span.end(end_time=)``):
the worker records its spans from timestamps taken on the requests' path, off that path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from asyncinfer.tracing.provider import provider_for

__all__ = ["Tracing", "KINDS", "wall_ns_of"]

#: Span kinds by name, for callers that import no OpenTelemetry.
KINDS = {"internal": SpanKind.INTERNAL, "server": SpanKind.SERVER, "client": SpanKind.CLIENT,
         "producer": SpanKind.PRODUCER, "consumer": SpanKind.CONSUMER}

#: The instrumentation scope of every asyncinfer span.
SCOPE = "asyncinfer"


def wall_ns_of(perf_s: float, offset_s: float) -> int:
    """A ``time.perf_counter()`` reading as epoch nanoseconds, given ``offset_s``
    (``time.time() - time.perf_counter()`` read near it)."""
    return int((perf_s + offset_s) * 1e9)


class Tracing:
    """Makes asyncinfer's spans on ``provider``'s tracer (:func:`~asyncinfer.tracing.tracing_for`
    makes one for each owner, which closes it: :meth:`close`)."""

    def __init__(self, provider: Any, mode: str = "") -> None:
        self.mode = mode
        self.provider = provider
        self.tracer = provider.get_tracer(SCOPE)
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def of_mode(cls, mode: str) -> Tracing:
        return cls(provider_for(mode), mode)

    def close(self) -> None:
        """Export what is pending and stop the exporter's thread (a provider of its own; the
        application's, in mode ``global``, is the application's to shut down)."""
        if self.mode != "global":
            self.provider.shutdown()

    # -- context as text -------------------------------------------------------------------------

    def context_of(self, fields: Mapping[str, str] | None) -> Any:
        """The parent context the trace context ``fields`` name (None: no parent: a new trace)."""
        if not fields:
            return None
        context = self._propagator.extract(fields)
        span_context = trace.get_current_span(context).get_span_context()
        return context if span_context.is_valid else None

    def fields_of(self, span: Any) -> dict[str, str]:
        """``span``'s context as trace context fields (``traceparent``, ``tracestate``)."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def current_fields(self) -> dict[str, str] | None:
        """The calling code's current span as trace context fields (None: none)."""
        span = trace.get_current_span()
        return self.fields_of(span) if span.get_span_context().is_valid else None

    def link(self, fields: Mapping[str, str] | None, attributes: Mapping[str, Any] | None = None,
             *, context: Any = None) -> Link | None:
        """A link to the span ``fields`` name, or (``context``) the current span of that
        context; None when they name none."""
        if context is None:
            context = self.context_of(fields)
        if context is None:
            return None
        return Link(trace.get_current_span(context).get_span_context(), attributes)

    # -- spans -----------------------------------------------------------------------------------

    def start(self, name: str, parent: Mapping[str, str] | None = None, *, kind: str = "internal",
              start_ns: int | None = None, attributes: Mapping[str, Any] | None = None,
              links: Sequence[Link | None] = (), current_parent: bool = False,
              context: Any = None) -> Any:
        """A started span ``name``, child of the span ``parent`` names, or of ``context``'s
        (:meth:`context_of`, read once for many spans); with ``current_parent`` and neither: of
        the calling code's current span; else the root of a new trace. End it with
        ``span.end()`` (``end_time=`` nanoseconds for one recorded after the fact)."""
        if context is None:
            context = self.context_of(parent)
        if context is None and not current_parent:
            context = otel_context.Context()  # a root, whatever is current
        return self.tracer.start_span(name, context=context, kind=KINDS[kind],
                                      attributes=attributes, start_time=start_ns,
                                      links=[link for link in links if link is not None])

    @staticmethod
    def child_context(span: Any) -> Any:
        """The context whose current span is ``span`` (for a child made with ``start``'s
        ``parent`` as fields, use :meth:`fields_of`)."""
        return trace.set_span_in_context(span)

    def start_child(self, name: str, parent_span: Any, *, start_ns: int | None = None,
                    attributes: Mapping[str, Any] | None = None, kind: str = "internal") -> Any:
        """A started span ``name``, child of the span object ``parent_span``."""
        return self.tracer.start_span(name, context=trace.set_span_in_context(parent_span),
                                      kind=KINDS[kind], attributes=attributes,
                                      start_time=start_ns)

    @staticmethod
    def fail(span: Any, error: BaseException | str) -> None:
        """Mark ``span`` failed with ``error``."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        span.set_status(Status(StatusCode.ERROR, text[:500]))
        if isinstance(error, BaseException):
            span.record_exception(error)

    @staticmethod
    def now_ns() -> int:
        return time.time_ns()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export what is recorded now (a process about to exit)."""
        force_flush = getattr(self.provider, "force_flush", None)
        if force_flush is not None:
            force_flush(int(timeout_s * 1000))
