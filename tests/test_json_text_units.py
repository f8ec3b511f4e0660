"""wire/json_text.loads: orjson's speed, the standard library's answers — the same value, or the
same error, for every text either of them treats specially."""

from __future__ import annotations

import json
from typing import Any

import pytest

from asyncinfer.wire import json_text

pytestmark = pytest.mark.unit

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

