"""OpenTelemetry traces across the queue, when asked for (``ASYNCINFER_TRACING``; the ``tracing``
extra installs OpenTelemetry).

:func:`tracing_for` is the one door: with tracing ``off`` (the default) it returns None and
imports nothing, so every caller pays one ``is None`` check per request and OpenTelemetry is
never loaded. Otherwise it returns the process's :class:`~asyncinfer.tracing.spans.Tracing`
(made once per process and mode): spans from W3C trace context fields (wire/trace_context.py),
exported as the mode says (provider.py).

Who records what (docs/operations.md, *Tracing*): the client its ``asyncinfer.submit``
(client/submit_span.py), the gateway its ``asyncinfer.gateway.infer`` (gateway/service.py), the
worker ``asyncinfer.queue``, ``asyncinfer.batch``, ``asyncinfer.device`` and
``asyncinfer.write`` after each result write, on a thread of their own
(worker/output/trace_spans.py), the CPU stages of a chain theirs (tasks/stages.py).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncinfer.tracing.spans import Tracing

__all__ = ["tracing_for", "TRACING_EXTRA"]

#: What to install for a mode other than ``off``.
TRACING_EXTRA = "pip install 'asyncinfer[tracing]'"

_made: dict[str, Tracing] = {}
_lock = threading.Lock()


def tracing_for(settings: Any) -> Tracing | None:
    """This process's tracing under ``settings.tracing``: None for ``off`` (nothing imported),
    else the one :class:`Tracing` of that mode in this process.

    Raises:
        ImportError: a mode other than ``off`` without OpenTelemetry installed (saying what to
            install).
    """
    mode = settings.tracing
    if mode == "off":
        return None
    tracing = _made.get(mode)
    if tracing is not None:
        return tracing
    with _lock:
        tracing = _made.get(mode)
        if tracing is None:
            try:
                from asyncinfer.tracing.spans import Tracing
            except ImportError as exc:
                raise ImportError(f"ASYNCINFER_TRACING={mode} needs OpenTelemetry, which is not "
                                  f"installed ({exc}): {TRACING_EXTRA}") from exc
            tracing = _made[mode] = Tracing.of_mode(mode)
    return tracing
