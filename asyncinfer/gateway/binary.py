"""The v2 HTTP infer body, JSON or with Triton's binary tensor data extension, both ways.

A request body is a JSON header, optionally followed by raw tensors: the
``Inference-Header-Content-Length`` header gives the JSON's length, and each input carried in the
binary part says how many bytes are its own (``parameters.binary_data_size``), in input order. In a
response an output is binary when the request asked for it (``outputs[i].parameters.binary_data``,
or ``parameters.binary_data_output`` for all); its JSON then holds ``binary_data_size`` instead of
``data``. BYTES elements in binary form carry a 4-byte little-endian length each.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.tensors import (
    InferCall,
    InferResult,
    InputTensor,
    RequestedOutput,
    list_from_raw,
    raw_from_list,
)
from asyncinfer.wire.payloads import check_shape

__all__ = ["parse_infer_body", "render_infer_result", "HEADER_LENGTH"]

#: The header that gives the length of the JSON part of a binary body.
HEADER_LENGTH = "Inference-Header-Content-Length"


def _fail(request: str, rule: str) -> InvalidRequest:
    return InvalidRequest(f"{request}: {rule}")


def parse_infer_body(model: str, version: str, body: bytes, header_length: str | None) -> InferCall:
    """The call a v2 infer body describes.

    Raises:
        InvalidRequest: The body is not a v2 request (malformed JSON, a missing key, a binary part
            that does not add up, data that does not fit its datatype and shape); the message names
            the request (its ``id``, when it has one) and the rule.
    """
    json_part, binary_part = _split(body, header_length)
    try:
        header = json.loads(json_part)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(header, Mapping):
        raise InvalidRequest(f"request body must be a JSON object, got {type(header).__name__}")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest(f"request body: 'id' must be a string, got {request_id!r}")
    where = f"request {request_id or '(no id)'}"
    parameters = _parameters(where, header.get("parameters"), "request")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise _fail(where, "'inputs' must be a non-empty list")
    inputs, offset = [], 0
    for i, item in enumerate(raw_inputs):
        tensor, offset = _input(where, i, item, binary_part, offset)
        inputs.append(tensor)
    if offset != len(binary_part):
        raise _fail(where, f"the binary part holds {len(binary_part)} bytes but the inputs' "
                           f"binary_data_size add up to {offset}")
    everything_binary = bool(parameters.get("binary_data_output", False))
    outputs = None
    if header.get("outputs") is not None:
        if not isinstance(header["outputs"], list):
            raise _fail(where, "'outputs' must be a list")
        outputs = [_requested(where, o, everything_binary) for o in header["outputs"]]
    elif everything_binary:
        outputs = None  # all outputs, each binary (render_infer_result reads the parameter)
    return InferCall(model=model, version=version, id=request_id, inputs=inputs,
                     parameters=parameters, outputs=outputs, protocol="http")


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    try:
        n = int(header_length)
    except ValueError:
        raise InvalidRequest(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
    if not 0 <= n <= len(body):
        raise InvalidRequest(f"{HEADER_LENGTH} is {n} but the body has {len(body)} bytes")
    return body[:n], body[n:]


def _parameters(where: str, value: Any, whose: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(where, f"{whose} 'parameters' must be an object, got {type(value).__name__}")
    return dict(value)


def _input(where: str, i: int, item: Any, binary_part: bytes, offset: int) -> tuple[InputTensor, int]:
    if not isinstance(item, Mapping):
        raise _fail(where, f"input #{i} must be an object, got {type(item).__name__}")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(where, f"input #{i} needs a 'name' string")
    at = f"{where}: input '{name}'"
    datatype = item.get("datatype")
    if not isinstance(datatype, str):
        raise _fail(at, "needs a 'datatype' string")
    shape = list(check_shape(at, item.get("shape")))
    parameters = _parameters(at, item.get("parameters"), "input")
    size = parameters.get("binary_data_size")
    if size is not None:
        if type(size) is not int or size < 0:
            raise _fail(at, f"binary_data_size must be a non-negative integer, got {size!r}")
        if "data" in item:
            raise _fail(at, "has both 'data' and binary_data_size; send one")
        if offset + size > len(binary_part):
            raise _fail(at, f"binary_data_size {size} runs past the end of the binary part "
                            f"({len(binary_part) - offset} bytes left)")
        return InputTensor(name, datatype, shape, binary_part[offset:offset + size]), offset + size
    if "data" not in item:
        raise _fail(at, "needs 'data' (or binary_data_size for data in the binary part)")
    return InputTensor(name, datatype, shape, raw_from_list(at, datatype, shape, item["data"])), offset


def _requested(where: str, item: Any, everything_binary: bool) -> RequestedOutput:
    if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
        raise _fail(where, f"each of 'outputs' must be an object with a 'name', got {item!r:.60}")
    parameters = _parameters(f"{where}: output '{item['name']}'", item.get("parameters"), "output")
    binary = parameters.get("binary_data")
    return RequestedOutput(item["name"], bool(binary) if binary is not None else everything_binary)


def render_infer_result(call: InferCall, result: InferResult) -> tuple[bytes, int | None]:
    """The response body and, when it has a binary part, the JSON header's length."""
    everything_binary = bool(call.parameters.get("binary_data_output", False))
    binary_of = {o.name: bool(o.binary) for o in call.outputs or []}
    outputs, blobs = [], []
    for out in result.outputs:
        item: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": out.shape}
        if binary_of.get(out.name, everything_binary):
            item["parameters"] = {"binary_data_size": len(out.raw)}
            blobs.append(out.raw)
        else:
            item["data"] = list_from_raw(f"output '{out.name}'", out.datatype, out.shape, out.raw)
        outputs.append(item)
    header: dict[str, Any] = {"model_name": result.model_name, "model_version": result.model_version,
                              "outputs": outputs, "parameters": result.parameters}
    if result.id:
        header["id"] = result.id
    text = json.dumps(header, separators=(",", ":")).encode()
    if not blobs:
        return text, None
    return b"".join([text, *blobs]), len(text)
