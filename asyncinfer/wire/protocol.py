"""The tensor codec between Open Inference Protocol v2 (KServe) payloads and torch tensors.

Each input or output on the wire is ``{"name", "shape", "datatype", "data"}``; ``data`` is a
flat row-major list (JSON; nested lists are flattened) or the raw little-endian bytes of the
values (msgpack). BYTES data is a list of str/bytes elements, or one blob in the v2 binary form
(each element a 4-byte little-endian length, then its bytes). Every rule broken raises
:class:`~asyncinfer.errors.InvalidRequest` naming the request, the input and the rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.datatypes import (
    DATATYPES,
    SPECS,
    DatatypeSpec,
    datatype_of,
    decode_data,
    encode_data,
    spec_for,
)

__all__ = [
    "FORWARD_STAGE",
    "request_kwargs",
    "DATATYPES",
    "Request",
    "Tensor",
    "datatype_of",
    "decode_request",
    "encode_tensor",
    "output_to_numpy",
    "output_to_torch",
    "tensor_from_value",
    "to_input_payload",
]


@dataclass(slots=True)
class Tensor:
    """One decoded input or output.

    Attributes:
        name: The input or output name.
        datatype: Its v2 datatype name.
        shape: Its shape; the first dimension is the batch dimension.
        value: A torch tensor of ``shape``, or for BYTES a numpy object array of ``shape``
            whose elements are str or bytes.
        binary: True when the data came (or should go) as raw little-endian bytes.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    value: torch.Tensor | npt.NDArray[Any]
    binary: bool


@dataclass(slots=True)
class Request:
    """One decoded inference request.

    Attributes:
        id: The request ID (the Celery task ID).
        model: The model name.
        inputs: The decoded inputs, in request order.
        parameters: The request's ``parameters`` (empty when absent).
        binary_output: Whether outputs should go back as raw bytes: True when any input used
            raw bytes, unless ``parameters["binary_data_output"]`` says otherwise.
    """

    id: str
    model: str
    inputs: list[Tensor]
    parameters: dict[str, Any]
    binary_output: bool


_SEQ = (list, tuple)


