"""A v2 call as the request it sends, and the response it gets back: the checks a call passes
before it is sent (inputs, outputs the model declares, classes, a sequence only for a stateful
model), the client's options it is sent with, and the outputs it answers with."""

from __future__ import annotations

from typing import Any

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.call_parameters import OWN_PARAMETERS, expires_s, priority
from asyncinfer.gateway.classification import check_classes
from asyncinfer.gateway.idempotency import call_label, idempotency_key
from asyncinfer.gateway.tensors import (
    InferCall,
    InferResult,
    OutputTensor,
    input_payload,
    output_tensor,
)
from asyncinfer.wire.model_versions import PARAMETER
from asyncinfer.wire.sequence import SequenceFlags, sequence_of

__all__ = ["request_of", "chosen_outputs", "result_of"]


def request_of(call: InferCall, entry: CatalogueEntry
               ) -> tuple[list[dict[str, Any]], dict[str, Any], SequenceFlags | None]:
    """``call``'s v2 inputs, the options the client sends it with, and its sequence (None: none),
    checked against ``entry`` (its model's catalogue entry).

    Raises:
        GatewayError: 400 for a call without inputs, asking for an output the model does not
            declare, with a bad ``priority`` or ``timeout``, or a sequence for a stateless model.
        InvalidRequest: classes asked of an output that has none; a malformed sequence parameter.
    """
    call_priority = priority(call)
    call_expires_s = expires_s(call)
    inputs = [input_payload(t) for t in call.inputs]
    if not inputs:
        raise GatewayError(400, f"{call_label(call.id)}: a v2 request needs at least one input")
    declared = [str(t["name"]) for t in entry.metadata.get("outputs") or []]
    if declared and call.outputs is not None:
        missing = [o.name for o in call.outputs if o.name not in declared]
        if missing:
            raise GatewayError(400, f"{call_label(call.id)}: model '{call.model}' has "
                                    f"no output {', '.join(repr(m) for m in missing)} "
                                    f"(outputs: {', '.join(repr(n) for n in declared)})")
    check_classes(call, entry)
    sequence = sequence_of(call.parameters, call_label(call.id))
    if sequence is not None and not entry.metadata.get("sequence_batching"):
        raise GatewayError(400, f"{call_label(call.id)}: model '{call.model}' is not stateful "
                                f"(it declares no sequence batching): parameter "
                                f"'sequence_id' is not served for it")
    parameters = {k: v for k, v in call.parameters.items() if k not in OWN_PARAMETERS}
    if call.version:  # /versions/{v}/infer: that version runs it
        parameters[PARAMETER] = call.version
    options = {"request_id": idempotency_key(call) or None, "parameters": parameters,
               "serializer": "msgpack", "binary": True, "expires": call_expires_s,
               "timeout_s": 0.0, "priority": call_priority, "trace": call.trace}
    return inputs, options, sequence


def chosen_outputs(call: InferCall, raw: dict[str, Any]) -> list[OutputTensor]:
    """The outputs of the v2 response ``raw`` that ``call`` asked for (all: when it named none),
    in the order it named them.

    Raises:
        GatewayError: 400, an output asked for that the answer does not have.
    """
    wanted = None if call.outputs is None else [o.name for o in call.outputs]
    outputs = {o["name"]: o for o in raw["outputs"]}
    if wanted is not None and outputs:  # none at all: a decoupled request without a part
        missing = [n for n in wanted if n not in outputs]
        if missing:
            raise GatewayError(400, f"{call_label(call.id)}: model '{call.model}' has no output "
                                    f"{', '.join(repr(m) for m in missing)} (outputs: "
                                    f"{', '.join(repr(n) for n in outputs)})")
    return [output_tensor(raw["id"], outputs[n])
            for n in (wanted if wanted is not None and outputs else list(outputs))]


def result_of(call: InferCall, entry: CatalogueEntry, raw: dict[str, Any], request_id: str,
              outputs: list[OutputTensor]) -> InferResult:
    """The answer to ``call``: its label as it came, the version that ran it, ``outputs``, and
    the worker's parameters with the request ID (to look it up later: ``asyncinfer result ID``,
    ``AsyncResult``)."""
    parameters = raw.get("parameters") or {}
    return InferResult(model_name=call.model,
                       model_version=call.version or str(parameters.get(PARAMETER)
                                                         or entry.versions[-1]),
                       id=call.id, outputs=outputs,
                       parameters={**parameters, "request_id": request_id})
