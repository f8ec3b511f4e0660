"""A worker's side of tensors by reference (wire/tensor_refs.py): inputs a request passes by URL
read from the fleet's tensor store before the request is decoded, and outputs over
``ASYNCINFER_TENSOR_REF_BYTES`` (or every output, when the request's ``data_ref_outputs`` asks)
written there when the request's sender reads the store (``data_ref_accepted``), the result
holding their URLs.

A worker reads only what lies in its own store (asyncinfer/store/tensor_store.py): a reference to
anything else, a missing object or one of the wrong size is the request's InvalidRequest; a store
that fails is its StoreUnavailable, naming the store and the object.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from asyncinfer.errors import InvalidRequest
from asyncinfer.store.tensor_store import TensorStore
from asyncinfer.wire.datatypes import SPECS
from asyncinfer.wire.protocol import Request, Tensor, encode_tensor
from asyncinfer.wire.tensor_refs import (
    OUTPUTS_BY_REF,
    REFS_ACCEPTED,
    binary_form,
    element_bytes,
    ref_of,
    ref_payload,
)

__all__ = ["encoded_outputs", "inputs_read"]


def inputs_read(request_id: str, kwargs: Any, store: TensorStore | None) -> Any:
    """``kwargs`` with each input passed by reference read into its ``data`` (raw bytes), or
    ``kwargs`` as they are when none is."""
    items = kwargs.get("inputs") if isinstance(kwargs, Mapping) else None
    if not isinstance(items, (list, tuple)):
        return kwargs
    refs = [(i, url) for i, item in enumerate(items) if isinstance(item, Mapping)
            and (url := ref_of(item, f"request {request_id}: input '{item.get('name')}'"))]
    if not refs:
        return kwargs
    inputs = list(items)
    for i, url in refs:
        item = inputs[i]
        where = f"request {request_id}: input '{item.get('name')}'"
        if store is None:
            raise InvalidRequest(f"{where} is passed by reference ({url}); this worker has no "
                                 f"tensor store (ASYNCINFER_TENSOR_STORE_URL)")
        inputs[i] = {k: v for k, v in item.items() if k != "parameters"}
        inputs[i]["data"] = store.read(url, where, _expected_bytes(item, where))
    return {**kwargs, "inputs": inputs}


def _expected_bytes(item: Mapping[str, Any], where: str) -> int | None:
    spec = SPECS.get(str(item.get("datatype")))
    shape = item.get("shape")
    if spec is None or spec.kind == "bytes" or not isinstance(shape, (list, tuple)) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        return None  # decoding says what is wrong with it
    return math.prod(shape) * spec.itemsize


def encoded_outputs(request: Request, outputs: list[Tensor], store: TensorStore | None,
                    threshold_bytes: int) -> list[dict[str, Any]]:
    """``outputs`` as the response's v2 dicts: those over ``threshold_bytes`` when the request's
    sender reads the store (``data_ref_accepted``), or all when it asks (``data_ref_outputs``),
    written to ``store`` and sent as their references."""
    asked = request.parameters.get(OUTPUTS_BY_REF) is True
    accepted = asked or request.parameters.get(REFS_ACCEPTED) is True
    if store is None:
        if asked:
            raise InvalidRequest(f"request {request.id}: parameters['{OUTPUTS_BY_REF}'] asks for "
                                 f"outputs by reference; this worker has no tensor store "
                                 f"(ASYNCINFER_TENSOR_STORE_URL)")
        return [encode_tensor(t, t.binary) for t in outputs]
    if not accepted:
        return [encode_tensor(t, t.binary) for t in outputs]
    encoded = []
    for t in outputs:
        spec = SPECS.get(t.datatype)
        if spec is None or spec.kind == "bytes":
            payload = encode_tensor(t, t.binary)  # BYTES: a list either way; its size once made
            size = 0 if spec is None else element_bytes(payload["data"])
        else:
            payload, size = None, math.prod(t.shape) * spec.itemsize
        if spec is None or (not asked and size <= threshold_bytes):
            encoded.append(payload if payload is not None else encode_tensor(t, t.binary))
            continue
        data = (payload or encode_tensor(t, True))["data"]
        url = store.write(request.id, f"out-{t.name}", binary_form(spec, data))
        encoded.append(ref_payload(t.name, t.datatype, list(t.shape), url))
    return encoded
