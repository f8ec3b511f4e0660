"""The v2 HTTP infer body, JSON or with Triton's binary tensor data extension, both ways.

A request body is a JSON header, optionally followed by raw tensors: the
``Inference-Header-Content-Length`` header gives the JSON's length, and each input carried in the
binary part says how many bytes are its own (``parameters.binary_data_size``), in input order. In a
response an output is binary when the request asked for it (``outputs[i].parameters.binary_data``,
or ``parameters.binary_data_output`` for all); its JSON then holds ``binary_data_size`` instead of
``data``. BYTES elements in binary form carry a 4-byte little-endian length each.

Everything a request says is checked here, before anything is sent: a binary input's bytes must
fit its datatype and shape (counted, never decoded or allocated from the shape), input names must
be unique, a request ``id`` must be a valid request ID, and JSON nested deeper than the parser's
recursion limit is refused as a bad request, not a server error.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Mapping
from typing import Any

from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.shared_memory import shm_reference
from asyncinfer.gateway.tensors import (
    InferCall,
    InferResult,
    InputTensor,
    RequestedOutput,
    check_raw,
    list_from_raw,
    raw_from_list,
)
from asyncinfer.wire import json_text
from asyncinfer.wire.datatypes import spec_for
from asyncinfer.wire.envelope import printable
from asyncinfer.wire.payloads import check_shape
from asyncinfer.wire.tensor_refs import ref_of

__all__ = ["parse_infer_body", "render_infer_result", "check_binary_input", "check_unique_names",
           "HEADER_LENGTH"]

#: The header that gives the length of the JSON part of a binary body.
HEADER_LENGTH = "Inference-Header-Content-Length"


_DIGITS = re.compile(r"[0-9]+")
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 40, 40
#: A short repr of a value a client sent (a huge or deeply nested one is cut, never expanded).
_short = _REPR.repr


def _fail(request: str, rule: str) -> InvalidRequest:
    return InvalidRequest(f"{request}: {rule}")


def check_unique_names(where: str, names: list[str]) -> None:
    """Raise InvalidRequest when two inputs have the same name (the worker's rule, applied here
    so that such a request is never sent)."""
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in seen:
            raise _fail(f"{where}: input '{name}'", f"duplicate input name (input #{seen[name]} "
                                                    f"has it too)")
        seen[name] = i


def check_binary_input(at: str, datatype: str, shape: list[int], raw: bytes) -> None:
    """Raise InvalidRequest unless ``raw`` is ``prod(shape)`` elements of ``datatype`` in the v2
    binary form: a known datatype, exactly ``count × itemsize`` bytes (BOOL bytes 0 or 1), or for
    BYTES well-formed length prefixes. Nothing is allocated from the shape: a shape of 2**40
    elements with a few bytes of data is refused by arithmetic."""
    spec = spec_for(datatype, at)
    count = math.prod(shape)
    if spec.kind == "bytes":
        if len(raw) < 4 * count:  # each element has at least its 4-byte length
            raise _fail(at, f"BYTES binary data has {len(raw)} bytes, too few for the "
                            f"{count} elements the shape needs (4-byte length each)")
        check_raw(at, datatype, shape, raw)
        return
    need = count * spec.itemsize
    if len(raw) != need:
        raise _fail(at, f"raw data has {len(raw)} bytes but {count} {spec.name} elements need "
                        f"{need} ({spec.itemsize} bytes each)")
    if spec.name == "BOOL" and raw.translate(None, b"\x00\x01"):
        i = next(i for i, b in enumerate(raw) if b > 1)
        raise _fail(at, f"raw byte {i} is {raw[i]}; BOOL raw bytes must be 0 or 1")


def parse_infer_body(model: str, version: str, body: bytes, header_length: str | None) -> InferCall:
    """The call a v2 infer body describes.

    Raises:
        InvalidRequest: The body is not a v2 request (malformed JSON, a missing key, a binary part
            that does not add up, data that does not fit its datatype and shape); the message names
            the request (its ``id``, when it has one) and the rule.
    """
    json_part, binary_part = _split(body, header_length)
    try:
        header = json_text.loads(json_part)  # json.loads' meaning and errors, faster
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("request body is not valid JSON: it nests arrays or objects too "
                             "deeply") from None
    if not isinstance(header, Mapping):
        raise InvalidRequest(f"request body must be a JSON object, got {type(header).__name__}")
    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest(f"request body: 'id' must be a string, got {_short(request_id)}")
    where = call_label(request_id)
    parameters = _parameters(where, header.get("parameters"), "request")
    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise _fail(where, "'inputs' must be a non-empty list")
    inputs, offset = [], 0
    for i, item in enumerate(raw_inputs):
        tensor, offset = _input(where, i, item, binary_part, offset)
        inputs.append(tensor)
    check_unique_names(where, [t.name for t in inputs])
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
    text = header_length.strip()
    if not _DIGITS.fullmatch(text):
        raise InvalidRequest(f"{HEADER_LENGTH} must be a non-negative integer, got "
                             f"{_short(header_length)}")
    if len(text) > 18 or int(text) > len(body):
        shown = text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"
        raise InvalidRequest(f"{HEADER_LENGTH} is {shown} but the body has {len(body)} bytes")
    n = int(text)
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
    at = f"{where}: input '{printable(name, 100)}'"
    datatype = item.get("datatype")
    if not isinstance(datatype, str):
        raise _fail(at, "needs a 'datatype' string")
    shape = list(check_shape(at, item.get("shape")))
    parameters = _parameters(at, item.get("parameters"), "input")
    url = ref_of(item, at)
    if url is not None:  # its data in the fleet's tensor store: passed on as it is
        if "binary_data_size" in parameters or "shared_memory_region" in parameters:
            raise _fail(at, "only one of 'data', 'binary_data_size', 'shared_memory_region' and "
                            "'data_ref' in 'parameters' may be set")
        return InputTensor(name, datatype, shape, b"", ref=url), offset
    shm = shm_reference(at, parameters)
    size = parameters.get("binary_data_size")
    if shm is not None:
        if "data" in item or size is not None:
            raise _fail(at, "only one of 'data', 'binary_data_size' in 'parameters', "
                            "'shared_memory_region' in 'parameters' may be set")
        return InputTensor(name, datatype, shape, b"", shm=shm), offset
    if size is not None:
        if type(size) is not int or size < 0:
            raise _fail(at, f"binary_data_size must be a non-negative integer, got {_short(size)}")
        if "data" in item:
            raise _fail(at, "has both 'data' and binary_data_size; send one")
        if offset + size > len(binary_part):
            raise _fail(at, f"binary_data_size {size} runs past the end of the binary part "
                            f"({len(binary_part) - offset} bytes left)")
        raw = binary_part[offset:offset + size]
        check_binary_input(at, datatype, shape, raw)
        return InputTensor(name, datatype, shape, raw), offset + size
    if "data" not in item:
        raise _fail(at, "needs 'data' (or binary_data_size for data in the binary part)")
    return InputTensor(name, datatype, shape, raw_from_list(at, datatype, shape, item["data"])), offset


def _requested(where: str, item: Any, everything_binary: bool) -> RequestedOutput:
    if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
        raise _fail(where, f"each of 'outputs' must be an object with a 'name', got {_short(item)}")
    at = f"{where}: output '{printable(item['name'], 100)}'"
    parameters = _parameters(at, item.get("parameters"), "output")
    shm = shm_reference(at, parameters)
    binary = parameters.get("binary_data")
    if shm is not None and binary:
        raise _fail(at, "Output can't set both 'shared_memory_region' and 'binary_data'")
    classes = parameters.get("classification", 0)
    if type(classes) is not int or classes < 0:  # 0: none (Triton's HTTP front reads it so)
        raise _fail(at, f"parameter 'classification' must be a non-negative integer (how many "
                        f"classes to return), got {_short(classes)}")
    return RequestedOutput(item["name"], bool(binary) if binary is not None else everything_binary,
                           classification=classes, shm=shm)


def render_infer_result(call: InferCall, result: InferResult) -> tuple[bytes, int | None]:
    """The response body and, when it has a binary part, the JSON header's length."""
    everything_binary = bool(call.parameters.get("binary_data_output", False))
    binary_of = {o.name: bool(o.binary) for o in call.outputs or []}
    outputs, blobs = [], []
    for out in result.outputs:
        item: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": out.shape}
        if out.shm is not None:
            pass  # in its shared-memory region, as Triton answers: no data, no binary part
        elif out.ref is not None:
            item["parameters"] = {"data_ref": out.ref}  # in the tensor store: its URL
        elif binary_of.get(out.name, everything_binary):
            item["parameters"] = {"binary_data_size": len(out.raw)}
            blobs.append(out.raw)
        else:
            item["data"] = list_from_raw(f"output '{out.name}'", out.datatype, out.shape, out.raw)
        outputs.append(item)
    header: dict[str, Any] = {"model_name": result.model_name, "model_version": result.model_version,
                              "outputs": outputs, "parameters": result.parameters}
    if result.id:
        header["id"] = result.id
    text = json_text.dumps(header)  # json.dumps' meaning, faster
    if not blobs:
        return text, None
    return b"".join([text, *blobs]), len(text)
