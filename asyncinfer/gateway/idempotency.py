"""A gateway call's identity: the v2 ``id`` is a label, the idempotency key is the request ID.

In Triton a request's ``id`` is a label echoed back in its response, and clients reuse small ids
("1", "7") on every call; so here too: every call is a new request, with a generated request ID,
and its response carries the ``id`` it came with, unchanged (any string: spaces, any length the
body allows). A caller who wants idempotency (send again after a timeout, and get the first
answer, never a second run) says so explicitly, by one of:

- the HTTP header ``Idempotency-Key`` (the IETF httpapi draft's name), or gRPC metadata
  ``idempotency-key`` on a unary ModelInfer;
- the request parameter ``idempotency_key`` (every front, and each request of a
  ModelStreamInfer stream, whose metadata is the stream's, not a request's).

The key becomes the request ID, claimed with the request's identity (wire/request_identity.py):
the same key with the same request is that request (its answer, one run); with another model,
version, inputs or parameters it is refused (422 / INVALID_ARGUMENT) naming what differs.
"""

from __future__ import annotations

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.tensors import InferCall
from asyncinfer.wire.envelope import MAX_REQUEST_ID_CHARS, printable, valid_request_id

__all__ = ["HEADER", "METADATA", "PARAMETER", "idempotency_key", "call_label"]

#: The HTTP header that asks for idempotency.
HEADER = "Idempotency-Key"
#: The gRPC metadata key that asks for idempotency (metadata keys are lower case).
METADATA = "idempotency-key"
#: The request parameter that asks for idempotency.
PARAMETER = "idempotency_key"


def call_label(call_id: str) -> str:
    """How a message names a call: by its v2 ``id`` (printable, cut to 60 characters)."""
    return f"request {printable(call_id, 60)}" if call_id else "request (no id)"


def idempotency_key(call: InferCall) -> str:
    """The request ID ``call`` asks for ("" for a generated one): its ``idempotency_key``
    parameter or the header / metadata the front read (:attr:`InferCall.idempotency_key`).

    Raises:
        InvalidRequest: the key is not a valid request ID, or the two given differ.
    """
    given = call.parameters.get(PARAMETER)
    if given is not None and not isinstance(given, str):
        raise InvalidRequest(f"{call_label(call.id)}: parameter '{PARAMETER}' must be a string, "
                             f"got {type(given).__name__}")
    key = given or ""
    if call.idempotency_key and key and key != call.idempotency_key:
        raise InvalidRequest(f"{call_label(call.id)}: the idempotency key is given twice and the "
                             f"two differ ({HEADER} / {METADATA} "
                             f"{printable(call.idempotency_key, 60)!r}, parameter '{PARAMETER}' "
                             f"{printable(key, 60)!r})")
    key = key or call.idempotency_key
    if key and not valid_request_id(key):
        raise InvalidRequest(f"{call_label(call.id)}: the idempotency key "
                             f"{printable(key, 60)!r} must be 1 to {MAX_REQUEST_ID_CHARS} "
                             f"printable characters without whitespace (it is the request ID)")
    return key