def _fail(where: str, rule: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {rule}")


def _check_shape(where: str, shape: object) -> tuple[int, ...]:
    if not isinstance(shape, _SEQ) or not shape or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(where, f"shape must be a non-empty list of non-negative integers, got {shape!r}")
    return tuple(shape)


def _decode_tensor(where: str, item: Mapping[str, Any], name: str) -> Tensor:
    for key in ("shape", "datatype", "data"):
        if key not in item:
            raise _fail(where, f"missing '{key}'")
    spec = spec_for(item["datatype"], where)
    shape = _check_shape(where, item["shape"])
    value, binary = decode_data(where, spec, shape, item["data"])
    return Tensor(name, spec.name, shape, value, binary)


def decode_request(request_id: str, kwargs: Mapping[str, Any]) -> Request:
    """Validate and decode the keyword arguments of one v2 inference request.

    Args:
        request_id: The request (task) ID, named in every error message.
        kwargs: ``{"model", "inputs", "parameters"?}`` as the task received them; unknown
            extra keys are ignored.

    Returns:
        The decoded request; each numeric input is a torch tensor, each BYTES input a numpy
        object array.

    Raises:
        InvalidRequest: A rule of the wire contract is broken; the message starts with
            ``request <id>: `` and names the input and the rule.
    """
    req = f"request {request_id}"
    if not isinstance(kwargs, Mapping):
        raise _fail(req, f"request must be a mapping of keyword arguments, got {type(kwargs).__name__}")
    model = kwargs.get("model")
    if not isinstance(model, str) or not model:
        got = "it is missing" if "model" not in kwargs else f"got {model!r}"
        raise _fail(req, f"'model' must be a non-empty string; {got}")
    params = kwargs.get("parameters")
    if params is None:
        params = {}
    elif not isinstance(params, Mapping):
        raise _fail(req, f"'parameters' must be a mapping, got {type(params).__name__}")
    override = params.get("binary_data_output")
    if "binary_data_output" in params and not isinstance(override, bool):
        raise _fail(req, f"parameters['binary_data_output'] must be a bool, got {override!r}")
    if "inputs" not in kwargs:
        raise _fail(req, "missing 'inputs'")
    items = kwargs["inputs"]
    if not isinstance(items, _SEQ) or not items:
        raise _fail(req, f"'inputs' must be a non-empty list, got {items!r:.60}")
    inputs: list[Tensor] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise _fail(req, f"input #{i} must be a mapping, got {type(item).__name__}")
        if "name" not in item:
            raise _fail(req, f"input #{i}: missing 'name'")
        name = item["name"]
        if not isinstance(name, str) or not name:
            raise _fail(req, f"input #{i}: 'name' must be a non-empty string, got {name!r}")
        where = f"{req}: input '{name}'"
        if name in seen:
            raise _fail(where, f"duplicate input name (input #{seen[name]} has it too)")
        seen[name] = i
        inputs.append(_decode_tensor(where, item, name))
    binary = any(t.binary for t in inputs) if override is None else override
    return Request(str(request_id), model, inputs, dict(params), binary)


def encode_tensor(t: Tensor, binary: bool) -> dict[str, Any]:
    """Encode one tensor as a v2 input/output dict ``{"name", "shape", "datatype", "data"}``.

    Args:
        t: The tensor; a numeric value is cast to ``t.datatype`` and moved to the CPU.
        binary: True for raw little-endian bytes, False for a flat list. BYTES data is a list
            of its elements either way, each kept as it came (str stays str, bytes stays bytes).

    Raises:
        InvalidRequest: Unknown datatype, or the value does not hold ``prod(shape)`` elements.
    """
    where = f"tensor '{t.name}'"
    spec = spec_for(t.datatype, where)
    shape = _check_shape(where, t.shape)
    data = encode_data(where, spec, t.value, math.prod(shape), binary)
    return {"name": t.name, "shape": list(shape), "datatype": spec.name, "data": data}


def _nested(where: str, value: list[Any] | tuple[Any, ...]) -> tuple[list[int], list[Any], set[type]]:
    """Return the shape, the flat elements and their types of a rectangular nested list."""
    shape, flat = [len(value)], list(value)
    while True:
        types = set(map(type, flat))
        if not types & {list, tuple}:
            return shape, flat, types
        lens = set(map(len, flat)) if types <= {list, tuple} else set()
        if len(lens) != 1:
            raise _fail(where, "nested lists are ragged (rows of different lengths or depths)")
        shape.append(lens.pop())
        flat = list(chain.from_iterable(flat))


def _infer(flat: list[Any], types: set[type]) -> str:
    if types and types <= {str, bytes}:
        return "BYTES"
    if types and types <= {bool}:
        return "BOOL"
    if types and types <= {int} and max(flat) > 2**63 - 1 and min(flat) >= 0:
        return "UINT64"
    return "INT64" if types and types <= {int, bool} else "FP32"


def tensor_from_value(name: str, value: Any, datatype: str | None = None) -> Tensor:
    """Make a :class:`Tensor` from a torch tensor, numpy array, (nested) list, str or bytes.

    Without ``datatype`` it is inferred: from the torch or numpy dtype (numpy str, bytes and
    object arrays give BYTES); for lists, str/bytes elements give BYTES, bools BOOL, ints
    INT64 (UINT64 above the INT64 range) and floats FP32 (as ``torch.tensor`` does). A scalar
    (a 0-d tensor or array, a number, a str or bytes) becomes shape ``[1]``.

    Args:
        name: The input or output name.
        value: The values.
        datatype: A v2 datatype name to cast numeric values to; None to infer it.

    Raises:
        InvalidRequest: Unsupported value or dtype, ragged lists, or elements that do not fit
            ``datatype``.
    """
    where = f"tensor '{name}'"
    spec = None if datatype is None else spec_for(datatype, where)
    if isinstance(value, (str, bytes, bytearray, bool, int, float)):
        value = [value]
    elif isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray) and value.dtype.kind not in "USO":
        value = torch.from_numpy(value.astype(value.dtype.newbyteorder("="), copy=True))
    if isinstance(value, torch.Tensor):
        dt = datatype_of(value)
        if spec is not None and spec.name != dt:
            if spec.torch_dtype is None:
                raise _fail(where, f"cannot make BYTES from a torch tensor of {dt}")
            value, dt = value.to(spec.torch_dtype), spec.name
        value = value.detach().reshape(value.shape or (1,))
        return Tensor(name, dt, tuple(value.shape), value, False)
    if isinstance(value, np.ndarray):
        shape = tuple(value.shape) or (1,)
        flat = value.astype(object).reshape(-1).tolist()
        types = set(map(type, flat))
    elif isinstance(value, _SEQ):
        shape_list, flat, types = _nested(where, value)
        shape = tuple(shape_list)
    else:
        raise _fail(where, f"cannot make a tensor from a {type(value).__name__}")
    if bytearray in types:
        flat = [bytes(x) if isinstance(x, bytearray) else x for x in flat]
        types = set(map(type, flat))
    spec = spec or SPECS[_infer(flat, types)]
    val, _ = decode_data(where, spec, shape, flat)
    return Tensor(name, spec.name, shape, val, False)


