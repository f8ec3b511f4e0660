"""The client's body limit (ASYNCINFER_MAX_PAYLOAD_BYTES) before encoding: a request whose inputs
already show its body must be over the limit is refused at once, and the estimate never refuses
one that would fit (the exact check after encoding stays)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from asyncinfer.client import outgoing as outgoing_module
from asyncinfer.client.outgoing import Outgoing, least_body_bytes
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.payloads import array_from_value

LIMIT_BYTES = 64 * 1024 * 1024  # the default ASYNCINFER_MAX_PAYLOAD_BYTES


def body_bytes(outgoing: Outgoing) -> int:
    """The length of ``outgoing``'s body as it lies in its envelope (what the limit is on)."""
    return len(json.loads(outgoing.message("reply", None))["body"])


def estimate(inputs: Any, binary: bool, serializer: str) -> int:
    named = inputs.items() if isinstance(inputs, dict) else [("input", inputs)]
    arrays = [array_from_value(name, value) for name, value in named]
    return least_body_bytes([(datatype, value) for datatype, _, value in arrays], binary, serializer)


#: Values that encode as short as each datatype can: zeros, False, empty and one-letter strings.
SHORTEST = {
    "FP32": np.zeros((3, 5), np.float32), "FP64": np.zeros(7, np.float64),
    "FP16": np.zeros(9, np.float16), "INT8": np.zeros(11, np.int8),
    "INT64": np.zeros(13, np.int64), "UINT8": np.zeros(4, np.uint8),
    "UINT64": np.zeros(6, np.uint64), "BOOL": np.zeros(8, bool),
    "BYTES-str": np.array(["", "a", ""], dtype=object), "BYTES-bytes": [b"", b"x", b"yz"],
    "scalar": 0, "float list": [0.0, 1.0], "mixed": {"a": np.zeros(5, np.int32), "b": [True]},
}
ENCODINGS = [("json", False), ("msgpack", False), ("msgpack", True)]


#: Every value in every encoding that can carry it (a JSON body holds no raw bytes).
CASES = [(kind, serializer, binary) for kind in SHORTEST for serializer, binary in ENCODINGS
         if not (serializer == "json" and kind == "BYTES-bytes")]


@pytest.mark.parametrize(("kind", "serializer", "binary"), CASES)
def test_the_estimate_is_never_over_the_encoded_body(kind: str, serializer: str, binary: bool) -> None:
    inputs = SHORTEST[kind]
    exact = body_bytes(Outgoing.infer("m", inputs, "r-1", False, serializer, binary=binary))
    assert 0 < estimate(inputs, binary, serializer) <= exact


@pytest.mark.parametrize(("serializer", "binary"), ENCODINGS)
def test_the_estimate_of_random_values_is_under_the_body_by_its_envelope_only(
        serializer: str, binary: bool) -> None:
    inputs = np.random.default_rng(7).standard_normal((64, 16)).astype(np.float32)
    exact = body_bytes(Outgoing.infer("m", inputs, "r-1", False, serializer, binary=binary))
    least = estimate(inputs, binary, serializer)
    assert least <= exact
    if binary:  # raw data: all but the envelope (names, shape, datatype, parameters) is counted
        assert exact - least < 300


def test_a_request_too_big_is_refused_before_its_inputs_are_encoded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: 200 MB of float32 (never touched: zeros are lazily allocated) and an encoder that
    # must not be reached
    big = np.zeros(50_000_000, np.float32)

    def encode_payload(*args: Any) -> None:
        raise AssertionError("encoded before refusing")

    monkeypatch.setattr(outgoing_module, "encode_payload", encode_payload)
    # the least data: 4 bytes an element raw or as JSON text ("0.0,"), 9 as msgpack floats; × 4/3
    leasts = (266_666_668, 600_000_000, 266_666_668)
    for (serializer, binary), least in zip(ENCODINGS, leasts, strict=True):
        # When / Then: the same error as after encoding, naming the request and the least size
        with pytest.raises(InvalidRequest) as refused:
            Outgoing.infer("m", big, "big-1", False, serializer, binary=binary,
                           max_body_bytes=LIMIT_BYTES)
        assert str(refused.value) == (
            f"request big-1: message body of at least {least} bytes is over the limit of "
            f"67108864 bytes (ASYNCINFER_MAX_PAYLOAD_BYTES)")


def test_a_request_the_estimate_lets_through_is_still_held_to_its_exact_size() -> None:
    # Given: values longer as text than the least a float can be ("0.0,"), and a limit between
    # the estimate and the body
    inputs = np.full(1000, 1.2345678, np.float32)
    least = estimate(inputs, False, "json")
    exact = body_bytes(Outgoing.infer("m", inputs, "r-1", False, "json", binary=False))
    limit = least + 100
    assert least < limit < exact
    # When / Then: the estimate passes it, the exact check refuses it with the body's size
    outgoing = Outgoing.infer("m", inputs, "r-2", False, "json", binary=False,
                              max_body_bytes=limit)
    with pytest.raises(InvalidRequest) as refused:
        outgoing.message("reply", limit)
    assert str(refused.value) == (
        f"request r-2: message body of {exact} bytes is over the limit of {limit} bytes "
        f"(ASYNCINFER_MAX_PAYLOAD_BYTES)")


def test_a_request_at_its_limit_is_sent() -> None:
    inputs = np.zeros((4, 4), np.float32)
    exact = body_bytes(Outgoing.infer("m", inputs, "r-1", False, "msgpack", binary=True))
    outgoing = Outgoing.infer("m", inputs, "r-1", False, "msgpack", binary=True,
                              max_body_bytes=exact)
    assert body_bytes(outgoing) == exact
    assert len(json.loads(outgoing.message("reply", exact))["body"]) == exact


def test_v2_input_dicts_are_held_to_the_limit_by_their_raw_data() -> None:
    listed = [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]
    outgoing = Outgoing.infer("m", listed, "r-1", False, "json", binary=False, max_body_bytes=10)
    assert outgoing.kwargs["inputs"] == listed  # as they are; the exact check is message()'s
    raw = [{"name": "x", "shape": [300], "datatype": "UINT8", "data": bytes(300)}]
    with pytest.raises(InvalidRequest) as refused:
        Outgoing.infer("m", raw, "r-2", False, "msgpack", binary=True, max_body_bytes=399)
    assert str(refused.value) == ("request r-2: message body of at least 400 bytes is over the "
                                  "limit of 399 bytes (ASYNCINFER_MAX_PAYLOAD_BYTES)")
    exact = body_bytes(Outgoing.infer("m", raw, "r-3", False, "msgpack", binary=True))
    assert 400 <= exact
