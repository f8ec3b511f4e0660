"""The parameters of an infer call the gateway itself reads: its ``priority`` and its expiry
(the ``timeout`` parameter or the caller's deadline)."""

from __future__ import annotations

from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.tensors import InferCall

__all__ = ["MAX_TIMEOUT_US", "OWN_PARAMETERS", "priority", "expires_s"]

#: The largest ``timeout`` parameter (µs) a call may give: 30 days.
MAX_TIMEOUT_US = 30 * 86400 * 1_000_000

#: Parameters the gateway itself consumes; the others travel to the worker with the request
#: (``sequence_id``, ``sequence_start``, ``sequence_end`` among them: the publish routes the
#: request to its sequence's worker, whose model gets them as its control inputs).
OWN_PARAMETERS = {"timeout", "priority", "binary_data_output", "binary_data", "binary_data_size",
                  "headers", "triton_enable_empty_final_response", "idempotency_key"}


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
