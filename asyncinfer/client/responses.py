"""What a caller holds for one request: its future, the v2 response it resolves to, and the
error a stored failure raises.

``InferFuture`` is a ``concurrent.futures.Future`` settled by the client's result watcher;
``cancel()`` revokes the request. ``InferResponse`` reads outputs as numpy arrays or torch tensors.

A stored failure is rebuilt as Celery rebuilds it (its ``exc_module`` looked up among the modules
already imported, never imported, never unpickled). One that names no exception type a caller can
be given (stored by another producer or a tool: ``builtins.dict``, ``os.system``, none at all),
on which Celery raises where the result is read, is an :class:`~asyncinfer.errors.AsyncInferError`
naming the request and what was stored (:func:`python_error`), so every future settles and the
result watcher reads on. Celery's revoke is raised as :class:`RequestRevoked` (an expired request:
:class:`RequestExpired`), asyncinfer's errors that Celery's ``TaskRevokedError`` catches too; a
time limit stored bare by Celery's pool (``TimeLimitExceeded(2.0)``), with a message naming the
request (:func:`time_limit_words`).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from celery import states
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError, TimeLimitExceeded
from celery.result import AsyncResult

from asyncinfer import errors
from asyncinfer.client.tensor_refs import resolved
from asyncinfer.errors import AsyncInferError, RequestTimeout
from asyncinfer.wire.payloads import output_to_numpy, output_to_torch
from asyncinfer.wire.result_json import decode_meta

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["InferFuture", "InferResponse", "StreamPart", "RequestRevoked", "RequestExpired",
           "stored_outcome", "decode_stored", "python_error", "revoked_error", "time_limit_words"]

#: How much of a stored failure an error quotes at most (characters).
_QUOTED_CHARS = 300


class _Watcher(Protocol):
    """What a future needs of the result watcher (client/result_watcher.py, which imports this
    module): to stop being called."""

    def unwatch(self, request_id: str, callback: Any = None) -> None: ...


class _Outputs:
    """Reading the v2 output tensors of :attr:`outputs` (name → tensor) as numpy arrays."""

    outputs: dict[str, dict[str, Any]]

    def _owner(self) -> str:
        """Whose outputs these are, as an error names them."""
        raise NotImplementedError

    #: Where outputs passed by reference are read from (client/tensor_refs.py; None: none).
    store: Any = None

    def _output(self, name: str | None) -> dict[str, Any]:
        if name is None:
            return resolved(next(iter(self.outputs.values())), self.store, self._owner())
        try:
            output = self.outputs[name]
        except KeyError:
            raise KeyError(f"{self._owner()} has no output {name!r} "
                           f"(outputs: {', '.join(self.outputs)})") from None
        return resolved(output, self.store, self._owner())

    def __getitem__(self, name: str) -> np.ndarray:
        return output_to_numpy(self._output(name))

    def as_numpy(self, name: str | None = None) -> np.ndarray:
        """Output ``name`` (default: the first) as a numpy array."""
        return output_to_numpy(self._output(name))


class InferResponse(_Outputs):
    """A v2 inference response; ``response["output"]`` is that output as a numpy array."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = dict(raw)
        self.id: str = raw["id"]
        self.model_name: str = raw["model_name"]
        self.parameters: dict[str, Any] = dict(raw.get("parameters") or {})
        self.outputs: dict[str, dict[str, Any]] = {o["name"]: o for o in raw["outputs"]}

    def _owner(self) -> str:
        return f"response {self.id}"

    def as_torch(self, name: str | None = None) -> Any:
        """Output ``name`` (default: the first) as a torch tensor (numeric outputs); the first
        call loads torch, which nothing else on the client's side needs."""
        return output_to_torch(self._output(name))

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {o['datatype']}{o['shape']}" for n, o in self.outputs.items())
        return f"InferResponse(id={self.id!r}, model={self.model_name!r}, outputs={{{shapes}}})"


