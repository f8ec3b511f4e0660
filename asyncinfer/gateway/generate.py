"""Triton's generate extension, both ways: a generate request body as an :class:`InferCall`, a
result (or one part of it) as a generate response object.

A generate request is one JSON object whose keys are the model's input names (a string, number
or boolean, or a flat list of them) and anything else, which becomes a request parameter, as do
the keys of its ``parameters`` object (a key there that names an input is that input, as in
Triton). ``id`` is the request ID. An input's shape comes from the model's declared shape and
its element count, as Triton derives it: the fixed dimensions take their share, the innermost
variable one the rest, the other variable ones 1 (``text_input`` of shape ``[-1, 1]`` and one
string: ``[1, 1]``).

The answer is one JSON object: ``id`` (when the request gave one), ``model_name``,
``model_version``, the response's parameters, and each output by name — its one element, or a
flat list of its elements.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.tensors import InferCall, InferResult, InputTensor, list_from_raw, raw_from_list

__all__ = ["generate_call", "generate_response"]

_SCALARS = (str, int, float, bool)


def generate_call(model: str, version: str, body: bytes, inputs: list[Mapping[str, Any]]
                  ) -> InferCall:
    """The call a generate request ``body`` makes of ``model``, whose declared ``inputs`` (the
    catalogue's ``name``, ``datatype``, ``shape`` with -1 for a variable size) say which keys
    are tensors.

    Raises:
        InvalidRequest: The body is not a JSON object, its ``id`` is not a valid request ID,
            ``parameters`` is not an object, a parameter is not a string, number or boolean, an
            input is not a scalar or a flat list of its datatype, or its elements do not fit its
            declared shape.
    """
    try:
        request = json.loads(body or b"{}")
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"generate request for model '{model}': the body is not JSON "
                             f"({exc})") from None
    if not isinstance(request, dict):
        raise InvalidRequest(f"generate request for model '{model}': the body must be a JSON "
                             f"object, got {type(request).__name__}")
    request_id = request.pop("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest(f"generate request for model '{model}': 'id' must be a string, got "
                             f"{type(request_id).__name__}")
    where = call_label(request_id)
    nested = request.pop("parameters", None) or {}
    if not isinstance(nested, dict):
        raise InvalidRequest(f"{where}: 'parameters' must be a JSON object, got "
                             f"{type(nested).__name__}")
    declared = {str(t["name"]): t for t in inputs}
    tensors: list[InputTensor] = []
    parameters: dict[str, Any] = {}
    for key, value in [*request.items(), *nested.items()]:
        if key in declared:
            if any(t.name == key for t in tensors):
                raise InvalidRequest(f"{where}: input '{key}' is given twice (at the top level "
                                     f"and in 'parameters')")
            tensors.append(_tensor(where, declared[key], value))
        elif isinstance(value, _SCALARS):
            parameters[key] = value
        else:
            raise InvalidRequest(f"{where}: '{key}' is neither an input of model '{model}' "
                                 f"(inputs: {', '.join(repr(n) for n in declared) or 'none'}) nor "
                                 f"a parameter (a string, number or boolean)")
    return InferCall(model=model, version=version, id=request_id, inputs=tensors,
                     parameters=parameters, protocol="http")


def _tensor(where: str, spec: Mapping[str, Any], value: Any) -> InputTensor:
    name, datatype = str(spec["name"]), str(spec["datatype"])
    at = f"{where}: input '{name}'"
    elements = value if isinstance(value, list) else [value]
    if not all(isinstance(x, _SCALARS) for x in elements):
        raise InvalidRequest(f"{at}: must be a string, number or boolean, or a flat list of them")
    shape = input_shape(at, [int(d) for d in spec.get("shape") or []], len(elements))
    return InputTensor(name, datatype, shape, raw_from_list(at, datatype, shape, elements))


def input_shape(at: str, declared: list[int], count: int) -> list[int]:
    """The shape ``count`` elements take in the ``declared`` shape (-1: variable), as Triton's
    generate endpoint derives it.

    Raises:
        InvalidRequest: ``count`` elements do not fit that shape.
    """
    rest = count
    for d in declared:
        if d >= 0:
            if d == 0 or rest % d:
                raise InvalidRequest(f"{at}: {count} element(s) do not fit its shape {declared}")
            rest //= d
    shape = list(declared)
    for i in reversed(range(len(shape))):
        if shape[i] < 0:
            shape[i], rest = rest, 1
    if rest != 1 or math.prod(shape) != count:
        raise InvalidRequest(f"{at}: {count} element(s) do not fit its shape {declared}")
    return shape


def generate_response(result: InferResult) -> dict[str, Any]:
    """The generate response object of ``result`` (a whole answer or one part)."""
    answer: dict[str, Any] = {}
    if result.id:
        answer["id"] = result.id
    answer["model_name"] = result.model_name
    answer["model_version"] = result.model_version
    for key, value in result.parameters.items():
        if isinstance(value, _SCALARS):
            answer[key] = value
    for output in result.outputs:
        data = list_from_raw(f"request {result.id or '(no id)'}: output '{output.name}'",
                             output.datatype, output.shape, output.raw)
        answer[output.name] = data[0] if len(data) == 1 else data
    return answer