def to_input_payload(
    name: str, value: Any, binary: bool = False, datatype: str | None = None
) -> dict[str, Any]:
    """Make a v2 input dict from a value, as :func:`tensor_from_value` takes it.

    Args:
        name: The input name.
        value: A torch tensor, numpy array, (nested) list, str or bytes.
        binary: True to send the data as raw little-endian bytes (msgpack only).
        datatype: A v2 datatype name; None to infer it.
    """
    return encode_tensor(tensor_from_value(name, value, datatype), binary)


def _decode_output(output: Mapping[str, Any]) -> tuple[DatatypeSpec, torch.Tensor | npt.NDArray[Any]]:
    if not isinstance(output, Mapping):
        raise InvalidRequest(f"output must be a mapping, got {type(output).__name__}")
    where = f"output '{output.get('name', '?')}'"
    for key in ("shape", "datatype", "data"):
        if key not in output:
            raise _fail(where, f"missing '{key}'")
    spec = spec_for(output["datatype"], where)
    shape = _check_shape(where, output["shape"])
    return spec, decode_data(where, spec, shape, output["data"])[0]


def output_to_numpy(output: Mapping[str, Any]) -> npt.NDArray[Any]:
    """Decode one v2 output dict (data as a list or raw bytes) into a numpy array of its shape.

    BF16 is upcast to float32 (exactly); BYTES gives an object array of str/bytes elements.

    Raises:
        InvalidRequest: The output breaks a rule of the wire contract.
    """
    spec, value = _decode_output(output)
    if isinstance(value, np.ndarray):
        return value
    return (value.float() if spec.name == "BF16" else value).numpy()


def output_to_torch(output: Mapping[str, Any]) -> torch.Tensor:
    """Decode one numeric v2 output dict into a torch tensor of its shape and datatype.

    Raises:
        InvalidRequest: The output is BYTES (use :func:`output_to_numpy`) or breaks a rule.
    """
    _, value = _decode_output(output)
    if not isinstance(value, torch.Tensor):
        raise InvalidRequest(
            f"output '{output.get('name', '?')}': BYTES has no torch form; use output_to_numpy"
        )
    return value


#: ``parameters["stage"]`` of a request that a ``asyncinfer.preprocess`` task already prepared:
#: the device runs only the model's forward, and ``asyncinfer.postprocess`` finishes it. Any
#: producer can set it, so it switches no check off: the device checks the tensors against what
#: the forward takes (:meth:`Model.validate_forward`).
FORWARD_STAGE = "forward"


def request_kwargs(request_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """The v2 request of a task call: its keyword arguments, or — in a Celery chain, where the
    previous task's result comes first — one positional v2 request and no keyword arguments."""
    if not args:
        return kwargs
    if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
        return args[0]
    raise _fail(f"request {request_id}",
                "positional arguments are not accepted; send the v2 request (model, inputs, "
                "parameters) as keyword arguments, or as the one argument a chain passes")
