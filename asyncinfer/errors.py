"""One exception hierarchy for the whole project.

Every error raised for a request names the request ID and the rule that was broken, so that
``AsyncResult(id).get()`` raises something a producer can act on.
"""

from __future__ import annotations

__all__ = [
    "AsyncInferError",
    "InvalidRequest",
    "UnknownModel",
    "RequestIdReused",
    "ModelError",
    "QueueFull",
    "RequestRevoked",
    "RequestExpired",
    "BrokerUnavailable",
    "BrokerRefused",
    "StoreUnavailable",
    "RequestTimeout",
    "RequestUnknown",
    "RequestLost",
    "TransientError",
    "TransientModelError",
    "RetryBudgetExhausted",
    "NotReplicated",
    "SoftTimeLimit",
    "HardTimeLimit",
    "WorkerLost",
    "StreamTruncated",
    "SequenceNotStarted",
    "SequenceStateLost",
    "SequenceUnavailable",
]


class AsyncInferError(Exception):
    """Base of every error that asyncinfer raises."""


class InvalidRequest(AsyncInferError, ValueError):
    """The request broke a rule of the wire contract or of the model's inputs.

    Never retried: the same request would fail the same way.
    """


class UnknownModel(InvalidRequest, LookupError):
    """The request names a model that configuration did not register."""


class RequestIdReused(InvalidRequest):
    """A caller-chosen request ID was sent before with a different model, version, inputs or
    parameters; the message names the ID and what differs. Nothing was sent: an ID names one
    request, and its answer would be the first one's."""


class ModelError(AsyncInferError, RuntimeError):
    """The model raised while running a request that passed validation."""


class TransientError(AsyncInferError):
    """A failure worth retrying: the same request may well succeed on a later attempt.

    A model raises it (or the device raises out-of-memory or a device runtime error) to have the
    request retried with backoff, within ``max_retries`` and the fleet's retry budget.
    """


class TransientModelError(ModelError, TransientError):
    """The model failed in a way worth retrying (device out of memory, device runtime error)."""


class RetryBudgetExhausted(AsyncInferError):
    """A transient failure was not retried: the fleet's retry budget is spent.

    Retries may be at most ``ASYNCINFER_RETRY_BUDGET_RATIO`` of recent requests plus
    ``ASYNCINFER_RETRY_BUDGET_MIN``; past that, requests fail fast instead of multiplying load.
    """


class QueueFull(AsyncInferError):
    """The model's queue is at its configured bound; the request was not accepted."""


class BrokerUnavailable(AsyncInferError, ConnectionError):
    """The broker could not be reached in the configured time."""


class NotReplicated(AsyncInferError):
    """A write reached the Redis master, but fewer replicas than ``ASYNCINFER_SUBMIT_REPLICAS``
    confirmed it in time: a failover now could lose it. A request submitted with a ``request_id``
    may be submitted again safely (the second is recognised as the first).

    Attributes: ``confirmed`` and ``required`` replicas.
    """

    def __init__(self, message: str, *, confirmed: int = 0, required: int = 0) -> None:
        super().__init__(message)
        self.confirmed, self.required = confirmed, required


class StoreUnavailable(TransientError, ConnectionError):
    """The tensor store (``ASYNCINFER_TENSOR_STORE_URL``) could not be written or read: the message
    names the store, the object and the reason. Transient: a worker retries the request (Celery's
    retry options) before it fails it."""


class BrokerRefused(AsyncInferError):
    """The broker answered but refused the request: out of memory, read-only, not permitted."""


class RequestTimeout(AsyncInferError, TimeoutError):
    """No result within the time a caller waited; the request itself may still finish."""


class RequestUnknown(RequestTimeout):
    """Nothing exists for a request ID in Redis (no result, trace, queue entry, taken entry or
    stream: a mistyped ID), said at once instead of after the whole wait
    (client/request_lookup.py). A :class:`RequestTimeout`, so code that catches the timeout
    catches it too."""


class RequestLost(AsyncInferError):
    """The broker no longer has a request it accepted: no result is stored, and the trace the
    client wrote in the same step as the push is gone with the message (Redis restarted without
    its last writes, or a failover lost them). It will never be answered; send it again with the
    same ``request_id`` (if a result was stored meanwhile, that send returns it, not a second run).
    """


class RequestRevoked(AsyncInferError):
    """The request was revoked (``future.cancel()``) before it reached the device."""


class RequestExpired(RequestRevoked):
    """The request's ``expires`` passed before it reached the device; it never ran."""


class SoftTimeLimit(TransientError):
    """The engine's soft time limit passed (retried like any transient failure). The worker
    reports it as Celery's ``SoftTimeLimitExceeded``."""


class HardTimeLimit(AsyncInferError):
    """The engine's hard time limit passed. The worker reports it as Celery's
    ``TimeLimitExceeded``."""


class WorkerLost(AsyncInferError):
    """Workers died while this request was on their device, ``ASYNCINFER_MAX_WORKER_DEATHS``
    times: it is not run again (it may be what kills them). Not retried; dead-lettered where the
    model keeps dead letters."""


class StreamTruncated(AsyncInferError):
    """A reader started after parts of a request's stream were trimmed (the model's
    ``stream_max_parts``): it names the request and the first part still held. The request's
    final result (``AsyncResult(id)``) still holds every part, joined."""


class SequenceNotStarted(InvalidRequest):
    """A request of a sequence (v2 parameter ``sequence_id``) that no live sequence of its model
    has: it is not the sequence's first request (``sequence_start``) and the sequence was never
    started, has ended, or was idle past the model's sequence timeout (its state released). The
    message starts with Triton's words ("inference request for sequence N to model 'M' must
    specify the START flag on the first request of the sequence"). Nothing ran."""


class SequenceStateLost(AsyncInferError):
    """The state of a request's sequence is gone: the worker that held it died, stopped, or no
    longer serves the model, before this request ran. It names the sequence, the model and the
    worker. Never retried (another worker has no state of the sequence) and never run on a fresh
    state: start the sequence again (``sequence_start``)."""


class SequenceUnavailable(AsyncInferError):
    """A sequence cannot start: no live worker serves its model's sequences (the model is not
    stateful, or no worker hosting it runs). Nothing was sent; start it again once one runs."""
