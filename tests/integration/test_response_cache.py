"""The response cache (broker/response_cache.py) with a real worker on a database of its own: a repeated
request is answered without a device run, a one-bit change misses, a failure is never cached, the
TTL and the size bound hold, a request can bypass it. The test models mark each batch they run
(tests/support/marks.py): a hit leaves the marks as they were."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from celery.result import AsyncResult

from asyncinfer.broker.fleet_stats import FleetStats
from asyncinfer.broker.response_cache import cache_stats
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.wire.keys import RESPONSE_CACHE_PREFIX, response_cache_index_key
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.marks import FORWARD_MARKS_ENV, ForwardMarks
from tests.support.processes import WorkerProcess, start_gateway, start_worker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

MAX_ENTRIES = 3
OPTIONS = json.dumps({
    "poison": {"response_cache": True, "response_cache_max_entries": MAX_ENTRIES},
    "sleep": {"response_cache": True, "response_cache_ttl_s": 1}})


@pytest.fixture(scope="module")
def cached(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[RedisDatabase, WorkerProcess]]:
    with redis_databases.take("test_response_cache worker") as db:
        proc = start_worker(db.url, tmp_path_factory.mktemp("cache") / "worker.log",
                            "--device", "cpu", "--models", "poison,sleep",
                            ASYNCINFER_MODEL_OPTIONS=OPTIONS, ASYNCINFER_MAX_RETRIES="0",
                            **{FORWARD_MARKS_ENV: db.url})
        try:
            yield db, proc
        finally:
            proc.stop()


@pytest.fixture()
def client(cached: tuple[RedisDatabase, WorkerProcess]) -> Iterator[Client]:
    db, _ = cached
    with Client(settings=Settings(broker_url=db.url, model_options=OPTIONS,
                                  task_serializer="msgpack")) as c:
        yield c


def _entries(db: RedisDatabase, model: str) -> list[bytes]:
    return sorted(db.client.scan_iter(f"{RESPONSE_CACHE_PREFIX}entry:{model}:*"))


def _row(value: float) -> np.ndarray:
    return np.array([[value]], np.float32)


def test_a_repeated_request_is_answered_without_a_device_run(
        client: Client, cached: tuple[RedisDatabase, WorkerProcess]) -> None:
    db, _ = cached
    marks = ForwardMarks(db.client, "poison")
    before = cache_stats(db.client, "poison")
    # Given a request answered by the device,
    first = client.infer("poison", _row(1.5), timeout_s=30)
    assert len(marks.batches()) == 1
    # when the same request is sent again,
    second_future = client.submit("poison", _row(1.5))
    second = second_future.result(timeout=30)
    # then it is answered from the cache: the model did not run again,
    assert len(marks.batches()) == 1
    # with the same outputs, under its own ID, saying so,
    assert second.as_numpy("output").tolist() == first.as_numpy("output").tolist() == [[3.0]]
    assert second.as_numpy("output").dtype == np.float32
    assert second.raw["outputs"][0]["shape"] == [1, 1]
    assert second.raw["id"] == second_future.id != first.raw["id"]
    assert second.raw["parameters"]["cache_hit"] is True
    assert "cache_hit" not in first.raw["parameters"]
    # stored as any answer is (AsyncResult of the hit), and counted.
    stored = AsyncResult(second_future.id, app=client.app).get(timeout=10)
    assert stored["id"] == second_future.id and stored["outputs"] == second.raw["outputs"]
    after = cache_stats(db.client, "poison")
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (1, 1)
    # The fleet statistics (Triton's form) show the same counts; a hit is a success too
    stats = FleetStats(db.client).model_stats(model="poison")[0]["inference_stats"]
    assert (stats["cache_hit"]["count"], stats["cache_miss"]["count"]) == (
        after["hits"], after["misses"])
    assert stats["success"]["count"] >= after["hits"]


def test_a_one_bit_change_of_input_misses(
        client: Client, cached: tuple[RedisDatabase, WorkerProcess]) -> None:
    db, _ = cached
    marks = ForwardMarks(db.client, "poison")
    x = _row(2.25)
    flipped = x.view(np.uint32).copy()
    flipped ^= 1  # the lowest bit of the mantissa
    y = flipped.view(np.float32)
    assert x.tobytes() != y.tobytes()
    first = client.infer("poison", x, timeout_s=30)
    other = client.infer("poison", y, timeout_s=30)
    assert len(marks.batches()) == 2
    assert "cache_hit" not in other.raw["parameters"]
    assert other.as_numpy("output").tobytes() == (y * 2).tobytes() != first.as_numpy(
        "output").tobytes()


def _twice_uncached(db: RedisDatabase, send: Callable[[], None]) -> None:
    """``send`` a request twice: it runs on the device both times and leaves no cache entry."""
    marks = ForwardMarks(db.client, "poison")
    before = _entries(db, "poison")
    send()
    send()
    assert len(marks.batches()) == 2
    assert not [k for k in _entries(db, "poison") if k not in before]


def test_a_failed_request_is_not_cached(
        client: Client, cached: tuple[RedisDatabase, WorkerProcess]) -> None:
    def send() -> None:
        with pytest.raises(Exception, match="negative input"):
            client.infer("poison", _row(-7.0), timeout_s=30)

    _twice_uncached(cached[0], send)


def test_a_request_can_bypass_the_cache(
        client: Client, cached: tuple[RedisDatabase, WorkerProcess]) -> None:
    def send() -> None:
        answer = client.infer("poison", _row(4.5), parameters={"response_cache": False},
                              timeout_s=30)
        assert answer.as_numpy("output").tolist() == [[9.0]]

    _twice_uncached(cached[0], send)


def test_a_stored_value_that_is_no_template_is_a_miss(
        client: Client, cached: tuple[RedisDatabase, WorkerProcess]) -> None:
    db, _ = cached
    marks = ForwardMarks(db.client, "poison")
    before = _entries(db, "poison")
    client.infer("poison", _row(30.5), timeout_s=30)
    [entry] = [k for k in _entries(db, "poison") if k not in before]
    db.client.set(entry, "not a template")  # someone else's value under the cache's key
    answer = client.infer("poison", _row(30.5), timeout_s=30)
    assert answer.as_numpy("output").tolist() == [[61.0]] and len(marks.batches()) == 2


def test_the_size_bound_holds(client: Client, cached: tuple[RedisDatabase, WorkerProcess]) -> None:
    db, _ = cached
    marks = ForwardMarks(db.client, "poison")
    values = [10.0, 11.0, 12.0, 13.0, 14.0]
    for value in values:
        client.infer("poison", _row(value), timeout_s=30)
    # at most MAX_ENTRIES answers are kept: the newest
    assert len(_entries(db, "poison")) == MAX_ENTRIES
    assert db.client.zcard(response_cache_index_key("poison")) == MAX_ENTRIES
    client.infer("poison", _row(14.0), timeout_s=30)  # kept: a hit
    client.infer("poison", _row(10.0), timeout_s=30)  # trimmed: runs again
    assert [b for batch in marks.batches() for b in batch] == values + [10.0]


def test_an_answer_expires_after_its_ttl(
        client: Client, cached: tuple[RedisDatabase, WorkerProcess]) -> None:
    db, _ = cached
    marks = ForwardMarks(db.client, "sleep")
    client.infer("sleep", _row(0.001), timeout_s=30)
    [entry] = _entries(db, "sleep")
    assert 0 < db.client.pttl(entry) <= 1000
    hit = client.infer("sleep", _row(0.001), timeout_s=30)
    assert hit.raw["parameters"]["cache_hit"] is True and len(marks.batches()) == 1
    wait_for(lambda: not db.client.exists(entry), 10, "the cached answer to expire", poll_s=0.05)
    again = client.infer("sleep", _row(0.001), timeout_s=30)
    assert "cache_hit" not in again.raw["parameters"] and len(marks.batches()) == 2


def test_a_hit_through_the_gateway(cached: tuple[RedisDatabase, WorkerProcess],
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    import tritonclient.http as httpclient

    db, _ = cached
    gateway = start_gateway(db.url, tmp_path_factory.mktemp("cache-gateway") / "gateway.log",
                            ASYNCINFER_MODEL_OPTIONS=OPTIONS)
    http = httpclient.InferenceServerClient(gateway.http_url)
    try:
        marks = ForwardMarks(db.client, "poison")

        def infer(request_id: str) -> httpclient.InferResult:
            tensor = httpclient.InferInput("input", [1, 1], "FP32")
            tensor.set_data_from_numpy(_row(20.5), binary_data=True)
            return http.infer("poison", [tensor], request_id=request_id)

        first, second = infer("gw-1"), infer("gw-2")
        # the second is answered from the cache, under its own ID, with the same tensor
        assert len(marks.batches()) == 1
        assert second.get_response()["id"] == "gw-2"
        assert second.as_numpy("output").tolist() == first.as_numpy("output").tolist() == [[41.0]]
        assert second.as_numpy("output").dtype == np.float32
    finally:
        http.close()
        gateway.stop()
