"""Result metas as JSON through orjson where it means the same as Celery's own (wire/result_json.py)."""

from __future__ import annotations

import datetime
import math
from typing import Any

import numpy as np
import pytest
from celery import Celery
from kombu.exceptions import DecodeError

from asyncinfer.wire.envelope import result_meta
from asyncinfer.wire.result_json import decode_meta, decode_result, encode_meta


@pytest.fixture(scope="module")
def backend() -> Any:
    app = Celery(broker="redis://127.0.0.1:1/0", backend="redis://127.0.0.1:1/0")
    app.conf.result_serializer = "json"
    return app.backend  # made without connecting


def embedding_meta(values: list[float]) -> dict[str, Any]:
    return result_meta("req-1", "SUCCESS", {"model_name": "minilm", "id": "req-1", "outputs": [
        {"name": "embedding", "datatype": "FP32", "shape": [1, len(values)], "data": values}]})


def test_the_number_lists_are_written_by_orjson_in_celery_s_own_layout(backend: Any,
                                                                      monkeypatch) -> None:
    values = (np.arange(1, 385, dtype=np.float32) / 7).tolist()
    meta = embedding_meta(values)
    expected = backend.encode(meta)
    kombu_saw: list[Any] = []
    encode = backend.encode
    monkeypatch.setattr(backend, "encode", lambda m: kombu_saw.append(m) or encode(m))
    written = encode_meta(backend, meta)
    # kombu wrote the meta with the list lifted out (orjson wrote that), and the text is the same
    assert len(kombu_saw) == 1 and isinstance(kombu_saw[0]["result"]["outputs"][0]["data"], str)
    assert written == expected and written.startswith('{"status": "SUCCESS", "result": {')
    assert decode_meta(backend, written.encode()) == meta == backend.decode(written)
    assert decode_result(backend, written.encode())["result"]["outputs"][0]["data"] == values


def test_tiny_floats_read_back_the_same_though_written_in_another_notation(backend: Any) -> None:
    values = [1e-05, 1.5e-07, -2.5e-09, 0.5, 5e-324, 1e+300, -0.0, 3.0]
    meta = embedding_meta(values)
    written = encode_meta(backend, meta)
    assert "0.00001" in written  # orjson's notation of 1e-05
    back = decode_meta(backend, written.encode())["result"]["outputs"][0]["data"]
    assert back == values and backend.decode(written) == meta


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_infinity_are_written_by_kombu_and_read_back_as_they_were(backend: Any,
                                                                          bad: float) -> None:
    meta = embedding_meta([1.0, bad, 2.0])
    written = encode_meta(backend, meta)
    assert written == backend.encode(meta)  # kombu's own bytes, not orjson's null
    back = decode_meta(backend, written if isinstance(written, bytes) else written.encode())
    data = back["result"]["outputs"][0]["data"]
    assert data[0] == 1.0 and data[2] == 2.0
    assert (math.isnan(data[1]) if math.isnan(bad) else data[1] == bad)


@pytest.mark.parametrize("value", [b"\x00\xffraw", 2 ** 64, -(2 ** 63) - 1, (1, "x"), [2 ** 70] * 10,
                                   {1: "non-string key"}, "lone \ud800 surrogate"])
def test_what_orjson_would_write_differently_goes_through_kombu(backend: Any, value: Any) -> None:
    meta = result_meta("req-2", "SUCCESS", {"value": value})
    written = encode_meta(backend, meta)
    if isinstance(value, tuple):  # a tuple is JSON's list either way
        assert backend.decode(written) == backend.decode(backend.encode(meta))
        return
    assert written == backend.encode(meta)


def test_a_payload_orjson_would_read_differently_is_read_by_kombu(backend: Any) -> None:
    big = b'{"status": "SUCCESS", "result": 123456789012345678901234567890, "task_id": "r"}'
    assert decode_meta(backend, big)["result"] == 123456789012345678901234567890  # not a float
    in_list = b'{"status": "SUCCESS", "result": [1.5, 123456789012345678901234567890], "task_id": "r"}'
    assert decode_meta(backend, in_list)["result"] == [1.5, 123456789012345678901234567890]
    compact = b'{"status":"SUCCESS","result":{"__type__":"bytes","__value__":"abc"},"task_id":"r"}'
    assert decode_meta(backend, compact)["result"] == b"abc"  # kombu's wrapper, unwrapped
    wrapped = backend.encode(result_meta("r", "SUCCESS", {"raw": b"abc"})).encode()
    assert decode_meta(backend, wrapped)["result"] == {"raw": b"abc"}
    deep = (b'{"status": "SUCCESS", "result": {"raw": {"__type__": "bytes", "__value__": "a"}, '
            b'"deep": [{"x": [1, {"y": -123456789012345678901234567890}]}]}, "task_id": "r"}')
    assert decode_meta(backend, deep)["result"] == {
        "raw": b"a", "deep": [{"x": [1, {"y": -123456789012345678901234567890}]}]}
    nan = b'{"status": "SUCCESS", "result": [NaN], "task_id": "r"}'
    assert math.isnan(decode_meta(backend, nan)["result"][0])


def test_a_stored_exception_comes_back_as_one(backend: Any) -> None:
    meta = result_meta("req-3", "FAILURE", {"exc_type": "ValueError", "exc_message": ["bad input"],
                                            "exc_module": "builtins"})
    exc = decode_result(backend, encode_meta(backend, meta))["result"]
    assert isinstance(exc, ValueError) and str(exc) == "bad input"


def test_a_compressing_backend_is_left_to_celery(backend: Any, monkeypatch) -> None:
    monkeypatch.setattr(backend, "compression", "gzip", raising=False)
    meta = embedding_meta([0.5, 0.25])
    written = encode_meta(backend, meta)
    assert written == backend.encode(meta) and backend.decode(written) == meta


@pytest.mark.parametrize("value", [b"abc", b"\x00\xffraw", {"inner": [b"x", {"deeper": b"\xfe"}]},
                                   [b"", "plain text", 1.5], {"__type__": "not a wrapper", "x": 1}])
def test_bytes_wrappers_read_by_orjson_come_back_as_kombu_reads_them(backend: Any,
                                                                        value: Any) -> None:
    written = backend.encode(result_meta("r", "SUCCESS", {"raw": value, "n": [0.5] * 10}))
    payload = written if isinstance(written, bytes) else written.encode()
    assert decode_meta(backend, payload) == backend.decode(payload)
    assert decode_meta(backend, payload)["result"]["raw"] == value


def test_other_kombu_wrappers_are_read_by_kombu(backend: Any) -> None:
    when = datetime.datetime(2026, 12, 3, 12, 0, tzinfo=datetime.timezone.utc)
    written = backend.encode(result_meta("r", "SUCCESS", {"raw": b"abc", "when": when}))
    payload = written if isinstance(written, bytes) else written.encode()
    assert decode_meta(backend, payload)["result"] == {"raw": b"abc", "when": when}
    odd = b'{"status": "SUCCESS", "result": {"__type__": "base64", "__value__": "YQ%%"}, "task_id": "r"}'
    for read in (backend.decode, lambda p: decode_meta(backend, p)):  # kombu's error either way
        with pytest.raises(DecodeError, match="padding"):
            read(odd)
