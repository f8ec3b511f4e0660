"""What the engine tells its host about failures and batches, without knowing who listens.

:func:`is_transient` is the engine's own rule for a model's exception worth retrying: device
out-of-memory, the accelerator runtime's errors and lost connections. The worker passes a wider
rule (its broker client's errors too) and a batch observer (its metrics) to each runner.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

import torch

from asyncinfer.errors import InvalidRequest, ModelError, TransientError, TransientModelError

__all__ = ["BatchObserver", "Transient", "TRANSIENT_CAUSES", "is_transient", "model_failure"]

log = logging.getLogger(__name__)

#: Decides whether a model's exception is worth retrying.
Transient = Callable[[BaseException], bool]

#: Hears of each finished batch: ``(model, device, rows, compute_s, waits_s, phases_s)``;
#: ``phases_s``: its ``compute_s`` in three, (formed → launched: preprocess; launched → results on
#: the host: copies and forward; → delivered: postprocess and the split).
BatchObserver = Callable[[str, str, int, float, Sequence[float], tuple[float, float, float]], None]

#: Failures that may pass: device out of memory, the accelerator runtime's own errors, and a
#: lost connection (a model that calls out).
TRANSIENT_CAUSES: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch, "AcceleratorError", None),
                ConnectionError, TimeoutError)
    if isinstance(t, type))


def is_transient(exc: BaseException) -> bool:
    """Whether a model's exception is worth retrying, as far as the engine can tell."""
    return isinstance(exc, (TransientError, *TRANSIENT_CAUSES))


#: What opens the trace TorchScript's interpreter puts in its errors' text (15-35 lines of a
#: program's source), the error itself on its last line.
_TORCHSCRIPT_TRACE = "Traceback of TorchScript"
#: An error's type opening a line of its text ("RuntimeError: ").
_TYPE_NAMED = re.compile(r"^[A-Za-z_]\w*: ")


def _raised_text(exc: BaseException) -> str:
    """``exc`` as "<type>: <message>" on one line, or "<type> (no message)" for one raised
    without a message (``raise MemoryError``), which would otherwise read as a sentence cut off
    at its colon. A TorchScript program's error is its last line (the error itself, its trace
    left out). The worker's log has the exception's trace whole, once per batch
    (:func:`model_failure`)."""
    name = type(exc).__name__
    message = str(exc)
    if not message.strip():
        return f"{name} (no message)"
    if _TORCHSCRIPT_TRACE in message:
        last = [line.strip() for line in message.splitlines() if line.strip()][-1]
        gist = _TYPE_NAMED.sub("", last, count=1)  # "RuntimeError: ..." says the type again
        return f"{name}: {gist} (in the TorchScript program)"
    return f"{name}: {message}"


#: Set on an exception whose trace was logged (a batch's requests share its exception).
_LOGGED = "_asyncinfer_trace_logged"


def _first_telling(exc: BaseException) -> bool:
    """Whether ``exc``'s trace has not been logged yet (marking it logged)."""
    if getattr(exc, _LOGGED, False):
        return False
    try:
        setattr(exc, _LOGGED, True)
    except AttributeError:  # an exception type without attributes of its own: logged each time
        pass
    return True


def model_failure(request_id: str, model: str, exc: Exception, transient: Transient) -> Exception:
    """What request ``request_id`` fails with when model ``model`` raised ``exc`` running it:
    ``exc`` itself when it is an :class:`InvalidRequest`; else a :class:`TransientModelError`
    (``transient(exc)``) or a :class:`ModelError`, caused by ``exc``, whose one line names the
    model and the exception; its trace goes to the log (WARNING), once for all the requests of
    its batch."""
    if isinstance(exc, InvalidRequest):
        return exc
    kind = TransientModelError if transient(exc) else ModelError
    text = _raised_text(exc)
    if _first_telling(exc):  # the trace once, however many requests its batch held
        # (not naming the request: each failed request has its one line, worker/lifecycle.py)
        log.warning("model '%s' raised %s; its trace (the requests it failed each get their "
                    "one line):", model, type(exc).__name__, exc_info=exc)
    err = kind(f"request {request_id}: model '{model}' raised {text}")
    err.__cause__ = exc
    return err
