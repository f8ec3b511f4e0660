"""Streaming, the worker's side, on a real Redis and real worker processes: a decoupled model's
request has its parts in its Redis Stream (wire/stream.py) as they are made, a ``start`` and a
``final``, and its one answer joined; a worker killed mid-stream and its successor leave each
part once, without a gap; a revoke mid-stream ends it at once (REVOKED).

The streams are read here directly (XRANGE / XREAD), not through a client's reader."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.errors import InvalidRequest
from asyncinfer.wire.keys import LEASES_KEY
from asyncinfer.wire.stream import FINAL, PART, START, StreamEntry, decode_entry, stream_key
from tests.support.databases import RedisDatabases
from tests.support.processes import TEST_FACTORIES, start_worker
from tests.support.stream_models import SLOW_ECHO_FACTORY
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

FACTORIES = f"{TEST_FACTORIES},{SLOW_ECHO_FACTORY}"
MODELS = "echo-stream,slow-echo"


def _entries(r: redis.Redis, request_id: str) -> list[StreamEntry]:
    return [decode_entry(i, f) for i, f in r.xrange(stream_key(request_id))]


def _parts(entries: list[StreamEntry]) -> list[StreamEntry]:
    return [e for e in entries if e.kind == PART]


def _word(entry: StreamEntry) -> str:
    (tensor,) = entry.outputs
    assert (tensor["name"], tensor["datatype"], tensor["shape"]) == ("text_output", "BYTES", [1, 1])
    (word,) = tensor["data"]
    return word


def _text(text: str, max_tokens: int | None = None) -> dict[str, np.ndarray]:
    inputs = {"text_input": np.array([text], dtype=object)}
    if max_tokens is not None:
        inputs["max_tokens"] = np.array([max_tokens], np.int32)
    return inputs


def _wait_parts(r: redis.Redis, request_id: str, count: int, timeout_s: float = 60) -> None:
    wait_for(lambda: len(_parts(_entries(r, request_id))) >= count, timeout_s,
             f"{count} parts of {request_id} in its stream", poll_s=0.01)


@pytest.fixture(scope="module", params=["fast", "celery"])
def served(request: pytest.FixtureRequest, redis_databases: RedisDatabases,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    consumer = request.param
    with redis_databases.take(f"streaming-{consumer}") as db:
        proc = start_worker(db.url, tmp_path_factory.mktemp(consumer) / "worker.log",
                            "--device", "cpu", "--models", MODELS,
                            "--hostname", f"stream-{consumer}@%h", ASYNCINFER_CONSUMER=consumer,
                            ASYNCINFER_MODEL_FACTORIES=FACTORIES)
        try:
            yield consumer, db.url, str(proc.log_path)
        finally:
            proc.stop()


def test_each_request_gets_its_own_parts_in_order_a_start_a_final_and_its_answer_joined(
        served: tuple[str, str, str]) -> None:
    consumer, url, _ = served
    r = redis.Redis.from_url(url)
    asked = [("the quick brown fox", None), ("jumps over", 5), ("dog", None),
             ("a b c d e f g h", 3)]
    with Client(broker_url=url) as client:
        # sent together: they share device batches, their rows finishing at different steps
        futures = [client.submit("echo-stream", _text(t, n)) for t, n in asked]
        answers = [f.result(timeout=60)["text_output"].tolist() for f in futures]
    expected = [(t.split() * 5)[:n or len(t.split())] for t, n in asked]
    assert answers == [[" ".join(words)] for words in expected]
    for future, words in zip(futures, expected, strict=True):
        entries = _entries(r, future.id)
        ids = [e.id for e in entries]
        assert [e.kind for e in entries] == [START, *[PART] * len(words), FINAL], entries
        assert ids == ["0-1", *[f"{n}-0" for n in range(1, len(words) + 1)], f"{len(words)}-1"]
        start, final = entries[0], entries[-1]
        assert start.fields["worker"].startswith(f"stream-{consumer}@")
        assert start.fields["attempt"] == "1"
        assert start.fields["tag"]  # its lease's tag (both consumers lease on Redis)
        assert [_word(e) for e in _parts(entries)] == words
        assert dict(final.fields) == {"status": "SUCCESS", "error": "", "parts": str(len(words))}
        assert r.ttl(stream_key(future.id)) > 0  # expires with the result
    r.close()


def test_the_first_part_is_in_the_stream_while_the_request_still_runs(
        served: tuple[str, str, str]) -> None:
    _, url, _ = served
    r = redis.Redis.from_url(url)
    with Client(broker_url=url) as client:
        future = client.submit("slow-echo", _text("one two three", 60))  # 60 steps of 0.02 s
        reply = r.xread({stream_key(future.id): "0-0"}, block=60_000, count=10)
        while not any(f[b"kind"] == b"part" for _, entries in reply for _, f in entries):
            reply = r.xread({stream_key(future.id): reply[0][1][-1][0]}, block=60_000)
        meta = r.get(f"celery-task-meta-{future.id}")
        assert meta is None or json.loads(meta)["status"] != "SUCCESS"
        # its start names its lease, held while it runs
        start = _entries(r, future.id)[0]
        assert start.kind == START and r.zscore(LEASES_KEY, start.fields["tag"]) is not None
        assert future.result(timeout=60)["text_output"].tolist() == [
            " ".join(["one", "two", "three"] * 20)]
    parts = _parts(_entries(r, future.id))
    assert [p.part for p in parts] == list(range(1, 61))
    r.close()


def test_a_request_of_two_rows_fails_naming_the_one_row_rule_and_its_stream_says_so(
        served: tuple[str, str, str]) -> None:
    _, url, _ = served
    r = redis.Redis.from_url(url)
    with Client(broker_url=url) as client:
        future = client.submit("echo-stream", {"text_input": np.array(["a", "b"], dtype=object)})
        with pytest.raises(InvalidRequest) as caught:
            future.result(timeout=60)
    assert f"request {future.id}" in str(caught.value)
    assert "exactly one row" in str(caught.value)
    entries = _entries(r, future.id)
    assert [(e.id, e.kind) for e in entries] == [("0-1", START), ("0-2", FINAL)]
    assert entries[1].fields["status"] == "FAILURE"
    assert "exactly one row" in entries[1].fields["error"] and entries[1].fields["parts"] == "0"
    r.close()


def test_a_revoke_mid_stream_ends_the_request_within_a_step(served: tuple[str, str, str]) -> None:
    _, url, _ = served
    r = redis.Redis.from_url(url)
    with Client(broker_url=url) as client:
        future = client.submit("slow-echo", _text("la", 1000))  # 20 s of steps
        _wait_parts(r, future.id, 3)
        assert future.cancel()
        wait_for(lambda: any(e.kind == FINAL for e in _entries(r, future.id)), 60,
                 "the stream's final")
        meta = wait_for(lambda: r.get(f"celery-task-meta-{future.id}"), 30, "the stored result")
        assert json.loads(meta)["status"] == "REVOKED"
    entries = _entries(r, future.id)
    final = entries[-1]
    assert final.kind == FINAL and final.fields["status"] == "REVOKED"
    # the worker saw the revoke after k parts (its error says so); its stream holds at most one
    # more (a step under way when the revoke came), and it stopped long before its 1000 words
    error = final.fields["error"]
    assert "revoked while model 'slow-echo' streamed it" in error, error
    seen = int(error.split("after ")[1].split(" part")[0])
    parts = _parts(entries)
    assert [p.part for p in parts] == list(range(1, len(parts) + 1))
    assert 3 <= len(parts) <= seen + 1 and len(parts) < 1000
    assert final.fields["parts"] == str(len(parts))
    r.close()


@pytest.mark.parametrize("consumer", ["fast", "celery"])
def test_a_worker_killed_mid_stream_and_its_successor_leave_each_part_once(
        consumer: str, redis_db, tmp_path) -> None:
    # Given a worker streaming a long request (150 steps of 0.02 s), short leases
    url = redis_db.url
    r = redis_db.client
    env = {"ASYNCINFER_CONSUMER": consumer, "ASYNCINFER_MODEL_FACTORIES": FACTORIES,
           "ASYNCINFER_LEASE_S": "2", "ASYNCINFER_VISIBILITY_TIMEOUT_S": "30"}
    first = start_worker(url, tmp_path / "first.log", "--device", "cpu", "--models", "slow-echo",
                         "--hostname", "killed@%h", **env)
    second = None
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    try:
        with Client(broker_url=url) as client:
            future = client.submit("slow-echo", _text(" ".join(words), 150))
            _wait_parts(r, future.id, 10)
            # When it is killed with SIGKILL mid-stream, and another worker starts
            os.kill(first.pid, signal.SIGKILL)
            first.process.wait()
            before = _entries(r, future.id)
            assert not any(e.kind == FINAL for e in before), before[-3:]
            second = start_worker(url, tmp_path / "second.log", "--device", "cpu", "--models",
                                  "slow-echo", "--hostname", "successor@%h", **env)
            # Then the request completes there, its answer whole
            answer = future.result(timeout=90)["text_output"].tolist()
        assert answer == [" ".join((words * 30)[:150])]
        entries = _entries(r, future.id)
        # each part once, in order, without a gap, every one of the 150
        parts = _parts(entries)
        assert [p.part for p in parts] == list(range(1, 151))
        assert [_word(p) for p in parts] == (words * 30)[:150]
        ids = [e.id for e in entries]
        assert len(set(ids)) == len(ids)
        # two starts: the killed worker's, then its successor's (the parts it had written kept)
        starts = [e for e in entries if e.kind == START]
        assert len(starts) == 2, [(e.id, e.kind) for e in entries if e.kind != PART]
        assert starts[0].id == "0-1" and starts[0].fields["worker"].startswith("killed@")
        assert starts[1].fields["worker"].startswith("successor@")
        assert starts[1].fields["attempt"] == "2"
        assert starts[1].part >= len(_parts(before))  # after what the killed worker wrote
        final = entries[-1]
        assert final.kind == FINAL and dict(final.fields) == {
            "status": "SUCCESS", "error": "", "parts": "150"}
    finally:
        if first.process.poll() is None:
            first.stop()
        if second is not None:
            second.stop()


def test_bad_input_of_a_decoupled_model_ends_its_stream_with_a_failure(
        served: tuple[str, str, str]) -> None:
    _, url, _ = served
    r = redis.Redis.from_url(url)
    with Client(broker_url=url) as client:
        future = client.submit("echo-stream", {"nope": np.array(["x"], dtype=object)})
        with pytest.raises(InvalidRequest):
            future.result(timeout=60)
    # it reached the decoupled model's runner: start and final FAILURE
    assert [e.kind for e in _entries(r, future.id)] == [START, FINAL]
    r.close()



def test_a_request_sent_while_another_streams_joins_its_batch_and_ends_first(
        served: tuple[str, str, str]) -> None:
    # In-flight batching (slow-echo is echo-stream's: Model.inflight_batching): a request that
    # arrives while a long one streams joins the running batch between two steps, instead of
    # waiting for the whole batch to end.
    _, url, _ = served
    r = redis.Redis.from_url(url)
    with Client(broker_url=url) as client:
        long = client.submit("slow-echo", _text("la", 1000))  # 20 s of steps
        _wait_parts(r, long.id, 3)
        short = client.submit("slow-echo", _text("x y", 3))  # the same signature
        assert short.result(timeout=60)["text_output"].tolist() == ["x y x"]
        # it finished while the long one still streams: it joined the running batch (a static
        # batch would have kept it waiting until the long one's 1000th part and final)
        during = _entries(r, long.id)
        assert not any(e.kind == FINAL for e in during), during[-2:]
        assert 3 <= len(_parts(during)) < 1000
        assert long.cancel()
        wait_for(lambda: any(e.kind == FINAL for e in _entries(r, long.id)), 60,
                 "the long stream's final")
    entries = _entries(r, short.id)
    assert [e.kind for e in entries] == [START, PART, PART, PART, FINAL]
    assert [_word(e) for e in _parts(entries)] == ["x", "y", "x"]
    assert dict(entries[-1].fields) == {"status": "SUCCESS", "error": "", "parts": "3"}
    long_entries = _entries(r, long.id)
    assert [p.part for p in _parts(long_entries)] == list(range(1, len(_parts(long_entries)) + 1))
    assert long_entries[-1].fields["status"] == "REVOKED"
    r.close()
