"""The response cache's key (wire/cache_key.py) and its stored template (broker/response_cache.py), in
process. With real Redis and a worker: tests/integration/test_response_cache.py."""

from __future__ import annotations

import json

import pytest

from asyncinfer.broker.response_cache import MARK, fill, template
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.wire.cache_key import cache_key


def _kwargs(data: object, **extra: object) -> dict[str, object]:
    return {"model": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                                      "data": data}], **extra}


def test_the_key_covers_bytes_datatype_shape_name_and_parameters() -> None:
    base = cache_key("m", _kwargs(b"\x00" * 8))
    assert base is not None and base.startswith("asyncinfer:cache:entry:m:")
    assert cache_key("m", _kwargs(b"\x00" * 8)) == base
    assert cache_key("m", _kwargs(b"\x00" * 7 + b"\x01")) != base  # one bit
    variants = [
        {"model": "m", "inputs": [{"name": "y", "datatype": "FP32", "shape": [1, 2], "data": b"\x00" * 8}]},
        {"model": "m", "inputs": [{"name": "x", "datatype": "INT32", "shape": [1, 2], "data": b"\x00" * 8}]},
        {"model": "m", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 1], "data": b"\x00" * 8}]},
        _kwargs(b"\x00" * 8, parameters={"binary_data_output": False}),
        _kwargs([0.0, 0.0]),
    ]
    keys = {cache_key("m", v) for v in variants}
    assert len(keys) == len(variants) and base not in keys
    assert cache_key("other", _kwargs(b"\x00" * 8)) != base


def test_the_bypass_flag_is_no_part_of_the_key_and_false_means_no_key() -> None:
    assert cache_key("m", _kwargs([1.0, 2.0], parameters={"response_cache": True})) == \
        cache_key("m", _kwargs([1.0, 2.0]))
    assert cache_key("m", _kwargs([1.0, 2.0], parameters={"response_cache": False})) is None


def test_json_data_keys_by_its_exact_value() -> None:
    assert cache_key("m", _kwargs([0.1, 0.2])) != cache_key("m", _kwargs([0.1, 0.20000000000000004]))
    assert cache_key("m", _kwargs([0.0, 1.0])) != cache_key("m", _kwargs([-0.0, 1.0]))


def test_unkeyable_requests_have_no_key() -> None:
    assert cache_key("m", _kwargs([2 ** 70, 1])) is None
    assert cache_key("m", {"model": "m"}) is None


def test_the_template_gives_back_the_meta_of_any_request_id() -> None:
    meta = {"status": "SUCCESS", "result": {"id": MARK, "outputs": [{"data": ["a;b,1"]}]},
            "task_id": MARK}
    stored = template(json.dumps(meta))
    for request_id in ("r-1", 'odd "id" \\ é'):
        filled = json.loads(fill(stored, request_id))
        assert filled["task_id"] == filled["result"]["id"] == request_id
        assert filled["result"]["outputs"] == meta["result"]["outputs"]


@pytest.mark.parametrize(("option", "value"), [("response_cache_ttl_s", 0),
                                               ("response_cache_max_entries", 0),
                                               ("response_cache", "yes")])
def test_cache_options_are_checked(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        ModelOptions(**{option: value})
