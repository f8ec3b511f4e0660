"""Decoded v2 requests as the worker sees them: each numeric input a torch tensor.

Each input or output on the wire is ``{"name", "shape", "datatype", "data"}``;
:mod:`asyncinfer.wire.payloads` decodes and encodes one with numpy (the client uses it alone, and
loads no torch), :mod:`asyncinfer.wire.tensors` turns its arrays into tensors and back. Every
rule broken raises :class:`~asyncinfer.errors.InvalidRequest` naming the request, the input and
the rule. The client helpers are re-exported here for the callers that import them from this
module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.datatypes import cast_array, encode_data, spec_for
from asyncinfer.wire.payloads import (
    array_from_value,
    check_shape,
    decode_payload,
)
from asyncinfer.wire.tensors import array_from_tensor, cast_tensor, tensor_from_array

__all__ = [
    "FORWARD_STAGE",
    "request_kwargs",
    "Request",
    "Tensor",
    "decode_request",
    "encode_tensor",
    "tensor_from_value",
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


def _decode_tensor(where: str, item: Mapping[str, Any], name: str) -> Tensor:
    spec, shape, value, binary = decode_payload(where, item)
    if spec.dtype is not None:
        return Tensor(name, spec.name, shape, tensor_from_array(spec.name, value), binary)
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
        t: The tensor; a numeric value (torch tensor or numpy array) is cast to ``t.datatype``
            and moved to the CPU.
        binary: True for raw little-endian bytes, False for a flat list. BYTES data is a list
            of its elements either way, each kept as it came (str stays str, bytes stays bytes).

    Raises:
        InvalidRequest: Unknown datatype, or the value does not hold ``prod(shape)`` elements.
    """
    where = f"tensor '{t.name}'"
    spec = spec_for(t.datatype, where)
    shape = check_shape(where, t.shape)
    value: Any = t.value
    if spec.dtype is None:
        if isinstance(value, torch.Tensor):
            raise _fail(where, "a BYTES value must be a numpy object array, not a torch tensor")
    elif isinstance(value, torch.Tensor):
        value = array_from_tensor(spec.name, value)
    else:
        value = cast_array(where, spec, value)
    data = encode_data(where, spec, value, math.prod(shape), binary)
    return {"name": t.name, "shape": list(shape), "datatype": spec.name, "data": data}


def tensor_from_value(name: str, value: Any, datatype: str | None = None) -> Tensor:
    """Make a :class:`Tensor` from a torch tensor, numpy array, (nested) list, str or bytes.

    The datatype is inferred (or ``value`` cast to ``datatype``) as
    :func:`~asyncinfer.wire.payloads.array_from_value` does; a torch tensor keeps its dtype. A
    numpy array is copied, so that the tensor does not change with it. InvalidRequest for values
    that cannot be a v2 tensor.
    """
    if isinstance(value, torch.Tensor):
        where = f"tensor '{name}'"
        dt, t = cast_tensor(where, value, None if datatype is None else spec_for(datatype, where))
        t = t.detach().reshape(t.shape or (1,))
        return Tensor(name, dt, tuple(t.shape), t, False)
    dt, shape, arr = array_from_value(name, value, datatype)
    if dt == "BYTES":
        return Tensor(name, dt, shape, arr, False)
    if isinstance(value, np.ndarray) and np.may_share_memory(arr, value):
        arr = arr.copy()
    return Tensor(name, dt, shape, tensor_from_array(dt, arr), False)


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