class StreamPart(_Outputs):
    """One part of a streaming request (docs/streaming.md): ``part["name"]`` is that output as a
    numpy array, with the request's one row first."""

    def __init__(self, request_id: str, index: int, outputs: list[dict[str, Any]]) -> None:
        self.request_id = request_id
        #: Its number in the request's stream (1-based).
        self.index = index
        #: Output name → its v2 tensor (``name``, ``datatype``, ``shape``, ``data``).
        self.outputs: dict[str, dict[str, Any]] = {o["name"]: o for o in outputs}

    def _owner(self) -> str:
        return f"request {self.request_id}: part {self.index}"

    def as_json(self) -> dict[str, Any]:
        """The part as JSON data: ``request_id``, ``index``, ``outputs`` (v2 tensors)."""
        return {"request_id": self.request_id, "index": self.index,
                "outputs": list(self.outputs.values())}

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {o['datatype']}{o['shape']}" for n, o in self.outputs.items())
        return f"StreamPart(request_id={self.request_id!r}, index={self.index}, outputs={{{shapes}}})"


class RequestRevoked(errors.RequestRevoked, TaskRevokedError):
    """:class:`asyncinfer.errors.RequestRevoked` as the client raises it: Celery's
    ``TaskRevokedError`` too, so code written against either catches it. Its ``__cause__`` is the
    ``TaskRevokedError`` the worker stored, where it stored one. (asyncinfer.errors imports no
    Celery: the engine raises those errors too.)"""


class RequestExpired(errors.RequestExpired, RequestRevoked):
    """:class:`asyncinfer.errors.RequestExpired` as the client raises it (a ``TaskRevokedError``
    too)."""


def stored_outcome(app: Celery, request_id: str, meta: Mapping[str, Any]) -> Any:
    """What a request's stored final state (a result meta: ``status``, ``result``) comes to, as
    its future settles it: the response (SUCCESS; an :class:`InferResponse` when the result is
    one), or the exception its ``result()`` raises (returned, not raised): a REVOKED is
    :class:`RequestRevoked` (:class:`RequestExpired` when it expired), naming the request; a
    failure that names no exception type, an :class:`~asyncinfer.errors.AsyncInferError` saying
    what was stored."""
    status = meta.get("status")
    if status == states.SUCCESS:
        result = meta["result"]
        is_response = isinstance(result, dict) and "outputs" in result and "id" in result
        return InferResponse(result) if is_response else result
    stored = python_error(app.backend, request_id, meta.get("result"))
    if isinstance(stored, RequestRevoked):
        return stored
    if isinstance(stored, TaskRevokedError):
        revoked = revoked_error(request_id, str(stored))
        revoked.__cause__ = stored
        return revoked
    if status == states.REVOKED:
        return revoked_error(request_id, "revoked")
    words = time_limit_words(stored)
    if words is not None and not words.startswith("request "):  # the pool's bare limit
        return type(stored)(f"request {request_id}: {words}")
    return stored


def time_limit_words(exc: BaseException) -> str | None:
    """Celery's time limit ``exc`` in words (its ``str()`` is its repr: ``TimeLimitExceeded(2.0,)``):
    the engine's message (it names the request), or ``time limit (2 s) exceeded`` for the bare
    limit Celery's pool stores; None for any other exception."""
    if not isinstance(exc, (TimeLimitExceeded, SoftTimeLimitExceeded)):
        return None
    kind = "time limit" if isinstance(exc, TimeLimitExceeded) else "soft time limit"
    limit = exc.args[0] if len(exc.args) == 1 else None
    if isinstance(limit, (int, float)):
        return f"{kind} ({limit:g} s) exceeded"
    return str(limit) if limit else f"{kind} exceeded"


