"""The v2 tensor codec: exact round trips of every datatype, client helpers, and validation."""

from __future__ import annotations

import math
import struct
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.datatypes import DATATYPES
from asyncinfer.wire.payloads import output_to_numpy, output_to_torch, to_input_payload
from asyncinfer.wire.protocol import Request, Tensor, decode_request, encode_tensor, tensor_from_value
from asyncinfer.wire.tensors import datatype_of

pytestmark = pytest.mark.timeout(60)

NAN, INF = float("nan"), float("inf")
TORCH = {
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
# Edge values of each datatype, six of them so that shapes [6], [2, 3] and [3, 2, 1] all fit.
EDGES: dict[str, list[Any]] = {
    "BOOL": [True, False, False, True, True, False],
    "UINT8": [0, 255, 1, 128, 254, 7],
    "UINT16": [0, 65535, 1, 32768, 65534, 7],
    "UINT32": [0, 2**32 - 1, 1, 2**31, 2**32 - 2, 7],
    "UINT64": [0, 2**64 - 1, 1, 2**63, 2**63 - 1, 2**64 - 2],
    "INT8": [-128, 127, 0, -1, 1, 100],
    "INT16": [-32768, 32767, 0, -1, 1, 1000],
    "INT32": [-(2**31), 2**31 - 1, 0, -1, 1, 123456],
    "INT64": [-(2**63), 2**63 - 1, 0, -1, 1, 2**53 + 1],
    "FP16": [NAN, INF, -INF, -0.0, 65504.0, 2.0**-24],
    "BF16": [NAN, -INF, -0.0, 3.3895313892515355e38, 2.0**-133, 0.333984375],
    "FP32": [NAN, INF, -0.0, 3.4028234663852886e38, 2.0**-149, float(np.float32(0.1))],
    "FP64": [NAN, -INF, -0.0, 1.7976931348623157e308, 5e-324, 0.1],
    "BYTES": ["héllo", "", "日本語 🚀", b"\xff\xfe\x00", b"plain", b"\x00"],
}
SHAPES = [[6], [2, 3], [3, 2, 1]]
NUMERIC = [d for d in DATATYPES if d != "BYTES"]


def tv(t: Tensor) -> torch.Tensor:
    assert isinstance(t.value, torch.Tensor)
    return t.value


def nv(t: Tensor) -> npt.NDArray[Any]:
    assert isinstance(t.value, np.ndarray)
    return t.value


def kw(*inputs: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "identity", "inputs": list(inputs), **extra}


def inp(data: Any, datatype: str = "FP32", shape: list[int] | None = None, name: str = "x") -> dict[str, Any]:
    return {
        "name": name,
        "shape": [len(data)] if shape is None else shape,
        "datatype": datatype,
        "data": data,
    }


def same(a: list[Any], b: list[Any]) -> bool:
    """Element-wise equality where NaN equals NaN, -0.0 differs from 0.0 and types must match."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            if math.isnan(x) != math.isnan(y):
                return False
            if not math.isnan(x) and (x != y or math.copysign(1, x) != math.copysign(1, y)):
                return False
        elif x != y:
            return False
    return True


def rejects(kwargs: Any, *words: str, rid: str = "rq-42") -> str:
    with pytest.raises(InvalidRequest) as info:
        decode_request(rid, kwargs)
    msg = str(info.value)
    assert msg.startswith(f"request {rid}: "), msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def blob(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in items)


# ---------------------------------------------------------------------------- round trips


def test_datatypes_lists_every_v2_name() -> None:
    assert DATATYPES == (
        "BOOL",
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "BF16",
        "FP32",
        "FP64",
        "BYTES",
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("datatype", DATATYPES)
def test_list_round_trip_is_exact(datatype: str, shape: list[int]) -> None:
    data = EDGES[datatype]
    req = decode_request("r1", kw(inp(data, datatype, shape)))
    t = req.inputs[0]
    assert (t.name, t.datatype, t.shape, t.binary) == ("x", datatype, tuple(shape), False)
    assert req.binary_output is (datatype == "BYTES" and False)
    if datatype == "BYTES":
        assert isinstance(t.value, np.ndarray) and t.value.dtype == object and t.value.shape == tuple(shape)
        assert t.value.reshape(-1).tolist() == data  # str stays str, bytes stays bytes
    else:
        assert isinstance(t.value, torch.Tensor)
        assert t.value.dtype == TORCH[datatype] and tuple(t.value.shape) == tuple(shape)
    out = encode_tensor(t, binary=False)
    assert out["name"] == "x" and out["shape"] == shape and out["datatype"] == datatype
    assert isinstance(out["data"], list)
    if datatype == "BYTES":
        # every element keeps its kind: str stays str, bytes stays bytes
        assert out["data"] == data and [type(x) for x in out["data"]] == [type(x) for x in data]
    else:
        assert same(out["data"], data), out["data"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("datatype", NUMERIC)
def test_list_to_binary_and_back_is_exact(datatype: str, shape: list[int]) -> None:
    data = EDGES[datatype]
    t = decode_request("r1", kw(inp(data, datatype, shape))).inputs[0]
    raw = encode_tensor(t, binary=True)["data"]
    assert isinstance(raw, bytes) and len(raw) == 6 * tv(t).element_size()
    req = decode_request("r2", kw(inp(raw, datatype, shape)))
    assert req.inputs[0].binary is True and req.binary_output is True
    assert torch.equal(tv(req.inputs[0]).view(torch.uint8), tv(t).view(torch.uint8))
    assert same(encode_tensor(req.inputs[0], binary=False)["data"], data)
    assert encode_tensor(req.inputs[0], binary=True)["data"] == raw


@pytest.mark.parametrize(
    ("datatype", "np_dtype", "bits"),
    [
        ("FP16", "<u2", [0x7E01, 0xFE00, 0x8000, 0x7C00, 0x0001, 0x3C00]),
        ("BF16", "<u2", [0x7FC1, 0xFFC0, 0x8000, 0x7F80, 0x0001, 0x3F80]),
        ("FP32", "<u4", [0x7FC00001, 0xFFC00000, 0x80000000, 0x7F800000, 0x00000001, 0x3F800000]),
        ("FP64", "<u8", [0x7FF8000000000001, 0xFFF8000000000000, 1 << 63, 0x7FF0000000000000, 1, 0]),
    ],
)
def test_binary_round_trip_keeps_every_bit_incl_nan_payloads(
    datatype: str, np_dtype: str, bits: list[int]
) -> None:
    raw = np.array(bits, dtype=np_dtype).tobytes()
    t = decode_request("r", kw(inp(raw, datatype, [2, 3]))).inputs[0]
    assert t.binary and tv(t).dtype == TORCH[datatype]
    assert encode_tensor(t, binary=True)["data"] == raw


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("datatype", DATATYPES)
def test_empty_batch_round_trips(datatype: str, binary: bool) -> None:
    data: Any = b"" if binary else []
    req = decode_request("r", kw(inp(data, datatype, [0, 3])))
    t = req.inputs[0]
    assert t.shape == (0, 3) and tuple(t.value.shape) == (0, 3)
    out = encode_tensor(t, binary)
    assert out["shape"] == [0, 3]
    assert out["data"] == ([] if datatype == "BYTES" or not binary else b"")


def test_bytes_blob_is_parsed_and_marks_binary() -> None:
    raw = blob("héllo".encode(), b"", b"\xff\x00")
    req = decode_request("r", kw(inp(raw, "BYTES", [3])))
    t = req.inputs[0]
    assert t.binary and req.binary_output
    assert nv(t).tolist() == ["héllo".encode(), b"", b"\xff\x00"]
    assert encode_tensor(t, binary=True)["data"] == ["héllo".encode(), b"", b"\xff\x00"]
    assert encode_tensor(t, binary=False)["data"] == ["héllo".encode(), b"", b"\xff\x00"]


def test_bytes_elements_keep_their_kind_in_both_encodings() -> None:
    t = decode_request("r", kw(inp(["é", b"\x80", "a"], "BYTES"))).inputs[0]
    assert t.binary is False  # only a raw blob is the binary form
    assert encode_tensor(t, binary=True)["data"] == ["é", b"\x80", "a"]
    assert encode_tensor(t, binary=False)["data"] == ["é", b"\x80", "a"]


def test_bytes_list_of_bytes_is_not_the_binary_form() -> None:
    req = decode_request("r", kw(inp([b"a", b"\xff"], "BYTES")))
    assert req.inputs[0].binary is False and req.binary_output is False
    assert encode_tensor(req.inputs[0], binary=False)["data"] == [b"a", b"\xff"]


def test_nested_lists_are_flattened() -> None:
    t = decode_request("r", kw(inp([[[1, 2]], [[3, 4]]], "INT32", [2, 1, 2]))).inputs[0]
    assert tv(t).tolist() == [[[1, 2]], [[3, 4]]]
    assert encode_tensor(t, False)["data"] == [1, 2, 3, 4]
    words = decode_request("r", kw(inp([["a", "b"], ["c", "d"]], "BYTES", [2, 2]))).inputs[0]
    assert nv(words).tolist() == [["a", "b"], ["c", "d"]]


def test_raw_data_accepts_bytearray_and_memoryview() -> None:
    raw = np.array([1.5, -2.0], dtype="<f4").tobytes()
    for data in (bytearray(raw), memoryview(raw)):
        t = decode_request("r", kw(inp(data, "FP32", [2]))).inputs[0]
        assert t.binary and tv(t).tolist() == [1.5, -2.0]


def test_bool_raw_bytes_and_int_list() -> None:
    t = decode_request("r", kw(inp(b"\x01\x00\x01", "BOOL", [3]))).inputs[0]
    assert tv(t).tolist() == [True, False, True]
    assert encode_tensor(t, True)["data"] == b"\x01\x00\x01"
    t = decode_request("r", kw(inp([1, 0, True], "BOOL"))).inputs[0]
    assert tv(t).dtype == torch.bool and encode_tensor(t, False)["data"] == [True, False, True]


def test_float_inputs_accept_ints() -> None:
    t = decode_request("r", kw(inp([1, -2, 3.5], "FP64"))).inputs[0]
    assert tv(t).dtype == torch.float64 and encode_tensor(t, False)["data"] == [1.0, -2.0, 3.5]


def test_request_fields_extra_keys_and_binary_output() -> None:
    kwargs = kw(
        inp([1.0, 2.0], name="a"),
        {**inp(b"\x01\x02", "UINT8", name="b"), "parameters": {"ignored": True}},
        id="client-side-id",
        parameters={"priority": 3},
    )
    req = decode_request("abc", kwargs)
    assert isinstance(req, Request)
    assert (req.id, req.model, req.parameters) == ("abc", "identity", {"priority": 3})
    assert [t.name for t in req.inputs] == ["a", "b"] and [t.binary for t in req.inputs] == [False, True]
    assert req.binary_output is True
    kwargs["parameters"] = {"binary_data_output": False}
    assert decode_request("abc", kwargs).binary_output is False
    only_lists = kw(inp([1.0]), parameters={"binary_data_output": True})
    assert decode_request("abc", only_lists).binary_output is True
    assert decode_request("abc", kw(inp([1.0]))).binary_output is False
    assert decode_request("abc", kw(inp([1.0]), parameters=None)).parameters == {}


def test_encode_tensor_casts_and_moves_to_cpu() -> None:
    t = Tensor("y", "FP16", (2,), torch.tensor([1.5, 2.25], dtype=torch.float32), False)
    assert encode_tensor(t, False) == {"name": "y", "shape": [2], "datatype": "FP16", "data": [1.5, 2.25]}
    t = Tensor("y", "INT16", (1, 2), np.array([[3, -4]], dtype=np.int64), False)
    assert encode_tensor(t, True)["data"] == np.array([3, -4], dtype="<i2").tobytes()
    with pytest.raises(InvalidRequest, match="value has 2 elements but the shape needs 3"):
        encode_tensor(Tensor("y", "FP32", (3,), torch.zeros(2), False), False)
    words = Tensor("w", "BYTES", (2,), np.array(["a", "é"]), False)
    assert encode_tensor(words, True)["data"] == ["a", "é"]
    assert encode_tensor(words, False)["data"] == ["a", "é"]
    with pytest.raises(InvalidRequest, match="BYTES elements must be str or bytes, got a int"):
        encode_tensor(Tensor("w", "BYTES", (1,), np.array([5], dtype=object), False), True)
    with pytest.raises(InvalidRequest, match="must be numeric"):
        encode_tensor(Tensor("w", "FP32", (1,), np.array(["a"]), False), True)


def test_list_decode_is_fast() -> None:
    rows = np.random.default_rng(0).standard_normal((64, 384)).astype(np.float32)
    kwargs = kw(inp(rows.reshape(-1).tolist(), "FP32", [64, 384]))
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        req = decode_request("r", kwargs)
        best = min(best, time.perf_counter() - start)
    assert torch.equal(tv(req.inputs[0]), torch.from_numpy(rows))
    assert best < 0.02, f"64x384 FP32 list took {best * 1e3:.1f} ms"


# ---------------------------------------------------------------------------- client helpers


@pytest.mark.parametrize("datatype", NUMERIC)
def test_tensor_from_torch_infers_datatype(datatype: str) -> None:
    value = torch.zeros(2, 3, dtype=TORCH[datatype])
    assert datatype_of(value) == datatype
    t = tensor_from_value("t", value)
    assert (t.datatype, t.shape, t.binary) == (datatype, (2, 3), False)
    assert torch.equal(tv(t), value)


def test_tensor_from_value_numpy_arrays() -> None:
    for np_dtype, datatype in [
        (np.bool_, "BOOL"),
        (np.uint8, "UINT8"),
        (np.uint16, "UINT16"),
        (np.uint32, "UINT32"),
        (np.uint64, "UINT64"),
        (np.int8, "INT8"),
        (np.int16, "INT16"),
        (np.int32, "INT32"),
        (np.int64, "INT64"),
        (np.float16, "FP16"),
        (np.float32, "FP32"),
        (np.float64, "FP64"),
    ]:
        arr: npt.NDArray[Any] = np.arange(6).reshape(2, 3).astype(np_dtype)
        t = tensor_from_value("a", arr)
        assert (t.datatype, t.shape) == (datatype, (2, 3))
        np.testing.assert_array_equal(tv(t).numpy(), arr)
    big = tensor_from_value("a", np.array([2**64 - 1], dtype=np.uint64))
    assert encode_tensor(big, False)["data"] == [2**64 - 1]
    swapped = tensor_from_value("a", np.array([1.5, -2.0], dtype=">f8"))
    assert encode_tensor(swapped, True)["data"] == np.array([1.5, -2.0], dtype="<f8").tobytes()


def test_tensor_from_value_numpy_strings() -> None:
    t = tensor_from_value("s", np.array([["a", "é"], ["日本", ""]]))
    assert (t.datatype, t.shape) == ("BYTES", (2, 2))
    assert nv(t).tolist() == [["a", "é"], ["日本", ""]]
    t = tensor_from_value("s", np.array([b"x\xff", b"y"]))
    assert t.datatype == "BYTES" and nv(t).tolist() == [b"x\xff", b"y"]
    t = tensor_from_value("s", np.array(["a", b"b"], dtype=object))
    assert t.datatype == "BYTES" and nv(t).tolist() == ["a", b"b"]


def test_tensor_from_value_lists_and_scalars() -> None:
    assert tensor_from_value("l", [[1, 2, 3], [4, 5, 6]]).datatype == "INT64"
    assert tensor_from_value("l", [[1, 2, 3], [4, 5, 6]]).shape == (2, 3)
    floats = tensor_from_value("l", [0.5, 1])
    assert floats.datatype == "FP32" and tv(floats).tolist() == [0.5, 1.0]
    assert tensor_from_value("l", [True, False]).datatype == "BOOL"
    assert tensor_from_value("l", [2**64 - 1, 0]).datatype == "UINT64"
    assert tv(tensor_from_value("l", [0.1], "FP64")).tolist() == [0.1]
    words = tensor_from_value("l", ["a", b"b"])
    assert (words.datatype, words.shape) == ("BYTES", (2,))
    assert nv(tensor_from_value("s", "hello")).tolist() == ["hello"]
    assert tensor_from_value("s", b"\x00").shape == (1,)
    assert tensor_from_value("n", 3.5).shape == (1,)
    assert tensor_from_value("n", torch.tensor(2)).shape == (1,)
    cast = tensor_from_value("c", torch.ones(2), "BF16")
    assert cast.datatype == "BF16" and tv(cast).dtype == torch.bfloat16


def test_tensor_from_value_rejects_bad_values() -> None:
    with pytest.raises(InvalidRequest, match="ragged"):
        tensor_from_value("r", [[1, 2], [3]])
    with pytest.raises(InvalidRequest, match="cannot make BYTES"):
        tensor_from_value("r", torch.ones(2), "BYTES")
    with pytest.raises(InvalidRequest, match="no v2 datatype"):
        tensor_from_value("r", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(InvalidRequest, match="cannot make a tensor from a dict"):
        tensor_from_value("r", {"a": 1})
    with pytest.raises(InvalidRequest, match="out of range for INT8"):
        tensor_from_value("r", [1, 300], "INT8")
    with pytest.raises(InvalidRequest, match="unknown datatype 'fp32'"):
        tensor_from_value("r", [1.0], "fp32")


def test_to_input_payload() -> None:
    arr = np.array([[1.5, -2.0, 3.0]], dtype=np.float32)
    assert to_input_payload("x", arr) == {
        "name": "x",
        "shape": [1, 3],
        "datatype": "FP32",
        "data": [1.5, -2.0, 3.0],
    }
    assert to_input_payload("x", arr, binary=True)["data"] == arr.tobytes()
    bf = to_input_payload("x", torch.tensor([1.5, -2.0], dtype=torch.bfloat16), binary=True)
    assert bf["datatype"] == "BF16" and bf["data"] == np.array([0x3FC0, 0xC000], dtype="<u2").tobytes()
    assert to_input_payload("s", ["é", b"\xff"]) == {
        "name": "s",
        "shape": [2],
        "datatype": "BYTES",
        "data": ["é", b"\xff"],
    }
    assert to_input_payload("s", "é", binary=True)["data"] == ["é"]
    assert to_input_payload("i", [1, 2], datatype="UINT8", binary=True)["data"] == b"\x01\x02"
    # what the client sends, the server decodes to the same values
    req = decode_request("r", kw(to_input_payload("x", arr, binary=True)))
    np.testing.assert_array_equal(tv(req.inputs[0]).numpy(), arr)


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("datatype", NUMERIC)
def test_output_to_numpy_and_torch(datatype: str, binary: bool) -> None:
    data = EDGES[datatype]
    t = decode_request("r", kw(inp(data, datatype, [3, 2]))).inputs[0]
    out = encode_tensor(t, binary)
    arr = output_to_numpy(out)
    assert arr.shape == (3, 2)
    expected = tv(t).float() if datatype == "BF16" else tv(t)
    assert arr.dtype == expected.numpy().dtype
    np.testing.assert_array_equal(arr, expected.numpy())
    tt = output_to_torch(out)
    assert tt.dtype == TORCH[datatype] and tuple(tt.shape) == (3, 2)
    assert torch.equal(tt.view(torch.uint8), tv(t).view(torch.uint8))


def test_output_bf16_upcast_is_exact() -> None:
    out = {
        "name": "o",
        "shape": [3],
        "datatype": "BF16",
        "data": np.array([0x3F81, 0xC2F7, 0x0001], "<u2").tobytes(),
    }
    arr = output_to_numpy(out)
    assert arr.dtype == np.float32
    assert arr.view(np.uint32).tolist() == [0x3F810000, 0xC2F70000, 0x00010000]
    assert output_to_torch(out).dtype == torch.bfloat16


def test_output_bytes() -> None:
    out = {"name": "o", "shape": [1, 2], "datatype": "BYTES", "data": ["é", b"\xff"]}
    arr = output_to_numpy(out)
    assert arr.dtype == object and arr.tolist() == [["é", b"\xff"]]
    arr = output_to_numpy({**out, "data": blob(b"a", b"bc")})
    assert arr.tolist() == [[b"a", b"bc"]]
    with pytest.raises(InvalidRequest, match="output 'o': BYTES has no torch form"):
        output_to_torch(out)
    with pytest.raises(InvalidRequest, match="output 'o': missing 'datatype'"):
        output_to_numpy({"name": "o", "shape": [1], "data": [1]})


# ---------------------------------------------------------------------------- validation


def test_example_message_is_exact() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_request("abc", kw(inp([1.0] * 7, "FP32", [2, 4])))
    assert str(info.value) == "request abc: input 'x': data has 7 elements but shape [2, 4] needs 8"


@pytest.mark.parametrize("kwargs", [["model", "identity"], "x", None, 3])
def test_kwargs_not_a_mapping(kwargs: Any) -> None:
    rejects(kwargs, "must be a mapping")


def test_missing_model() -> None:
    rejects({"inputs": [inp([1.0])]}, "'model'", "missing")


@pytest.mark.parametrize("model", [3, None, "", ["m"]])
def test_model_not_a_string(model: Any) -> None:
    rejects({"model": model, "inputs": [inp([1.0])]}, "'model' must be a non-empty string")


def test_missing_inputs() -> None:
    rejects({"model": "m"}, "missing 'inputs'")


@pytest.mark.parametrize("inputs", [[], "x", {"name": "x"}, None])
def test_inputs_not_a_non_empty_list(inputs: Any) -> None:
    rejects({"model": "m", "inputs": inputs}, "'inputs' must be a non-empty list")


def test_input_not_a_mapping() -> None:
    rejects({"model": "m", "inputs": [inp([1.0]), ["x", 1]]}, "input #1 must be a mapping", "list")


def test_missing_name() -> None:
    rejects(kw({"shape": [1], "datatype": "FP32", "data": [1.0]}), "input #0", "missing 'name'")


@pytest.mark.parametrize("key", ["shape", "datatype", "data"])
def test_missing_shape_datatype_data(key: str) -> None:
    item = inp([1.0], name="feats")
    del item[key]
    rejects(kw(item), "input 'feats'", f"missing '{key}'")


@pytest.mark.parametrize("name", ["", 7, None])
def test_name_not_a_non_empty_string(name: Any) -> None:
    rejects(kw(inp([1.0], name=name)), "input #0", "'name' must be a non-empty string")


def test_duplicate_input_names() -> None:
    rejects(
        kw(inp([1.0], name="a"), inp([2.0], name="b"), inp([3.0], name="a")), "input 'a'", "duplicate", "#0"
    )


@pytest.mark.parametrize("datatype", ["FP8", "fp32", "STRING", 3, None])
def test_unknown_datatype(datatype: Any) -> None:
    msg = rejects(kw(inp([1.0], datatype, name="x")), "input 'x'", "unknown datatype", "accepted")
    assert all(d in msg for d in DATATYPES)


@pytest.mark.parametrize("shape", [[], "2", 2, [-1], [2.0], [True], [1, None], None])
def test_bad_shape(shape: Any) -> None:
    item = {**inp([1.0]), "shape": shape}
    rejects(kw(item), "input 'x'", "shape must be a non-empty list of non-negative integers")


@pytest.mark.parametrize(
    ("data", "datatype", "shape", "n"),
    [
        ([1.0, 2.0, 3.0], "FP32", [2, 2], 3),
        ([[1, 2], [3]], "INT8", [2, 2], 3),
        (["a"], "BYTES", [2], 1),
        ([], "BOOL", [1], 0),
    ],
)
def test_element_count_mismatch(data: list[Any], datatype: str, shape: list[int], n: int) -> None:
    rejects(kw(inp(data, datatype, shape)), "input 'x'", f"data has {n} elements", f"shape {shape} needs")


@pytest.mark.parametrize(("datatype", "need"), [("FP32", 32), ("FP16", 16), ("UINT64", 64), ("BOOL", 8)])
def test_raw_byte_length_mismatch(datatype: str, need: int) -> None:
    rejects(kw(inp(b"\x00" * 7, datatype, [2, 4])), "input 'x'", "raw data has 7 bytes", f"need {need}")


@pytest.mark.parametrize(
    ("datatype", "data", "words"),
    [
        ("FP32", [1.0, "2.0"], ["element 1 is a str", "FP32 elements must be numbers"]),
        ("FP32", [True, 1.0], ["element 0 is a bool", "FP32 elements must be numbers"]),
        ("FP64", [None, 1.0], ["element 0 is a NoneType"]),
        ("INT32", [1, 2.0], ["element 1 is a float", "INT32 elements must be integers"]),
        ("UINT8", [1, False], ["element 1 is a bool", "UINT8 elements must be integers"]),
        ("INT64", ["7", 1], ["element 0 is a str", "INT64 elements must be integers"]),
        ("BOOL", [True, 2], ["element 1 is 2", "BOOL elements must be true/false"]),
        ("BOOL", [True, "true"], ["element 1 is a str", "BOOL elements must be true/false"]),
        ("BOOL", [0.0, True], ["element 0 is a float", "BOOL elements must be true/false"]),
    ],
)
def test_element_of_wrong_kind(datatype: str, data: list[Any], words: list[str]) -> None:
    rejects(kw(inp(data, datatype)), "input 'x'", *words)


@pytest.mark.parametrize(
    ("datatype", "data", "words"),
    [
        ("INT8", [1, 300], ["element 1 = 300", "out of range for INT8 [-128, 127]"]),
        ("UINT8", [-1], ["element 0 = -1", "out of range for UINT8 [0, 255]"]),
        ("UINT16", [65536], ["out of range for UINT16"]),
        ("INT32", [2**31], ["out of range for INT32"]),
        ("INT64", [0, 2**63], ["element 1", "out of range for INT64"]),
        ("UINT64", [2**64], ["element 0", "out of range for UINT64"]),
        ("UINT64", [2**64 - 1, -1], ["element 1 = -1", "out of range for UINT64"]),
        ("FP16", [1.0, 1e6], ["element 1", "out of range for FP16"]),
        ("FP32", [1e300], ["out of range for FP32"]),
        ("BF16", [1e39], ["out of range for BF16"]),
        ("FP64", [1.0, 10**400], ["data element 1 is out of range for FP64"]),
        ("FP32", [2**1024 - 1], ["data element 0 is out of range for FP32"]),
    ],
)
def test_value_out_of_range(datatype: str, data: list[Any], words: list[str]) -> None:
    rejects(kw(inp(data, datatype)), "input 'x'", *words)


def test_bool_raw_byte_not_0_or_1() -> None:
    rejects(kw(inp(b"\x01\x02", "BOOL", [2])), "input 'x'", "raw byte 1 is 2", "must be 0 or 1")


@pytest.mark.parametrize("data", [["a", 5], ["a", None], [1.0]])
def test_bytes_elements_not_str_or_bytes(data: list[Any]) -> None:
    rejects(kw(inp(data, "BYTES")), "input 'x'", "BYTES elements must be str or bytes")


@pytest.mark.parametrize(
    ("raw", "shape", "words"),
    [
        (b"\x01\x00", [1], ["malformed BYTES binary data", "truncated length prefix"]),
        (
            struct.pack("<I", 9) + b"abc",
            [1],
            ["malformed BYTES binary data", "declares 9 bytes", "only 3 remain"],
        ),
        (blob(b"a", b"b"), [3], ["BYTES binary data has 2 elements", "needs 3"]),
        (blob(b"a", b"b"), [1], ["BYTES binary data has 2 elements", "needs 1"]),
        (blob(b"a", b"b", b"c"), [1], ["BYTES binary data has more than 1 elements", "needs 1"]),
    ],
)
def test_malformed_bytes_blob(raw: bytes, shape: list[int], words: list[str]) -> None:
    rejects(kw(inp(raw, "BYTES", shape)), "input 'x'", *words)


@pytest.mark.parametrize("data", [{"a": 1}, 3, "1.0", None])
def test_data_not_a_list_or_bytes(data: Any) -> None:
    rejects(kw(inp(data, shape=[1])), "input 'x'", "data must be a list or raw bytes")


def test_data_mixing_nested_lists_and_scalars() -> None:
    rejects(kw(inp([1.0, [2.0]], shape=[2])), "input 'x'", "mixes nested lists with scalar")


@pytest.mark.parametrize("params", [[1], "binary", 3])
def test_parameters_not_a_mapping(params: Any) -> None:
    rejects(kw(inp([1.0]), parameters=params), "'parameters' must be a mapping")


@pytest.mark.parametrize("flag", ["true", 1, None])
def test_binary_data_output_not_a_bool(flag: Any) -> None:
    rejects(kw(inp([1.0]), parameters={"binary_data_output": flag}), "binary_data_output", "must be a bool")


def test_first_bad_input_is_named() -> None:
    rejects(
        kw(inp([1.0], name="ok"), inp([1.5], "INT8", name="bad")),
        "input 'bad'",
        "INT8 elements must be integers",
    )
