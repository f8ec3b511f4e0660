"""Streaming responses end to end: real workers serving the built-in decoupled model echo-stream
(one word per part, one step every few milliseconds), read by the client's streams
(client/streams.py), asyncio, the CLI and docs/streaming.md's example.

The module's worker serves a database of its own; the test that kills a worker starts its own on
another."""

from __future__ import annotations

import asyncio
import gc
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import redis
from celery.exceptions import TaskRevokedError

from asyncinfer.client import Client, Interruption
from asyncinfer.errors import RequestRevoked
from asyncinfer.wire.keys import RESULT_KEY_PREFIX
from tests.support.databases import RedisDatabases
from tests.support.processes import ROOT, start_worker, worker_env

pytestmark = pytest.mark.timeout(180)

MODELS = "echo-stream,identity"
#: Words enough that a request is still running long after its first part (a step each).
ENDLESS = np.array([1_000_000], np.int32)


@pytest.fixture(scope="module")
def served(redis_databases: RedisDatabases,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_databases.take("stream client") as db:
        proc = start_worker(db.url, tmp_path_factory.mktemp("stream") / "worker.log",
                            "--device", "cpu", "--models", MODELS,
                            "--hostname", "stream-client@%h")
        try:
            yield db.url
        finally:
            proc.stop()


@pytest.fixture()
def client(served: str) -> Iterator[Client]:
    c = Client(broker_url=served)
    try:
        yield c
    finally:
        c.close()


def text(words: list[str], max_tokens: Any = None) -> dict[str, Any]:
    inputs: dict[str, Any] = {"text_input": [" ".join(words)]}
    if max_tokens is not None:
        inputs["max_tokens"] = max_tokens
    return inputs


def word_of(part: Any) -> str:
    return str(part["text_output"].reshape(-1)[0])


def stored_status(r: redis.Redis, request_id: str) -> str | None:
    payload = r.get(RESULT_KEY_PREFIX + request_id)
    return None if payload is None else json.loads(payload)["status"]


def revoked_in_the_end(client: Client, request_id: str) -> BaseException:
    """The request's error once it is stored (it must be a revoke)."""
    with pytest.raises(TaskRevokedError) as caught:
        client.future(request_id).result(timeout=60)
    return caught.value


def test_the_streaming_page_client_example_runs(served: str) -> None:
    page = (ROOT / "docs" / "streaming.md").read_text()
    code = re.search(r"<!-- stream-example[^>]*-->\s*```python\n(.*?)```", page,
                     re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    out = subprocess.run([sys.executable, "-c", code], env=worker_env(served), cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["1 [['the']]", "2 [['quick']]", "3 [['brown']]",
                                       "4 [['fox']]", "['the quick brown fox']"]


def test_parts_come_in_order_each_once_and_join_to_the_answer(client: Client) -> None:
    words = [f"w{i}" for i in range(40)]
    with client.stream("echo-stream", text(words)) as parts:
        got = [(p.index, word_of(p), p.request_id) for p in parts]
        assert parts.ended and parts.interruptions == []
    assert got == [(i + 1, w, parts.request_id) for i, w in enumerate(words)]
    # and the request's one answer (what every other client gets) is the parts joined
    assert client.result(parts.request_id, timeout_s=30)["text_output"].tolist() == [
        " ".join(words)]


def test_the_first_part_arrives_while_the_request_runs_and_closing_revokes_it(
        client: Client, served: str) -> None:
    r = redis.Redis.from_url(served)
    try:
        stream = client.stream("echo-stream", text(["a", "b", "c"], ENDLESS))
        first = next(stream)
        # Then the first part is here while the request is still running (not stored as done)
        assert (first.index, word_of(first)) == (1, "a")
        assert stored_status(r, stream.request_id) in (None, "STARTED")
        second = next(stream)
        assert (second.index, word_of(second)) == (2, "b")
        # When the stream is closed before the end
        stream.close()
        # Then the request ends REVOKED, and its stream says so to any reader
        assert "revoked" in str(revoked_in_the_end(client, stream.request_id))
        assert stored_status(r, stream.request_id) == "REVOKED"
        with pytest.raises(RequestRevoked, match=f"request {stream.request_id}"):
            list(client.read_stream(stream.request_id, after=2))
    finally:
        r.close()


def test_leaving_the_with_block_revokes(client: Client) -> None:
    with client.stream("echo-stream", text(["x"], ENDLESS)) as parts:
        assert next(parts).index == 1
    revoked_in_the_end(client, parts.request_id)


def test_an_unfinished_stream_garbage_collected_revokes(client: Client) -> None:
    stream = client.stream("echo-stream", text(["y"], ENDLESS))
    assert next(stream).index == 1
    request_id = stream.request_id
    del stream
    gc.collect()
    revoked_in_the_end(client, request_id)


def test_concurrent_streams_each_get_their_own_parts(client: Client) -> None:
    # Given eight streams at once, each of its own words (several share a device batch)
    texts = {n: [f"s{n}-{i}" for i in range(12 + n)] for n in range(8)}
    started = threading.Barrier(len(texts))

    def read(n: int) -> tuple[str, list[tuple[int, str]]]:
        started.wait()
        with client.stream("echo-stream", text(texts[n])) as parts:
            return parts.request_id, [(p.index, word_of(p)) for p in parts]

    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(pool.map(read, texts))
    # Then each got exactly its own words, in order, once
    for n, (request_id, got) in enumerate(results):
        assert got == list(enumerate(texts[n], start=1)), request_id
    assert len({request_id for request_id, _ in results}) == len(texts)


def test_a_model_that_does_not_stream_is_one_part(client: Client) -> None:
    parts = list(client.stream("identity", {"x": np.array([[1.5, 2.5]], np.float32)}))
    assert [(p.index, p["x"].tolist()) for p in parts] == [(1, [[1.5, 2.5]])]
    # and read_stream of such a request (no stream at all) gives its stored answer
    future = client.submit("identity", {"x": np.array([[3.0]], np.float32)})
    future.result(timeout=30)
    assert [p["x"].tolist() for p in client.read_stream(future.id)] == [[[3.0]]]


def test_a_late_reader_and_a_resumed_reader_see_each_part_once(client: Client) -> None:
    words = [f"late{i}" for i in range(10)]
    with client.stream("echo-stream", text(words)) as parts:
        first_three = [next(parts) for _ in range(3)]
        request_id = parts.request_id
        # a second reader, after part 3 of the first, goes on from part 4
        rest = [(p.index, word_of(p)) for p in client.read_stream(request_id, after=3)]
        assert [(p.index, word_of(p)) for p in first_three] + rest == list(
            enumerate(words, start=1))
        assert [p.index for p in parts] == list(range(4, 11))
    # and one that comes after the end gets every part from the start
    assert [word_of(p) for p in client.read_stream(request_id)] == words


def test_astream_reads_in_order_and_a_cancelled_task_revokes(client: Client) -> None:
    words = [f"a{i}" for i in range(8)]

    async def scenario() -> tuple[list[tuple[int, str]], str]:
        got = [(p.index, word_of(p)) async for p in client.astream("echo-stream", text(words))]
        first = asyncio.Event()
        stream = client.astream("echo-stream", text(["c"], ENDLESS))

        async def consume() -> None:
            async for part in stream:
                if part.index == 2:
                    first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose()
        return got, stream.request_id

    got, cancelled_id = asyncio.run(scenario())
    assert got == list(enumerate(words, start=1))
    revoked_in_the_end(client, cancelled_id)


def test_astream_aclose_revokes(client: Client) -> None:
    async def scenario() -> str:
        async with client.astream("echo-stream", text(["d"], ENDLESS)) as stream:
            async for part in stream:
                assert part.index == 1
                break
        await client.aclose()
        return stream.request_id

    revoked_in_the_end(client, asyncio.run(scenario()))


def test_cli_infer_stream_prints_each_part_on_its_line(served: str, tmp_path) -> None:
    (tmp_path / "in.json").write_text(json.dumps({"text_input": ["hello streaming wörld"]}))
    argv = [sys.executable, "-m", "asyncinfer", "infer", "echo-stream", "--stream", "--input",
            str(tmp_path / "in.json")]
    out = subprocess.run(argv, env=worker_env(served), cwd=ROOT, capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ['1 text_output=[["hello"]]', '2 text_output=[["streaming"]]',
                                       '3 text_output=[["wörld"]]']
    out = subprocess.run([*argv, "--json"], env=worker_env(served), cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(d["index"], d["outputs"][0]["data"]) for d in lines] == [
        (1, ["hello"]), (2, ["streaming"]), (3, ["wörld"])]
    assert len({d["request_id"] for d in lines}) == 1
    assert lines[0]["outputs"][0] | {"data": None} == {"name": "text_output", "datatype": "BYTES",
                                                       "shape": [1, 1], "data": None}


@pytest.mark.timeout(240)
def test_a_worker_killed_mid_stream_is_reported_and_no_part_comes_twice(
        redis_db, tmp_path) -> None:
    # Given a worker streaming a long answer (its lease short, so its death shows soon)
    env = {"ASYNCINFER_LEASE_S": "3"}
    first = start_worker(redis_db.url, tmp_path / "first.log", "--device", "cpu", "--models",
                         "echo-stream", "--hostname", "stream-first@%h", **env)
    second = None
    words = [f"k{i}" for i in range(7)]
    count = 1500  # 15 s of steps at the least: the worker is killed long before the end
    expected = [words[i % len(words)] for i in range(count)]
    reported: list[Interruption] = []
    client = Client(broker_url=redis_db.url)
    try:
        got: list[tuple[int, str]] = []
        with client.stream("echo-stream", text(words, np.array([count], np.int32)),
                           on_interrupted=reported.append, check_s=0.2) as parts:
            for part in parts:
                got.append((part.index, word_of(part)))
                if part.index == 20 and second is None:
                    # When the worker is killed with SIGKILL mid-stream, and a new one starts
                    first.process.kill()
                    first.process.wait()
                    second = start_worker(redis_db.url, tmp_path / "second.log", "--device",
                                          "cpu", "--models", "echo-stream",
                                          "--hostname", "stream-second@%h", **env)
            # Then the stream went on to the end: every part once, in order
            assert got == list(enumerate(expected, start=1))
            assert parts.interruptions == reported
        # And the interruption was reported once, naming the first run
        assert len(reported) == 1, reported
        assert reported[0].worker.startswith("stream-first@")
        assert reported[0].after_part >= 20
        # And the one answer holds every part, joined
        answer = client.result(parts.request_id, timeout_s=60)["text_output"].tolist()
        assert answer == [" ".join(expected)]
    finally:
        client.close()
        first.stop()
        if second is not None:
            second.stop()

