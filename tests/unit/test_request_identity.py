"""A caller-chosen request ID's identity (wire/request_identity.py): what makes two requests the
same, and the words of a refusal."""

from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.wire.request_identity import differences, identity, reused_message, same_request


def _kwargs(data: object, datatype: str = "FP32", shape: tuple[int, ...] = (1, 2),
            **parameters: object) -> dict[str, object]:
    return {"model": "m", "inputs": [{"name": "x", "datatype": datatype, "shape": list(shape),
                                       "data": data}], "parameters": parameters}


def test_the_same_request_has_the_same_identity_whatever_its_parameters_order() -> None:
    raw = np.ones((1, 2), np.float32).tobytes()
    a = identity("infer.m", _kwargs(raw, a=1, b=2))
    assert a == identity("infer.m", _kwargs(bytearray(raw), b=2, a=1))
    assert same_request(a, a) and differences(a, a) == []


@pytest.mark.parametrize(("other", "said"), [
    (_kwargs(np.zeros((1, 2), np.float32).tobytes()), ["inputs"]),
    (_kwargs(np.ones((1, 2), np.float32).tobytes(), shape=(2, 1)), ["inputs"]),
    (_kwargs(np.ones((1, 2), np.float16).tobytes() * 2, datatype="FP16"), ["inputs"]),
    (_kwargs([1.0, 1.0]), ["inputs"]),  # the same numbers as a list: answered as a list
    (_kwargs(np.ones((1, 2), np.float32).tobytes(), model_version="3"), ["model version"]),
    (_kwargs(np.ones((1, 2), np.float32).tobytes(), priority_hint=1), ["parameters"]),
    (_kwargs(np.zeros((1, 2), np.float32).tobytes(), model_version="3", k=1),
     ["model version", "inputs", "parameters"]),
])
def test_a_request_that_differs_is_another_request_and_the_difference_is_named(
        other: dict[str, object], said: list[str]) -> None:
    first = identity("infer.m", _kwargs(np.ones((1, 2), np.float32).tobytes()))
    mine = identity("infer.m", other)
    assert not same_request(mine, first)
    assert [d.split(" (")[0] for d in differences(mine, first)] == said


def test_another_queue_is_another_model_and_the_message_names_both() -> None:
    kwargs = _kwargs([1.0, 2.0])
    first, mine = identity("infer.add_sub", kwargs), identity("infer.square", kwargs)
    assert not same_request(mine, first)
    assert reused_message("7", mine, first) == (
        "request 7: this request ID was already sent with a different model (first sent to queue "
        "infer.add_sub, now to infer.square); a request ID names one request, and its answer "
        "would be the first one's (send a new request with a new ID, or with none: one is "
        "generated)")


def test_a_version_named_and_one_left_to_the_latest_differ() -> None:
    first = identity("infer.m", _kwargs([1.0, 2.0], model_version="2"))
    mine = identity("infer.m", _kwargs([1.0, 2.0]))
    assert differences(mine, first) == [
        "model version (first version 2, now the latest version)"]


def test_claims_too_bare_to_compare_count_as_the_same_request() -> None:
    mine = identity("infer.m", _kwargs([1.0, 2.0]))
    assert same_request(mine, "infer.m") and same_request(mine, "1")
    assert not same_request(mine, "infer.other")
    # a request whose parts cannot be encoded has the queue alone for identity
    assert identity("infer.m", _kwargs([float("nan"), object()])) == "infer.m"
    assert identity("infer.m", {"inputs": "nonsense"}) == "infer.m"
