"""One v2 input or output dict ``{"name", "shape", "datatype", "data"}`` to and from numpy.

This is the client's side of the codec, and it needs numpy alone: ``from asyncinfer import
Client`` loads no torch. A torch tensor given as a value is converted by
:mod:`asyncinfer.wire.tensors` (torch is loaded then already), and :func:`output_to_torch`
loads torch when it is called. ``data`` is a flat row-major list (JSON; nested lists are
flattened) or the raw little-endian bytes of the values (msgpack); BYTES data is a list of
str/bytes elements, or one blob in the v2 binary form (each element a 4-byte little-endian
length, then its bytes). Every rule broken raises :class:`~asyncinfer.errors.InvalidRequest`
naming the input or output and the rule.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.datatypes import (
    SPECS,
    DatatypeSpec,
    cast_array,
    datatype_of_dtype,
    decode_data,
    encode_data,
    spec_for,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "array_from_value",
    "check_shape",
    "decode_payload",
    "encode_payload",
    "output_to_numpy",
    "output_to_torch",
    "to_input_payload",
]

_SEQ = (list, tuple)


def _fail(where: str, rule: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {rule}")


def check_shape(where: str, shape: object) -> tuple[int, ...]:
    """Return ``shape`` as a tuple once it is a non-empty list of non-negative integers.

    Raises:
        InvalidRequest: It is not.
    """
    if not isinstance(shape, _SEQ) or not shape or not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(where, f"shape must be a non-empty list of non-negative integers, got {shape!r}")
    return tuple(shape)


def decode_payload(
    where: str, item: Mapping[str, Any]
) -> tuple[DatatypeSpec, tuple[int, ...], npt.NDArray[Any], bool]:
    """Validate and decode one v2 input or output dict (its ``name`` is the caller's to check).

    Returns:
        The datatype, the shape, the values (an array of ``spec.dtype``; BYTES: an object array
        of str/bytes) and whether the data came as raw bytes.

    Raises:
        InvalidRequest: A key is missing or a rule of the wire contract is broken; the message
            starts with ``where``.
    """
    for key in ("shape", "datatype", "data"):
        if key not in item:
            raise _fail(where, f"missing '{key}'")
    spec = spec_for(item["datatype"], where)
    shape = check_shape(where, item["shape"])
    value, binary = decode_data(where, spec, shape, item["data"])
    return spec, shape, value, binary


def encode_payload(
    name: str, datatype: str, shape: tuple[int, ...], value: npt.NDArray[Any], binary: bool
) -> dict[str, Any]:
    """The v2 dict of values already of the datatype's numpy dtype (as decoding gives them).

    Raises:
        InvalidRequest: Unknown datatype, bad shape, or not ``prod(shape)`` elements.
    """
    where = f"tensor '{name}'"
    spec = spec_for(datatype, where)
    shape = check_shape(where, shape)
    data = encode_data(where, spec, value, math.prod(shape), binary)
    return {"name": name, "shape": list(shape), "datatype": spec.name, "data": data}


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


def _is_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a torch tensor can exist only once torch is loaded
    return torch is not None and isinstance(value, torch.Tensor)


def array_from_value(
    name: str, value: Any, datatype: str | None = None
) -> tuple[str, tuple[int, ...], npt.NDArray[Any]]:
    """The datatype, shape and numpy values of a numpy array, torch tensor, (nested) list, str
    or bytes.

    Without ``datatype`` it is inferred: from the numpy or torch dtype (numpy str, bytes and
    object arrays give BYTES); for lists, str/bytes elements give BYTES, bools BOOL, ints
    INT64 (UINT64 above the INT64 range) and floats FP32 (as ``torch.tensor`` does). A scalar
    (a 0-d array or tensor, a number, a str or bytes) becomes shape ``[1]``. The array may share
    memory with ``value``.

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
    if _is_tensor(value):
        from asyncinfer.wire.tensors import array_from_tensor, cast_tensor

        dt, t = cast_tensor(where, value, spec)
        shape = tuple(t.shape) or (1,)
        return dt, shape, array_from_tensor(dt, t).reshape(shape)
    if isinstance(value, np.ndarray) and value.dtype.kind not in "USO":
        dt = datatype_of_dtype(where, value.dtype) if spec is None else spec.name
        shape = tuple(value.shape) or (1,)
        return dt, shape, cast_array(where, SPECS[dt], value).reshape(shape)
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
    arr, _ = decode_data(where, spec, shape, flat)
    return spec.name, shape, arr


def to_input_payload(
    name: str, value: Any, binary: bool = False, datatype: str | None = None
) -> dict[str, Any]:
    """Make a v2 input dict from a value, as :func:`array_from_value` takes it.

    Args:
        name: The input name.
        value: A numpy array, torch tensor, (nested) list, str or bytes.
        binary: True to send the data as raw little-endian bytes (msgpack only).
        datatype: A v2 datatype name; None to infer it.
    """
    return encode_payload(name, *array_from_value(name, value, datatype), binary)


def _decode_output(output: Mapping[str, Any]) -> tuple[DatatypeSpec, npt.NDArray[Any]]:
    if not isinstance(output, Mapping):
        raise InvalidRequest(f"output must be a mapping, got {type(output).__name__}")
    spec, _, value, _ = decode_payload(f"output '{output.get('name', '?')}'", output)
    return spec, value


def output_to_numpy(output: Mapping[str, Any]) -> npt.NDArray[Any]:
    """Decode one v2 output dict (data as a list or raw bytes) into a numpy array of its shape.

    BF16 is upcast to float32 (exactly); BYTES gives an object array of str/bytes elements.

    Raises:
        InvalidRequest: The output breaks a rule of the wire contract.
    """
    return _decode_output(output)[1]


def output_to_torch(output: Mapping[str, Any]) -> torch.Tensor:
    """Decode one numeric v2 output dict into a torch tensor of its shape and datatype (this
    loads torch).

    Raises:
        InvalidRequest: The output is BYTES (use :func:`output_to_numpy`) or breaks a rule.
    """
    spec, value = _decode_output(output)
    if spec.dtype is None:
        raise InvalidRequest(
            f"output '{output.get('name', '?')}': BYTES has no torch form; use output_to_numpy"
        )
    from asyncinfer.wire.tensors import tensor_from_array

    return tensor_from_array(spec.name, value)
