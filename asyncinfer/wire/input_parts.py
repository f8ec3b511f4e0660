"""A v2 request's inputs as the parts that decide its answer, for the digests that compare requests
(the response cache's key, wire/cache_key.py; a request ID's fingerprint, wire/request_identity.py).

Each input is described by its name, datatype, shape and how its data travels (``"bytes"``: raw
little-endian bytes; ``"json"``: a list), and its data is taken as sent: the raw bytes, or the
list as compact JSON (orjson: floats in their shortest exact form, so a value reads back as the
float it was). The same numbers sent once as a list and once as bytes are two requests: their
answers are encoded differently. An input passed by reference (wire/tensor_refs.py) is its
content's digest where its sender gave one (``data_digest``), else its URL.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["input_parts", "BINARY"]

BINARY = (bytes, bytearray, memoryview)


def input_parts(inputs: Any) -> tuple[list[list[Any]], list[bytes]]:
    """``inputs`` (the v2 input dicts) as their descriptions and their data, in request order.

    Raises:
        TypeError, KeyError, ValueError, orjson.JSONEncodeError: ``inputs`` is not a list of v2
            inputs whose parts can be encoded so.
    """
    if not isinstance(inputs, (list, tuple)):
        raise TypeError("inputs")
    described, datas = [], []
    for item in inputs:
        if "data" not in item and isinstance(item.get("parameters"), dict) \
                and "data_ref" in item["parameters"]:  # by reference (wire/tensor_refs.py)
            ref = item["parameters"]
            kind, raw = "ref", str(ref.get("data_digest") or ref["data_ref"]).encode()
            described.append([item["name"], item["datatype"], [int(n) for n in item["shape"]], kind])
            datas.append(raw)
            continue
        data = item["data"]
        if isinstance(data, BINARY):
            kind, raw = "bytes", bytes(data)
        else:
            kind, raw = "json", orjson.dumps(data)
        described.append([item["name"], item["datatype"], [int(n) for n in item["shape"]], kind])
        datas.append(raw)
    return described, datas
