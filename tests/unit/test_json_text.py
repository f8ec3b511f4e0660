"""wire/json_text: orjson's speed, the standard library's answers. ``loads``: the same value, or the
same error, for every text either of them treats specially; ``dumps``: a text that reads back as
the standard library's does, or the standard library's error."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from typing import Any

import pytest

from asyncinfer.wire import json_text

TEXTS = [
    '{"a": NaN, "b": Infinity, "c": -Infinity}',
    "[1e400]",
    "[123456789012345678901234567890]",
    "[-9223372036854775809]",
    "[18446744073709551616]",
    "[9223372036854775807, -9223372036854775808]",
    '"\\ud800"',
    '{"a": 1, "a": 2}',
    "[" * 2000 + "]" * 2000,
    b"\xff\xfe[\x001\x00]\x00",
    "[-0, 0.1, 1.5e-7, 1.0000000000000000001]",
    b"\xc3\x28",
    "",
    '{"a": 1',
    '{"x": "\\u00e9\\n", "y": [true, false, null]}',
    '{"properties": {"delivery_tag": "t"}, "headers": {"id": "r"}, "body": "W10="}',
]


def _outcome(parse: Any, text: Any) -> Any:
    try:
        return "value", parse(text)
    except Exception as exc:  # noqa: BLE001 - the error is the answer compared
        return "error", type(exc), str(exc)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_loads_answers_as_the_standard_library_does(text: Any) -> None:
    ours, theirs = _outcome(json_text.loads, text), _outcome(json.loads, text)
    assert ascii(ours) == ascii(theirs)  # an integer read as a float would show: 1.2e+29



@dataclasses.dataclass
class _Point:
    x: int


class _Text(str):
    pass


VALUES = [
    {"model": "mlp", "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3],
                                 "data": [0.1, -2.5e-7, 3.0]}], "parameters": {}},
    {"data": [float("nan"), 1.0]},
    [float("inf"), float("-inf")],
    {"a": None},
    ["nullable", "é", "\u2028"],
    [2**64, -(2**63) - 1],
    [2**63 - 1, -(2**63)],
    {1: "a"},
    "\ud800",
    [True, False, 0, -0.0, 1e300],
    {"when": datetime.datetime(2026, 12, 2)},
    _Point(1),
    {"text": _Text("x")},
    [[[[]]]],
]


def _read_back(write: Any, value: Any) -> Any:
    try:
        text = write(value)
    except Exception as exc:  # noqa: BLE001 - the error is the answer compared
        return "error", type(exc), str(exc)
    return "value", json.loads(text)


@pytest.mark.parametrize("value", VALUES, ids=range(len(VALUES)))
def test_dumps_reads_back_as_the_standard_library_text(value: Any) -> None:
    ours = _read_back(json_text.dumps, value)
    theirs = _read_back(lambda v: json.dumps(v).encode(), value)
    # NaN != NaN: compare the texts the values would be written as again
    assert ascii(ours) == ascii(theirs)
    if ours[0] == "value":
        assert json.dumps(ours[1]) == json.dumps(theirs[1])


def test_dumps_keeps_nan_and_infinity_as_the_standard_library_writes_them() -> None:
    back = json.loads(json_text.dumps({"data": [float("nan"), float("inf"), 1.5]}))
    assert math.isnan(back["data"][0]) and back["data"][1] == math.inf and back["data"][2] == 1.5


def test_dumps_writes_compact_utf8_text_when_nothing_can_differ() -> None:
    assert json_text.dumps({"a": [1, 2.5], "b": "é"}) == '{"a":[1,2.5],"b":"é"}'.encode()
