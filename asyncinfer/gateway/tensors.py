"""The gateway's form of a v2 call, shared by its HTTP and gRPC fronts.

Tensor data travels through the gateway as raw little-endian bytes (BYTES: each element a 4-byte
little-endian length, then its bytes: the v2 binary form, which is also the wire contract's), so a
binary HTTP body or gRPC ``raw_input_contents`` goes to the worker without a copy into lists.
JSON data (flat or nested lists) is turned into raw bytes here, with the wire contract's own
checks, so a bad element is refused with the message a worker would give.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncinfer.wire.datatypes import bytes_blob, decode_data, encode_data, spec_for
from asyncinfer.wire.tensor_refs import ref_of, ref_payload

__all__ = ["InputTensor", "OutputTensor", "RequestedOutput", "InferCall", "InferResult",
           "raw_from_list", "list_from_raw", "check_raw", "output_tensor",
           "input_payload"]


@dataclass
class InputTensor:
    """One input as a front received it; ``raw`` is its data in the v2 binary form."""

    name: str
    datatype: str
    shape: list[int]
    raw: bytes
    #: Where its data lies in a registered shared-memory region (region, offset, byte size),
    #: read into ``raw`` before it is sent (gateway/shared_memory.py); None: in the request.
    shm: tuple[str, int, int] | None = None
    #: The URL of its data in the fleet's tensor store (parameter ``data_ref``,
    #: wire/tensor_refs.py), passed on as it is; None: in the request.
    ref: str | None = None


@dataclass
class RequestedOutput:
    """An output the caller asked for, whether it wants it as binary data (HTTP), and how many
    classes it wants instead of the tensor (Triton's classification extension; 0: the tensor)."""

    name: str
    binary: bool | None = None
    classification: int = 0
    #: Where to write its data (region, offset, byte size) instead of the response; None: the
    #: response.
    shm: tuple[str, int, int] | None = None


@dataclass
class InferCall:
    """One v2 infer call.

    Args:
        model, version: from the path (``version`` "" for none).
        id: the v2 request ``id``: a label, echoed back in the response (never the request ID:
            gateway/idempotency.py).
        parameters: the v2 request parameters (``timeout`` in µs, ``priority``, ...).
        outputs: the outputs asked for; None for all.
        timeout_s: the caller's own deadline (a gRPC deadline), if any.
        protocol: the front it came through (``http`` or ``grpc``), for the metrics.
        trace: the caller's W3C trace context (``traceparent``, ``tracestate``: an HTTP header,
            gRPC metadata), None for none; the request carries it on (wire/trace_context.py).
    """

    model: str
    version: str
    id: str
    inputs: list[InputTensor]
    parameters: dict[str, Any] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    timeout_s: float | None = None
    protocol: str = "grpc"
    trace: dict[str, str] | None = None
    #: The idempotency key of the HTTP header or gRPC metadata ("" for none); the
    #: ``idempotency_key`` parameter is read beside it (gateway/idempotency.py).
    idempotency_key: str = ""


@dataclass
class OutputTensor:
    """One output of a response; ``raw`` is its data in the v2 binary form."""

    name: str
    datatype: str
    shape: list[int]
    raw: bytes
    #: Written to this shared-memory region (region, offset, byte size) instead of the response
    #: (``raw`` then empty).
    shm: tuple[str, int, int] | None = None
    #: The URL of its data in the tensor store (the worker wrote it there; ``raw`` empty).
    ref: str | None = None


@dataclass
class InferResult:
    """A v2 response; ``parameters`` holds the worker's (worker, device, batch_size, ...)."""

    model_name: str
    model_version: str
    id: str
    outputs: list[OutputTensor]
    parameters: dict[str, Any] = field(default_factory=dict)


def raw_from_list(where: str, datatype: str, shape: list[int], data: Any) -> bytes:
    """The v2 binary form of JSON data (a flat or nested list, or one element).

    Raises:
        InvalidRequest: Unknown datatype, bad shape, wrong element count or an element that does
            not fit the datatype; the message starts with ``where``.
    """
    spec = spec_for(datatype, where)
    if not isinstance(data, list):
        data = [data]
    value, _ = decode_data(where, spec, tuple(shape), data)
    if spec.dtype is None:
        return bytes_blob(value.reshape(-1).tolist())
    return bytes(encode_data(where, spec, value, math.prod(shape), True))


def list_from_raw(where: str, datatype: str, shape: list[int], raw: bytes) -> list[Any]:
    """The flat JSON list of raw data (BYTES elements as str where they are UTF-8, else as the
    bytes' Latin-1 text; BF16 as floats)."""
    spec = spec_for(datatype, where)
    value, _ = decode_data(where, spec, tuple(shape), raw)
    flat = value.reshape(-1)
    if spec.dtype is None:
        return [_text(x) for x in flat.tolist()]
    if spec.name == "BOOL":
        return [bool(x) for x in flat.tolist()]
    return np.asarray(flat).tolist()


def check_raw(where: str, datatype: str, shape: list[int], raw: bytes) -> None:
    """Raise InvalidRequest unless ``raw`` holds exactly ``prod(shape)`` elements of ``datatype``."""
    spec = spec_for(datatype, where)
    decode_data(where, spec, tuple(shape), raw)


def _text(x: Any) -> str:
    if isinstance(x, bytes):
        try:
            return x.decode("utf-8")
        except UnicodeDecodeError:
            return x.decode("latin-1")
    return str(x)


def output_tensor(request_id: str, output: Mapping[str, Any]) -> OutputTensor:
    """An output of a response (raw or JSON data, or a reference) as an :class:`OutputTensor`."""
    url = ref_of(output, f"request {request_id}: output '{output['name']}'")
    if url is not None:
        return OutputTensor(str(output["name"]), str(output["datatype"]), list(output["shape"]),
                            b"", ref=url)
    data = output["data"]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        data = raw_from_list(f"request {request_id}: output '{output['name']}'", output["datatype"],
                             list(output["shape"]), data)
    return OutputTensor(str(output["name"]), str(output["datatype"]), list(output["shape"]),
                        bytes(data))


def input_payload(t: InputTensor) -> dict[str, Any]:
    """The v2 input a request carries for ``t``: its raw data, or its reference."""
    if t.ref is not None:
        return ref_payload(t.name, t.datatype, t.shape, t.ref)
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "data": t.raw}
