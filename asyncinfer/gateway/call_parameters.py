"""The parameters of an infer call the gateway itself reads: its ``priority`` and its expiry
(the ``timeout`` parameter or the caller's deadline); and the Triton parameters it does not
serve, each refused by name (400 / INVALID_ARGUMENT) rather than ignored: ``triton_`` keys
other than the ones served (:func:`refuse_triton_reserved`). Each unserved feature is one rule in
one function: serving it is lifting that rule. Parameters Triton does not define travel to the
worker, as Triton passes them to the backend (the table in docs/gateway.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.tensors import InferCall
from asyncinfer.wire.envelope import printable

__all__ = ["MAX_TIMEOUT_US", "OWN_PARAMETERS", "TRITON_PREFIX", "TRITON_SERVED", "priority",
           "expires_s", "refuse_unserved", "refuse_triton_reserved"]

#: The largest ``timeout`` parameter (µs) a call may give: 30 days.
MAX_TIMEOUT_US = 30 * 86400 * 1_000_000

#: Parameters the gateway itself consumes; the others travel to the worker with the request
#: (``sequence_id``, ``sequence_start``, ``sequence_end`` among them: the publish routes the
#: request to its sequence's worker, whose model gets them as its control inputs).
OWN_PARAMETERS = {"timeout", "priority", "binary_data_output", "binary_data", "binary_data_size",
                  "headers", "triton_enable_empty_final_response", "idempotency_key"}

#: Request parameter keys with this prefix are Triton's own (Triton refuses any it does not know).
TRITON_PREFIX = "triton_"
#: The ``triton_`` request parameters served, and the fronts they are served on (Triton's HTTP
#: front refuses every ``triton_`` key; its gRPC front takes this one).
TRITON_SERVED = {"triton_enable_empty_final_response": ("grpc",)}


def priority(call: InferCall) -> int | None:
    value = call.parameters.get("priority")
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise GatewayError(400, f"{call_label(call.id)}: parameter 'priority' must be a "
                                f"non-negative integer, got {value!r}")
    return min(int(value), 9)


def expires_s(call: InferCall) -> float | None:
    """The request's expiry: the ``timeout`` parameter (µs, Triton's) or the caller's deadline."""
    limits = [] if call.timeout_s is None else [call.timeout_s]
    value = call.parameters.get("timeout")
    if value is not None:
        if type(value) not in (int, float) or not 0 < value <= MAX_TIMEOUT_US:
            raise GatewayError(400, f"{call_label(call.id)}: parameter 'timeout' must be "
                                    f"a number of microseconds above 0 and at most "
                                    f"{MAX_TIMEOUT_US} (30 days), got {value!r:.40}")
        limits.append(float(value) / 1e6)
    return min(limits) if limits else None


def refuse_unserved(call: InferCall) -> None:
    """Refuse a call whose request parameters ask for a Triton feature the gateway does not serve.

    Raises:
        InvalidRequest: naming the parameter (an unknown ``triton_`` key).
    """
    refuse_triton_reserved(call.id, call.parameters, call.protocol)


def refuse_triton_reserved(call_id: str, parameters: Mapping[str, Any], protocol: str) -> None:
    """Refuse a ``triton_`` request parameter the gateway does not serve on ``protocol`` (as
    Triton refuses those it does not know), and a served one that is not a boolean.

    Raises:
        InvalidRequest: naming the parameter (Triton's words first).
    """
    for name, value in parameters.items():
        if not name.startswith(TRITON_PREFIX):
            continue
        fronts = TRITON_SERVED.get(name)
        if fronts is None or protocol not in fronts:
            allowed = [k for k, on in TRITON_SERVED.items() if protocol in on]
            raise InvalidRequest(
                f"{call_label(call_id)}: parameter keys starting with '{TRITON_PREFIX}' are "
                f"reserved for Triton usage and should not be specified: parameter "
                f"'{printable(name, 60)}' is not served over {protocol.upper()} (served: "
                f"{', '.join(allowed) or 'none'})")
        if type(value) is not bool:
            raise InvalidRequest(f"{call_label(call_id)}: invalid value type for '{name}' "
                                 f"parameter, expected a boolean, got {value!r:.40}")
