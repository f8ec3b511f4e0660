"""One exception hierarchy for the whole project.

Every error raised for a request names the request ID and the rule that was broken, so that
``AsyncResult(id).get()`` raises something a producer can act on.
"""

from __future__ import annotations

__all__ = [
    "AsyncInferError",
    "InvalidRequest",
    "UnknownModel",
    "ModelError",
    "QueueFull",
    "RequestRevoked",
    "RequestExpired",
    "BrokerUnavailable",
]


class AsyncInferError(Exception):
    """Base of every error that asyncinfer raises."""


class InvalidRequest(AsyncInferError, ValueError):
    """The request broke a rule of the wire contract or of the model's inputs.

    Never retried: the same request would fail the same way.
    """


class UnknownModel(InvalidRequest, LookupError):
    """The request names a model that configuration did not register."""


class ModelError(AsyncInferError, RuntimeError):
    """The model raised while running a request that passed validation."""


class QueueFull(AsyncInferError):
    """The model's queue is at its configured bound; the request was not accepted."""


class BrokerUnavailable(AsyncInferError, ConnectionError):
    """The broker could not be reached in the configured time."""


class RequestRevoked(AsyncInferError):
    """The request was revoked (``future.cancel()``) before it reached the device."""


class RequestExpired(RequestRevoked):
    """The request's ``expires`` passed before it reached the device; it never ran."""