def revoked_error(request_id: str, reason: str) -> RequestRevoked:
    """:class:`RequestRevoked` (:class:`RequestExpired` for an expired one) naming
    ``request_id``; ``reason``: what was stored (Celery's word, or a message)."""
    reason = reason.strip() or "revoked"
    named = reason.startswith(f"request {request_id}:")
    said = reason[len(f"request {request_id}:"):].strip() if named else reason
    kind = RequestExpired if said.startswith("expired") else RequestRevoked
    if named:
        return kind(reason)
    return kind(f"request {request_id}: {reason}" if said.startswith(("revoked", "expired"))
                else f"request {request_id}: revoked ({reason})")


def decode_stored(backend: Any, payload: Any) -> dict[str, Any]:
    """A stored result payload → its meta (``backend.decode_result``), a failure's ``result``
    rebuilt by :func:`python_error`: this never raises for what a failure holds. A payload that
    is no result at all (not a mapping with a ``status``) raises ``ValueError``."""
    meta = decode_meta(backend, payload)
    if not isinstance(meta, dict) or not isinstance(meta.get("status"), str):
        raise ValueError(f"not a stored result (no status): {_quoted(meta)}")
    if meta["status"] in states.EXCEPTION_STATES:
        request_id = meta.get("task_id")
        meta["result"] = python_error(backend, request_id if isinstance(request_id, str) else "?",
                                      meta.get("result"))
    return meta


def python_error(backend: Any, request_id: str, stored: Any) -> BaseException:
    """The exception a stored failure (Celery's ``exc_type``, ``exc_module``, ``exc_message``)
    holds, as Celery rebuilds it; an :class:`~asyncinfer.errors.AsyncInferError` naming the
    request and what was stored when it names no exception type a caller can be given (not a
    type, not an exception, or one that is no error: ``SystemExit``, ``StopIteration``)."""
    if isinstance(stored, BaseException):
        return stored
    try:
        rebuilt = backend.exception_to_python(stored)
    except Exception:  # noqa: BLE001 - Celery's SecurityError, ValueError, TypeError, ...
        rebuilt = None
    if not isinstance(rebuilt, BaseException):
        return AsyncInferError(f"request {request_id} failed with an error of unknown type "
                               f"{_stored_type(stored)}: {_stored_message(stored)}")
    if not isinstance(rebuilt, Exception) or isinstance(rebuilt, (StopIteration,
                                                                  StopAsyncIteration)):
        return AsyncInferError(f"request {request_id} failed with an error of type "
                               f"{_stored_type(stored)}, which is not raised to a caller: "
                               f"{_stored_message(stored)}")
    return rebuilt


def _stored_type(stored: Any) -> str:
    kind = stored.get("exc_type") if isinstance(stored, Mapping) else None
    if kind is None:
        return "(none stored)"
    module = stored.get("exc_module")
    return repr(f"{module}.{kind}" if module else str(kind))


def _stored_message(stored: Any) -> str:
    if isinstance(stored, Mapping) and stored.get("exc_type") is not None:
        return _quoted(stored.get("exc_message"))
    return _quoted(stored)


