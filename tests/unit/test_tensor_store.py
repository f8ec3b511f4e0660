"""The tensor store in process (asyncinfer/store/tensor_store.py, a local folder): objects written
whole under their expiry's folder, read back only from under the store's root and at the size
their datatype and shape need, swept once expired; the v2 forms of a reference
(wire/tensor_refs.py) and the identity of a request that carries one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from asyncinfer.errors import InvalidRequest, StoreUnavailable
from asyncinfer.store.tensor_store import TensorStore
from asyncinfer.wire.datatypes import SPECS
from asyncinfer.wire.input_parts import input_parts
from asyncinfer.wire.tensor_refs import binary_form, ref_of, ref_payload


def test_an_object_is_written_under_its_expiry_and_read_back_only_from_the_store(tmp_path: Path) -> None:
    store = TensorStore(str(tmp_path / "s"), ttl_s=100)
    url = store.write("req/1 x", "in-x", b"abcd")
    assert url.startswith(f"file://{tmp_path}/s/expires-") and url.endswith("/req%2F1%20x/in-x.bin")
    assert store.read(url, "w", 4) == b"abcd"
    assert [p.name for p in (tmp_path / "s").rglob("*") if p.name.endswith(".tmp")] == []
    with pytest.raises(InvalidRequest, match="holds 4 bytes; its datatype and shape need 8"):
        store.read(url, "w", 8)
    for outside in ("file:///etc/passwd", f"file://{tmp_path}/s/../t.bin", f"{tmp_path}/other/x",
                    "s3://bucket/x", "http://example.com/x"):
        assert not store.owns(outside)
        with pytest.raises(InvalidRequest, match="w: parameters\\['data_ref'\\] .* is not in this "
                                                 "fleet's tensor store"):
            store.read(outside, "w")
    with pytest.raises(InvalidRequest, match="no such object"):
        store.read(f"file://{tmp_path}/s/expires-1/r/in-x.bin", "w")


def test_expired_folders_are_swept_and_the_others_kept(tmp_path: Path) -> None:
    store = TensorStore(str(tmp_path), ttl_s=100)
    url = store.write("r", "out-y", b"y")
    (tmp_path / "expires-10" / "old").mkdir(parents=True)
    (tmp_path / "expires-10" / "old" / "in-x.bin").write_bytes(b"x")
    (tmp_path / "not-ours").mkdir()
    assert store.sweep() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([url.split("/")[-3], "not-ours"])
    assert store.sweep(now_s=10**12) == 1 and store.sweep() == 0


def test_a_store_that_cannot_be_written_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    store = TensorStore(str(tmp_path / "file" / "s"), ttl_s=100)
    with pytest.raises(StoreUnavailable, match="request r: the tensor store .*file/s could not take "
                                               "'in-x' \\(3 bytes\\)"):
        store.write("r", "in-x", b"abc")


def test_the_v2_forms_of_a_reference() -> None:
    payload = ref_payload("x", "FP32", [2, 2], "s3://b/k")
    assert ref_of(payload, "w") == "s3://b/k" and ref_of({"data": [1]}, "w") is None
    with pytest.raises(InvalidRequest, match="has both 'data' and parameters\\['data_ref'\\]"):
        ref_of({**payload, "data": [1, 2, 3, 4]}, "w")
    with pytest.raises(InvalidRequest, match="must be the URL of the tensor's data"):
        ref_of({"parameters": {"data_ref": 7}}, "w")
    assert binary_form(SPECS["BYTES"], ["ab", b"c"]) == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    assert binary_form(SPECS["FP32"], np.ones(2, np.float32).tobytes()) == np.ones(2, np.float32).tobytes()
    digested = {**payload, "parameters": {**payload["parameters"], "data_digest": "d1"}}
    other_url = {**digested, "parameters": {**digested["parameters"], "data_ref": "s3://b/k2"}}
    assert input_parts([digested])[1] == input_parts([other_url])[1] == [b"d1"]  # content, not URL
