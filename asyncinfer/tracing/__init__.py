"""OpenTelemetry traces across the queue, when asked for (``ASYNCINFER_TRACING``; the ``tracing``
extra installs OpenTelemetry).

:func:`tracing_for` is the one door: with tracing ``off`` (the default) it returns None and
imports nothing, so every caller pays one ``is None`` check per request and OpenTelemetry is
never loaded. Otherwise it makes a :class:`~asyncinfer.tracing.spans.Tracing`: spans from W3C
trace context fields (wire/trace_context.py), exported as the mode says (provider.py). Whoever
makes one owns it and closes it (its exporter's thread): a client's sender, the device worker
(``Worker.tracing``, for its consumer and its CPU stages).

Who records what (docs/operations.md, *Tracing*): the client its ``asyncinfer.submit``
(client/submit_span.py), the gateway its ``asyncinfer.gateway.infer`` (gateway/service.py), the
worker ``asyncinfer.queue``, ``asyncinfer.batch``, ``asyncinfer.device`` and
``asyncinfer.write`` after each result write, on a thread of their own
(worker/output/trace_spans.py), the CPU stages of a chain theirs (tasks/stages.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncinfer.tracing.spans import Tracing

__all__ = ["tracing_for", "TRACING_EXTRA"]

#: What to install for a mode other than ``off``.
TRACING_EXTRA = "pip install 'asyncinfer[tracing]'"

def tracing_for(settings: Any) -> Tracing | None:
    """Tracing under ``settings.tracing``: None for ``off`` (nothing imported), else a new
    :class:`Tracing` of that mode, for the caller to close.

    Raises:
        ImportError: a mode other than ``off`` without OpenTelemetry installed (saying what to
            install).
    """
    mode = settings.tracing
    if mode == "off":
        return None
    try:
        from asyncinfer.tracing.spans import Tracing
    except ImportError as exc:
        raise ImportError(f"ASYNCINFER_TRACING={mode} needs OpenTelemetry, which is not "
                          f"installed ({exc}): {TRACING_EXTRA}") from exc
    return Tracing.of_mode(mode)
