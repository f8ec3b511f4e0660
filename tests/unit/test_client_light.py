"""The numpy codec that lets ``from asyncinfer import Client`` go without torch gives what the torch
one gives: BF16 rounding, datatype inference and casts. That the client and the ``asyncinfer``
command load no torch: tests/integration/test_client_light.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.bfloat16 import from_bits, round_to_bf16, to_bits
from asyncinfer.wire.payloads import array_from_value, output_to_numpy, output_to_torch, to_input_payload
from asyncinfer.wire.protocol import Tensor, encode_tensor

pytestmark = pytest.mark.timeout(120)


def test_bf16_rounding_is_torchs() -> None:
    rng = np.random.default_rng(7)
    ties = (np.arange(1 << 16, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    wide = rng.standard_normal(50_000) * np.exp2(rng.integers(-150, 130, 50_000))
    specials = np.array([1 + 2**-8 + 2**-30, 3.3961e38, 1e39, -1e39, 1e300, 5e-324, -0.0, np.inf])
    for values in (ties[~np.isnan(ties)], wide, specials, rng.integers(-2**62, 2**62, 10_000)):
        expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()
        np.testing.assert_array_equal(to_bits(round_to_bf16(values)), expected)


def test_bf16_rounding_keeps_every_bfloat16_bit_pattern() -> None:
    every = np.arange(1 << 16, dtype=np.uint16)  # NaN payloads and signalling NaNs included
    assert to_bits(round_to_bf16(from_bits(every))).tolist() == every.tolist()
    nans = np.array([0x7F800001, 0xFF800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    assert to_bits(round_to_bf16(nans)).tolist() == [0x7FC0, 0xFFC0, 0x7FFF]  # stay NaNs


def test_numpy_values_get_the_datatype_torch_gave_them() -> None:
    for np_dtype, datatype in [(np.bool_, "BOOL"), (np.uint16, "UINT16"), (">i8", "INT64"),
                               (np.float16, "FP16"), ("<f8", "FP64")]:
        arr = np.arange(6).reshape(2, 3).astype(np_dtype)
        dt, shape, values = array_from_value("a", arr)
        assert (dt, shape, values.dtype.isnative) == (datatype, (2, 3), True)
        np.testing.assert_array_equal(values, arr)
    dt, shape, values = array_from_value("s", np.float32(2.5))
    assert (dt, shape, values.tolist()) == ("FP32", (1,), [2.5])
    with pytest.raises(InvalidRequest, match="tensor 'c': numpy dtype complex128 has no v2 datatype"):
        array_from_value("c", np.ones(2, dtype=np.complex128))
    with pytest.raises(InvalidRequest, match="tensor 'b': cannot make BYTES from numeric values"):
        array_from_value("b", np.ones(2), "BYTES")


@pytest.mark.parametrize("datatype", ["BF16", "FP16", "INT8", "UINT8", "BOOL", "INT64"])
def test_numpy_casts_give_the_bytes_torch_casts_give(datatype: str) -> None:
    values = np.array([0.1, 1.75, 3.0, 0.0, 2.5, 100.0])
    ours = to_input_payload("v", values, binary=True, datatype=datatype)
    theirs = encode_tensor(Tensor("v", datatype, (6,), torch.from_numpy(values), False), binary=True)
    assert ours == theirs


def test_bf16_output_reads_alike_from_a_list_and_from_raw_bytes() -> None:
    bits = np.array([0x3F81, 0xC2F7, 0x0001, 0x7FC1, 0xFF80], "<u2")
    raw = {"name": "o", "shape": [5], "datatype": "BF16", "data": bits.tobytes()}
    listed = {**raw, "data": output_to_numpy(raw).tolist()}
    assert output_to_numpy(raw).view(np.uint32).tolist() == [b << 16 for b in bits.tolist()]
    np.testing.assert_array_equal(output_to_numpy(listed), output_to_numpy(raw))
    assert output_to_torch(raw).view(torch.uint16).tolist() == bits.tolist()
