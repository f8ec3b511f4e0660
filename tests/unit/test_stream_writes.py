"""A decoupled model's stream entries through the result writer (fakeredis, with its Lua): a
request's start and parts queued as they come and its final with its outcome, all before its
result; none for a request without a stream, and no call at all for a batch without one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from celery import states
from celery.exceptions import TaskRevokedError

from asyncinfer.errors import ModelError
from asyncinfer.wire.protocol import Tensor
from asyncinfer.wire.stream import FINAL, PART, START, decode_entry, stream_key
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.stream_write import attempt_of, lease_tag
from tests.unit.test_result_writer import _meta, _Refusing, _taken, _write, broker, writer

__all__ = ["broker", "writer"]  # the fixtures, from the writer's own tests

pytestmark = pytest.mark.timeout(60)


def _word(word: str) -> list[Any]:
    return [Tensor("text_output", "BYTES", (1, 1), np.array([[word]], dtype=object), False)]


def _entries(r: Any, request_id: str) -> list[tuple[str, str, dict[str, str], list[Any]]]:
    return [(e.id, e.kind, dict(e.fields), e.outputs)
            for e in (decode_entry(i, f) for i, f in r.xrange(stream_key(request_id)))]


def test_a_streamed_request_has_its_start_parts_and_final_written_with_its_result(
        writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    d = _taken(broker, "s1")
    d.stream_max_parts = 100
    w.stream_start(d, "w1@h")
    w.stream_part(d, 1, _word("hello"))
    w.stream_part(d, 2, [Tensor("text_output", "BYTES", (1, 1),
                                np.array([[b"bytes"]], dtype=object), False)])
    _write(w, [Outcome(d, states.SUCCESS, {"id": "s1", "outputs": []})])
    assert _entries(broker, "s1") == [
        ("0-1", START, {"worker": "w1@h", "tag": d.tag, "attempt": "1"}, []),
        ("1-0", PART, {}, [{"name": "text_output", "shape": [1, 1], "datatype": "BYTES",
                            "data": ["hello"]}]),
        ("2-0", PART, {}, [{"name": "text_output", "shape": [1, 1], "datatype": "BYTES",
                            "data": ["bytes"]}]),
        ("2-1", FINAL, {"status": "SUCCESS", "error": "", "parts": "2"}, []),
    ]
    assert _meta(broker, "s1")["status"] == states.SUCCESS
    assert 0 < broker.ttl(stream_key("s1")) <= broker.ttl("celery-task-meta-s1") + 1


def test_finals_say_how_each_streamed_request_ended_and_a_retry_writes_none(
        writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    revoked, failed, retried, plain = (_taken(broker, i) for i in ("rv", "fl", "rt", "pl"))
    for d in (revoked, failed, retried):
        d.stream_max_parts = 100
    _write(w, [Outcome(revoked, states.REVOKED, TaskRevokedError("request rv: revoked")),
               Outcome(failed, states.FAILURE, ModelError("request fl: boom")),
               Outcome(retried, states.RETRY, ModelError("request rt: later"), retry="{}"),
               Outcome(plain, states.SUCCESS, {"id": "pl", "outputs": []})])
    assert _entries(broker, "rv") == [
        ("0-1", FINAL, {"status": "REVOKED", "error": "request rv: revoked", "parts": "0"}, [])]
    assert _entries(broker, "fl")[0][2]["error"] == "request fl: boom"
    assert _entries(broker, "rt") == [] and _entries(broker, "pl") == []


def test_a_batch_without_streams_makes_no_stream_call(writer: Any, broker: _Refusing,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    w, _ = writer
    calls: list[Any] = []
    monkeypatch.setattr(w, "streams", lambda *a, **k: calls.append(a) or (0, []))
    _write(w, [Outcome(_taken(broker, f"p{i}"), states.SUCCESS, {"id": f"p{i}", "outputs": []})
               for i in range(3)])
    assert calls == []


def test_stream_entries_refused_by_redis_are_tried_again_before_the_result(
        writer: Any, broker: _Refusing) -> None:
    w, _ = writer
    d = _taken(broker, "oom")
    d.stream_max_parts = 100
    _Refusing.refusals = 1  # the first script call (the appends) is refused for memory
    w.stream_start(d, "w1@h")
    w.stream_part(d, 1, _word("x"))
    _write(w, [Outcome(d, states.SUCCESS, {"id": "oom", "outputs": []})])
    assert [(i, k) for i, k, _, _ in _entries(broker, "oom")] == [
        ("0-1", START), ("1-0", PART), ("1-1", FINAL)]
    assert _meta(broker, "oom")["status"] == states.SUCCESS



@pytest.mark.parametrize(("retries", "deaths", "redelivered", "attempt"), [
    (0, 0, False, 1), (2, 0, False, 3), (0, 1, True, 2), (0, 0, True, 2), (1, 2, True, 4)])
def test_a_starts_attempt_counts_retries_and_runs_cut_short(
        broker: _Refusing, retries: int, deaths: int, redelivered: bool, attempt: int) -> None:
    d = _taken(broker, "a")
    d.headers["retries"] = retries
    if redelivered:
        d.headers["redelivered"] = True
    d.deaths = deaths
    assert attempt_of(d) == attempt


def test_a_starts_tag_is_its_lease_where_its_transport_leases_it(broker: _Refusing) -> None:
    d = _taken(broker, "t")
    assert lease_tag(d) == d.tag != ""  # the take script leases what it takes

    class Channel:
        lease_s = 0.0

    class Message:
        channel = Channel()

    d.message = Message()
    assert lease_tag(d) == ""  # kombu without leases (RabbitMQ)
    Channel.lease_s = 10.0
    assert lease_tag(d) == d.tag  # kombu's Redis channel with leases
