"""The gateway's answers other than success: :class:`GatewayError` (an HTTP status, its gRPC code
and a message) and the one each error a request raised maps to."""

from __future__ import annotations

from asyncinfer import errors
from asyncinfer.client.responses import time_limit_words

__all__ = ["GatewayError", "GRPC_CODES", "error_for", "revoked_error"]

#: HTTP status → gRPC status code name.
GRPC_CODES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 409: "FAILED_PRECONDITION",
              422: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
              499: "CANCELLED", 500: "INTERNAL", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}


class GatewayError(Exception):
    """An answer other than success: an HTTP ``status`` (and its gRPC code) and a message."""

    def __init__(self, status: int, message: str, *, retry_after_s: float | None = None,
                 grpc_code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        #: The gRPC code where it is not the HTTP status' (GRPC_CODES): Triton's, for a call
        #: whose code a client may read (ALREADY_EXISTS, UNIMPLEMENTED).
        self._grpc_code = grpc_code

    @property
    def grpc_code(self) -> str:
        return self._grpc_code or GRPC_CODES.get(self.status, "UNKNOWN")


def error_for(exc: BaseException) -> GatewayError:
    """The gateway's answer to an error a request raised (submit or result). Celery's time
    limits (whose ``str()`` is their repr) in words: ``request R: time limit (2 s) exceeded ...``
    (the client's futures name the request in them, client/responses.py)."""
    message = time_limit_words(exc) or str(exc) or type(exc).__name__
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, errors.UnknownModel):
        return GatewayError(404, message)
    if isinstance(exc, errors.RequestIdReused):  # the IETF idempotency-key draft's status
        return GatewayError(422, message)
    if isinstance(exc, errors.InvalidRequest):
        return GatewayError(400, message)
    if isinstance(exc, errors.SequenceStateLost):  # the sequence must start again
        return GatewayError(409, message)
    if isinstance(exc, errors.QueueFull):
        return GatewayError(429, message, retry_after_s=1.0)
    if isinstance(exc, (errors.BrokerUnavailable, errors.RetryBudgetExhausted, errors.NotReplicated,
                        errors.RequestLost, errors.SequenceUnavailable)):
        return GatewayError(503, message)
    if isinstance(exc, (errors.RequestExpired, errors.RequestTimeout, errors.SoftTimeLimit,
                        errors.HardTimeLimit)) or type(exc).__name__ in (
                            "SoftTimeLimitExceeded", "TimeLimitExceeded"):
        return GatewayError(504, message)
    if isinstance(exc, errors.RequestRevoked) or type(exc).__name__ == "TaskRevokedError":
        return GatewayError(499, message)
    return GatewayError(500, f"{type(exc).__name__}: {message}")



def revoked_error(request_id: str, exc: BaseException) -> GatewayError:
    """The answer to Celery's TaskRevokedError for a request (the client's RequestRevoked): 504
    when it expired, else 499."""
    if isinstance(exc, errors.RequestExpired) or "expired" in str(exc):
        return GatewayError(504, f"request {request_id}: expired before a worker ran it "
                                 f"(parameter 'timeout' or the deadline)")
    if str(exc).startswith(f"request {request_id}: "):  # the client's words name it already
        return GatewayError(499, str(exc))
    return GatewayError(499, f"request {request_id}: revoked ({exc})")
