"""A client's side of tensors by reference (wire/tensor_refs.py): inputs over
``ASYNCINFER_TENSOR_REF_BYTES`` written to the tensor store before their request is sent, and
outputs a worker stored there read back when the caller reads them.

A store that cannot take an input refuses the request at once (StoreUnavailable naming the store,
the input and the reason): nothing is sent, and nothing is left half-written.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from asyncinfer.errors import InvalidRequest
from asyncinfer.store.tensor_store import TensorStore
from asyncinfer.wire.datatypes import SPECS, cast_array
from asyncinfer.wire.payloads import array_from_value, encode_payload
from asyncinfer.wire.tensor_refs import binary_form, element_bytes, ref_of, ref_payload

__all__ = ["by_reference", "resolved"]


def by_reference(inputs: Any, request_id: str, store: TensorStore, threshold_bytes: int,
                 binary: bool) -> Any:
    """``inputs`` (what ``submit`` takes) with each value over ``threshold_bytes`` written to
    ``store`` and sent as its reference (v2 input dicts then); ``inputs`` as they are when none
    is over it, or when they are v2 input dicts already (a caller's own references kept)."""
    if isinstance(inputs, list) and inputs and all(isinstance(i, Mapping) for i in inputs):
        return inputs
    named = list(inputs.items()) if isinstance(inputs, Mapping) else [("input", inputs)]
    arrays = [(str(name), *array_from_value(str(name), value)) for name, value in named]
    if not any(_size(datatype, value) > threshold_bytes for _, datatype, _, value in arrays):
        return inputs
    payloads = []
    for name, datatype, shape, value in arrays:
        if _size(datatype, value) <= threshold_bytes:
            payloads.append(encode_payload(name, datatype, shape, value, binary))
            continue
        spec = SPECS[datatype]
        where = f"request {request_id}: input '{name}'"
        data = encode_payload(name, datatype, shape, value if spec.kind == "bytes"
                              else cast_array(where, spec, value), True)["data"]
        blob = binary_form(spec, data)
        url = store.write(request_id, f"in-{name}", blob)
        payload = ref_payload(name, datatype, list(shape), url)
        payload["parameters"]["data_digest"] = hashlib.blake2b(blob, digest_size=16).hexdigest()
        payloads.append(payload)
    return payloads


def _size(datatype: str, value: Any) -> int:
    """The bytes of a value's data (BYTES: its elements' lengths)."""
    if SPECS[datatype].kind == "bytes":
        return element_bytes(np.asarray(value, dtype=object).reshape(-1).tolist())
    return int(getattr(value, "nbytes", 0))


def resolved(output: dict[str, Any], store: TensorStore | None, owner: str) -> dict[str, Any]:
    """``output`` with its data, read from the store once when it came by reference (kept in the
    dict: a second read is free)."""
    where = f"{owner}: output '{output.get('name')}'"
    url = ref_of(output, where) if "data" not in output else None
    if url is None:
        return output
    if store is None:
        raise InvalidRequest(f"{where} is in the tensor store at {url}; this client has none "
                             f"(set ASYNCINFER_TENSOR_STORE_URL as the workers have it)")
    spec = SPECS.get(str(output.get("datatype")))
    expected = None
    if spec is not None and spec.kind != "bytes":
        expected = math.prod(int(n) for n in output["shape"]) * spec.itemsize
    output["data"] = store.read(url, where, expected)  # its reference stays in its parameters
    return output
