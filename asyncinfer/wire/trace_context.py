"""W3C Trace Context on the wire: the ``traceparent`` and ``tracestate`` a request carries.

A producer that traces puts its span's context in the task message's headers under the names a
Celery user expects (those of OpenTelemetry's Celery instrumentation, which injects the W3C
fields into the message headers): ``traceparent`` (``00-<trace id>-<span id>-<flags>``) and, when
it has one, ``tracestate``. The gateway reads the same fields from an HTTP call's headers or a
gRPC call's metadata. Nothing here needs OpenTelemetry: a worker or a gateway with tracing off
passes the fields on as text, and one with tracing on hands them to its propagator.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["TRACEPARENT", "TRACESTATE", "trace_fields", "trace_fields_of_pairs", "valid_traceparent"]

#: The message header (and HTTP header, gRPC metadata key) of the caller's span context.
TRACEPARENT = "traceparent"
#: The vendors' part of the context, beside it.
TRACESTATE = "tracestate"

#: Version 00's form (a later version may add fields after these: W3C says read the first four).
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
#: A traceparent longer than this is no traceparent (W3C's version 00 is 55 characters).
_MAX_TRACEPARENT = 256
#: W3C's bound on a tracestate (32 entries of at most 256 characters, with their commas).
_MAX_TRACESTATE = 512 * 32


def valid_traceparent(text: Any) -> bool:
    """Whether ``text`` is a W3C ``traceparent`` a receiver may use: the version, trace ID,
    parent ID and flags in lower-case hex; neither ID all zeros; version ``ff`` refused; version
    00 with nothing after its flags."""
    if not isinstance(text, str) or len(text) > _MAX_TRACEPARENT:
        return False
    match = _TRACEPARENT.match(text)
    if match is None:
        return False
    version, trace_id, span_id, _, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return False
    return trace_id != "0" * 32 and span_id != "0" * 16


def trace_fields(carrier: Mapping[str, Any] | None) -> dict[str, str] | None:
    """The trace context of ``carrier`` (message headers, HTTP headers: any mapping whose keys
    are the field names as sent) as ``{"traceparent": ..., "tracestate": ...}`` (tracestate only
    when given); None when it holds no valid ``traceparent`` (W3C: an invalid one is ignored,
    and so is the tracestate beside it)."""
    if not carrier:
        return None
    parent = carrier.get(TRACEPARENT)
    if not isinstance(parent, str) or not valid_traceparent(parent):
        return None
    fields = {TRACEPARENT: parent}
    state = carrier.get(TRACESTATE)
    if isinstance(state, str) and state and len(state) <= _MAX_TRACESTATE:
        fields[TRACESTATE] = state
    return fields


def trace_fields_of_pairs(pairs: Iterable[tuple[str, Any]] | None) -> dict[str, str] | None:
    """:func:`trace_fields` of key-value pairs (gRPC metadata: lower-case keys, perhaps
    repeated; the first of each counts)."""
    found: dict[str, Any] = {}
    for key, value in pairs or ():
        if key in (TRACEPARENT, TRACESTATE) and key not in found:
            found[key] = value
    return trace_fields(found) if found else None
