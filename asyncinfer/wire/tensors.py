"""Torch's side of the v2 datatypes: which torch dtype holds each, and the conversions between
the numpy arrays that :mod:`asyncinfer.wire.datatypes` decodes and torch tensors.

The worker and the engine import this module; the client does not (it needs numpy alone), so
``from asyncinfer import Client`` loads no torch. BF16, held in numpy as float32 values, becomes
a bfloat16 tensor through its bit patterns, so every bit (NaN payloads too) survives.
"""

from __future__ import annotations

from typing import Any

import numpy.typing as npt
import torch

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.bfloat16 import to_bits
from asyncinfer.wire.datatypes import DATATYPES, DatatypeSpec

__all__ = ["TORCH_DTYPES", "array_from_tensor", "cast_tensor", "datatype_of", "tensor_from_array"]

#: The torch dtype that holds each numeric v2 datatype (BYTES has none).
TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "UINT16": torch.uint16,
    "UINT32": torch.uint32,
    "UINT64": torch.uint64,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}

_BY_TORCH: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def datatype_of(value: torch.Tensor) -> str:
    """Return the v2 datatype name of a torch tensor's dtype.

    Raises:
        InvalidRequest: The dtype has no v2 counterpart (complex, float8, quantized ...).
    """
    try:
        return _BY_TORCH[value.dtype]
    except KeyError:
        raise InvalidRequest(
            f"torch dtype {value.dtype} has no v2 datatype; accepted: {', '.join(DATATYPES)}"
        ) from None


def cast_tensor(where: str, value: torch.Tensor, spec: DatatypeSpec | None) -> tuple[str, torch.Tensor]:
    """A tensor's v2 datatype and the tensor cast to ``spec`` (None: its own datatype).

    Raises:
        InvalidRequest: The dtype has no v2 datatype, or ``spec`` is BYTES.
    """
    datatype = datatype_of(value)
    if spec is None or spec.name == datatype:
        return datatype, value
    if spec.name not in TORCH_DTYPES:
        raise InvalidRequest(f"{where}: cannot make BYTES from a torch tensor of {datatype}")
    return spec.name, value.to(TORCH_DTYPES[spec.name])


def tensor_from_array(datatype: str, arr: npt.NDArray[Any]) -> torch.Tensor:
    """The tensor of a numeric datatype's decoded numpy array (no copy, but for BF16)."""
    if datatype == "BF16":
        return torch.from_numpy(to_bits(arr)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def array_from_tensor(datatype: str, value: torch.Tensor) -> npt.NDArray[Any]:
    """A tensor cast to a numeric datatype and moved to the CPU, as the numpy array that
    :func:`~asyncinfer.wire.datatypes.encode_data` takes (BF16: float32 values, exactly)."""
    # detach() only when needed: like most torch calls it lets go of the GIL, and a serving
    # thread that lets go of it per request waits each time for another thread's turn
    t = value.detach() if value.requires_grad else value
    dtype = TORCH_DTYPES[datatype]
    if t.dtype != dtype or t.device.type != "cpu":  # .to() itself costs µs even when a no-op
        t = t.to("cpu", dtype)
    return (t.float() if datatype == "BF16" else t).numpy()
