"""A tensor passed by reference: its ``data`` in an object store, the message holding its URL.

An input or output ``{"name", "datatype", "shape", "parameters": {"data_ref": URL}}`` has no
``data``: the object at ``URL`` holds it in the v2 binary form (numeric values as raw
little-endian bytes, row-major; BYTES as each element's 4-byte little-endian length, then its
bytes). A request's parameter ``data_ref_outputs: true`` asks for every output by reference;
``data_ref_accepted: true`` (a client with a tensor store) for those over the worker's threshold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.datatypes import DatatypeSpec, bytes_blob

__all__ = ["DATA_REF", "OUTPUTS_BY_REF", "REFS_ACCEPTED", "binary_form", "element_bytes", "ref_of",
           "ref_payload"]

#: The input or output parameter that holds a tensor's URL.
DATA_REF = "data_ref"
#: The request parameter that asks for every output by reference.
OUTPUTS_BY_REF = "data_ref_outputs"
#: The request parameter that says its sender reads the store: an output over the worker's
#: threshold may come by reference (a client with a tensor store sets it; without it, and without
#: ``data_ref_outputs``, every output comes in the result, whatever its size).
REFS_ACCEPTED = "data_ref_accepted"



def ref_of(item: Mapping[str, Any], where: str) -> str | None:
    """The URL ``item`` (a v2 input or output dict) is passed by, None when it carries its data.
    InvalidRequest when it has both, or a reference that is not a URL."""
    parameters = item.get("parameters")
    if not isinstance(parameters, Mapping) or DATA_REF not in parameters:
        return None
    url = parameters[DATA_REF]
    if not isinstance(url, str) or not url or len(url) > 2048:
        raise InvalidRequest(f"{where}: parameters['{DATA_REF}'] must be the URL of the tensor's "
                             f"data (up to 2,048 characters), got {url!r:.80}")
    if "data" in item:
        raise InvalidRequest(f"{where}: has both 'data' and parameters['{DATA_REF}']; give one")
    return url


def ref_payload(name: str, datatype: str, shape: list[int], url: str) -> dict[str, Any]:
    """The v2 dict of a tensor whose data is at ``url``."""
    return {"name": name, "datatype": datatype, "shape": list(shape),
            "parameters": {DATA_REF: url}}


def binary_form(spec: DatatypeSpec, data: Any) -> bytes | memoryview:
    """A tensor's ``data`` (as :func:`~asyncinfer.wire.datatypes.encode_data` makes it with
    ``binary``: raw bytes, or BYTES' list of elements) in the v2 binary form of a stored object."""
    if spec.kind != "bytes":
        return data if isinstance(data, (bytes, memoryview)) else np.asarray(data).tobytes()
    return bytes_blob(list(data))


def element_bytes(elements: list[Any]) -> int:
    """The bytes of BYTES elements (str as UTF-8, at least its length: a bound, not counted)."""
    return sum(len(x) for x in elements if isinstance(x, (str, bytes, bytearray, memoryview)))
