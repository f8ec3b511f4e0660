"""The stream append script (worker/output/stream_write.py) on a real Redis: part numbers as IDs,
what comes twice skipped, markers after the last part, nothing after a ``final``, trimming,
expiry, and a key that is no stream."""

from __future__ import annotations

import pytest

from asyncinfer.wire.stream import FINAL, PART, START, decode_entry
from asyncinfer.worker.output.stream_write import StreamAppend, StreamScript

pytestmark = pytest.mark.timeout(60)

KEY = "asyncinfer:stream:req-1"


def part(n: int, max_parts: int = 100, key: str = KEY) -> StreamAppend:
    return StreamAppend(key, PART, n, max_parts, (f'{{"outputs":[{{"n":{n}}}]}}', "", ""))


def start(worker: str = "w1", tag: str = "t1", attempt: str = "1") -> StreamAppend:
    return StreamAppend(KEY, START, 0, 100, (worker, tag, attempt))


def final(status: str = "SUCCESS", error: str = "") -> StreamAppend:
    return StreamAppend(KEY, FINAL, 0, 100, (status, error, ""))


def entries(r, key: str = KEY) -> list[tuple[str, str, dict[str, str]]]:
    return [(e.id, e.kind, {**e.fields, **({"n": e.outputs[0]["n"]} if e.outputs else {})})
            for e in (decode_entry(i, f) for i, f in r.xrange(key))]


def test_parts_markers_and_repeats(redis_db) -> None:
    r = redis_db.client
    script = StreamScript(r, 60)
    # a start on an empty stream, parts 1-3 (a part again, as a rerun sends it: skipped)
    first = [start(), part(1), part(2), part(1), part(3)]
    assert script(first) == (4, [])
    # the same call tried again (Redis ran it, its reply was lost): nothing appended twice
    assert script(first, again=True) == (0, [])
    # a new run: its start after part 3, its parts 1-3 skipped, 4 appended
    second = [start("w2", "t2", "2"), part(1), part(2), part(3), part(4)]
    assert script(second) == (2, [])
    assert script(second, again=True) == (0, [])
    assert script([final()]) == (1, [])
    # nothing after a final: not a part, a start, or a second final
    assert script([part(5), start("w3", "t3", "3"), final("FAILURE", "late")]) == (0, [])
    assert entries(r) == [
        ("0-1", START, {"worker": "w1", "tag": "t1", "attempt": "1"}),
        ("1-0", PART, {"n": 1}), ("2-0", PART, {"n": 2}), ("3-0", PART, {"n": 3}),
        ("3-1", START, {"worker": "w2", "tag": "t2", "attempt": "2"}),
        ("4-0", PART, {"n": 4}),
        ("4-1", FINAL, {"status": "SUCCESS", "error": "", "parts": "4"}),
    ]
    assert 0 < r.ttl(KEY) <= 60


def test_a_final_on_an_empty_stream_and_markers_in_a_row(redis_db) -> None:
    r = redis_db.client
    script = StreamScript(r, 0)  # results that never expire: nor do the streams
    # a start equal to the one before, on a first try, is a run of its own
    assert script([start(), start(), start("w2", "t2", "2"), final("REVOKED", "revoked")]) == (
        4, [])
    assert [(i, k) for i, k, _ in entries(r)] == [
        ("0-1", START), ("0-2", START), ("0-3", START), ("0-4", FINAL)]
    assert entries(r)[-1][2] == {"status": "REVOKED", "error": "revoked", "parts": "0"}
    assert r.ttl(KEY) == -1


def test_each_append_trims_to_the_most_entries_and_a_key_that_is_no_stream_is_reported(
        redis_db) -> None:
    r = redis_db.client
    r.set("asyncinfer:stream:not-a-stream", "x")
    script = StreamScript(r, 60)
    appended, errors = script([part(n, max_parts=3) for n in range(1, 6)]
                              + [part(1, key="asyncinfer:stream:not-a-stream")])
    assert appended == 5
    assert len(errors) == 1 and errors[0].startswith("asyncinfer:stream:not-a-stream: WRONGTYPE")
    assert [i for i, _, _ in entries(r)] == ["3-0", "4-0", "5-0"]
    # trimmed, the last ID still rules: part 2 is not appended again
    assert script([part(2, max_parts=3), part(6, max_parts=3)]) == (1, [])
    assert [i for i, _, _ in entries(r)] == ["4-0", "5-0", "6-0"]