def _quoted(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "…"


class InferFuture(concurrent.futures.Future[InferResponse]):
    """A ``concurrent.futures.Future`` for one request; ``cancel()`` revokes it in Celery.

    A request the client sends in a group (client/grouped.py) may still be on its way to the
    queue when ``submit()`` returns: :meth:`sent` waits until it is there, or raises why it is
    not (the same error :meth:`result` raises then)."""

    def __init__(self, request_id: str, app: Celery, watcher: _Watcher, store: Any = None) -> None:
        super().__init__()
        self.id = request_id
        self._app = app
        self._watcher = watcher
        self._store = store  # where its outputs passed by reference are read (None: none)
        #: Held from the hand-over to a group publisher until the request is on its queue (or
        #: refused): an Event would cost a Condition and its locks per call. None: sent (or
        #: sent by someone else).
        self._sending: threading.Lock | None = None
        self._on_queue = False  # _sending released (what Event.is_set() would say)
        self._send_error: BaseException | None = None
        #: A stored result found while the request was still being sent (a caller-chosen ID sent
        #: before): its outcome once the send ends, unless the send was refused (_sent).
        self._early: dict[str, Any] | None = None

    def sent(self, timeout_s: float | None = None) -> InferFuture:
        """Wait until the request is on its queue; return this future. Raises what refused it:
        :class:`~asyncinfer.errors.QueueFull`, :class:`~asyncinfer.errors.BrokerUnavailable`,
        :class:`~asyncinfer.errors.BrokerRefused`, :class:`~asyncinfer.errors.InvalidRequest`
        (an ID already sent to another queue), :class:`~asyncinfer.errors.NotReplicated`; or
        :class:`~asyncinfer.errors.RequestTimeout` when it is not sent within ``timeout_s``;
        ``CancelledError`` when the future was cancelled before the request was sent."""
        sending = self._sending
        if sending is not None and not self._on_queue and self.cancelled():
            # cancelled before its group went: withdrawn, never sent (grouped.Entry.withdrawn)
            raise concurrent.futures.CancelledError(f"request {self.id}: cancelled")
        if sending is not None:  # taken once released, and given back at once for other waiters
            if not sending.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
                raise RequestTimeout(f"request {self.id}: not on its queue within {timeout_s:g} "
                                     f"s (waiting for room in a full queue, or for the broker)")
            sending.release()
        if self._send_error is not None:
            raise self._send_error
        return self

    def _sending_in_group(self) -> None:
        """The request is handed to a group publisher: :meth:`sent` waits for :meth:`_sent`."""
        sending = threading.Lock()
        sending.acquire()
        self._sending = sending

    def _sent(self, error: BaseException | None) -> None:
        """The request is on its queue (``error`` None), or ``error`` says why not: that is then
        this future's outcome too, whatever result was found for its ID meanwhile (an ID sent
        before with other inputs is refused, never answered with the first request's answer)."""
        self._send_error = error  # first: a _settle that sees _on_queue sees the error too
        if self._sending is not None and not self._on_queue:
            self._on_queue = True
            self._sending.release()
        if error is not None:
            try:
                self.set_exception(error)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                pass
        elif self._early is not None:
            self._settle(self._early)

    @property
    def async_result(self) -> AsyncResult:
        """Celery's view of the same request."""
        return AsyncResult(self.id, app=self._app)

    def cancel(self) -> bool:
        """Revoke the request (it will not run if it has not started) and cancel this future."""
        if not super().cancel():  # first: one not sent yet is then withdrawn from its group
            return False
        self._app.control.revoke(self.id)
        self._watcher.unwatch(self.id, self._settle)
        return True

    def result(self, timeout: float | None = None) -> InferResponse:
        """The response; raises the request's error, or :class:`RequestTimeout` (a
        ``TimeoutError`` naming the request) when it is not done within ``timeout`` seconds."""
        try:
            return super().result(timeout)
        except concurrent.futures.TimeoutError:
            raise RequestTimeout(f"request {self.id}: no result within {timeout:g} s; it may still "
                                 f"finish (look it up later by its ID)") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return super().exception(timeout)
        except concurrent.futures.TimeoutError:
            raise RequestTimeout(f"request {self.id}: not finished within {timeout:g} s") from None

    def _settle(self, meta: dict[str, Any]) -> None:
        if self.done():
            return
        if self._sending is not None and not self._on_queue:  # found before its send ended
            self._early = meta
            if not self._on_queue:  # else _sent ran meanwhile, and may not have seen it
                return
        if self._send_error is not None:
            return  # refused: its error is the outcome
        outcome = stored_outcome(self._app, self.id, meta)
        try:
            if meta.get("status") == states.SUCCESS:
                if isinstance(outcome, InferResponse):
                    outcome.store = self._store
                self.set_result(outcome)
            else:
                self.set_exception(outcome)
        except concurrent.futures.InvalidStateError:  # settled meanwhile (by _sent or another)
            pass

    def __repr__(self) -> str:
        return f"<InferFuture {self.id} {self._state}>"
