"""Priorities that cut the line, on a real worker and a real Redis, on the fast consumer and on
Celery's: a priority-0 request sent behind 2,000 queued priority-9 ones starts within a batch or
two (the batcher leads each batch with the best level it holds), a level's own bound refuses
with QueueFull, and the lowest level still progresses under a stream of higher ones (the
batcher's ``max_priority_wait_s``)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME, priority_list
from asyncinfer.errors import QueueFull
from tests.support.databases import RedisDatabases
from tests.support.marks import FORWARD_MARKS_ENV, ForwardMarks
from tests.support.processes import start_worker

MAX_BATCH = 8
LOW_S, HIGH_S = 0.005, 0.02  # what a low / the high request's batch sleeps: tells them apart
OPTIONS = {"sleep": {"max_batch_size": MAX_BATCH, "max_delay_ms": 0, "max_priority_passes": 4},
           "unserved": {"priority_queue_policy": {"6": {"max_queue_size": 3},
                                                  "9": {"default_timeout_s": 30}}}}


def _rows(value: float, count: int = 1) -> np.ndarray:
    return np.full((count, 1), value, np.float32)


def _is(row: float, value: float) -> bool:
    return abs(row - value) < 1e-6


@pytest.fixture(scope="module", params=["fast", "celery"])
def served(request: pytest.FixtureRequest, redis_databases: RedisDatabases,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    consumer = request.param
    with redis_databases.take(f"priorities-{consumer}") as db:
        # the fast consumer holds seconds of device work (the backlog in its batcher, not in
        # Redis); Celery's, its prefetch window (concurrency × multiplier: 128)
        holding = ({"ASYNCINFER_HOLD_S": "5"} if consumer == "fast"
                   else {"ASYNCINFER_CONCURRENCY": "32", "ASYNCINFER_PREFETCH_MULTIPLIER": "4"})
        proc = start_worker(db.url, tmp_path_factory.mktemp(consumer) / "worker.log",
                            "--device", "cpu", "--models", "sleep",
                            "--hostname", f"priorities-{consumer}@%h",
                            ASYNCINFER_CONSUMER=consumer, **holding,
                            ASYNCINFER_MODEL_OPTIONS=json.dumps(OPTIONS),
                            **{FORWARD_MARKS_ENV: db.url})
        try:
            yield consumer, db.url
        finally:
            proc.stop()


def _client(url: str) -> Client:
    return Client(settings=Settings(broker_url=url, model_options=json.dumps(OPTIONS)))


def test_a_high_priority_request_behind_2000_low_ones_starts_within_a_batch_or_two(
        served: tuple[str, str]) -> None:
    consumer, url = served
    r = redis.Redis.from_url(url)
    with _client(url) as client:
        marks = ForwardMarks(r, "sleep")
        started = time.perf_counter()
        lows = [client.submit("sleep", _rows(LOW_S), priority=9) for _ in range(2000)]
        for future in lows:
            future.sent()
        # the backlog is on the device's way: a few low batches have run
        wait = time.monotonic() + 60
        while len(marks.batches()) < 5 and time.monotonic() < wait:
            time.sleep(0.01)
        since = ForwardMarks(r, "sleep")
        sent_at = time.perf_counter()
        high = client.submit("sleep", _rows(HIGH_S), priority=0)
        assert high.result(timeout=120)["output"].tolist() == [[pytest.approx(HIGH_S)]]
        waited_s = time.perf_counter() - sent_at
        for future in lows:
            assert future.result(timeout=300)["output"].tolist() == [[pytest.approx(LOW_S)]]
        batch_s = (time.perf_counter() - started) / max(1, len(marks.batches()))
    batches = since.batches()
    first = next(i for i, rows in enumerate(batches) if any(_is(v, HIGH_S) for v in rows))
    low_rows_before = sum(len(rows) for rows in batches[:first])
    low_rows_after = sum(len(rows) for rows in batches[first + 1:])
    # Then it started within the batches already formed when it came (the one on the device, one
    # the batcher may have handed out), not behind the low requests the worker held: the fast
    # consumer's seconds of device work, Celery's prefetch window of 128 (an acknowledgement wakes
    # kombu's loop, which takes it first, and hands what one take popped over at once). Celery's
    # a batch more: its take waits for the acknowledgement of a batch the writer stores.
    ahead = 2 * MAX_BATCH if consumer == "fast" else 3 * MAX_BATCH
    assert low_rows_before <= ahead, (low_rows_before, [len(b) for b in batches[:first]])
    assert low_rows_after > 500  # the low backlog it cut in front of
    all_batches = marks.batches()
    print(f"\n[{consumer}] high request: {first} batch(es), {low_rows_before} low rows before it, "
          f"{low_rows_after} after it; waited {waited_s * 1000:.1f} ms; batch time "
          f"{batch_s * 1000:.1f} ms ({len(all_batches)} batches for 2001 requests, median rows "
          f"{statistics.median(len(b) for b in all_batches)})")


def test_the_lowest_level_progresses_under_a_stream_of_higher_ones(
        served: tuple[str, str]) -> None:
    consumer, url = served
    stop = threading.Event()
    highs: list[Any] = []
    # priority-0 requests kept unanswered: the worker always holds more than a batch, and all of
    # them (within Celery's prefetch window: in Redis both consumers take strictly by level)
    backlog = 100
    with _client(url) as client:

        def stream() -> None:  # tops the backlog up until told, or for 60 s at most
            ends = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < ends:
                waiting = sum(1 for f in highs[-2 * backlog:] if not f.done())
                # batches of 20 ms: 400 rows/s, a pace one submitting thread keeps ahead of on a
                # loaded host (at 5 ms the stream ran dry under load)
                highs.extend(client.submit("sleep", _rows(HIGH_S), priority=0)
                             for _ in range(backlog - waiting))
                time.sleep(0.01)

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        try:
            time.sleep(0.5)  # the stream is under way
            # how many priority-0 requests wait at the moment each low one is answered (counted
            # in the answer's callback: the main thread, woken later on a loaded host, saw the
            # stream's backlog answered meanwhile)
            waiting_at: list[int] = []
            lows = [client.submit("sleep", _rows(HIGH_S), priority=9) for _ in range(4)]
            for future in lows:
                future.add_done_callback(
                    lambda _: waiting_at.append(sum(1 for f in list(highs) if not f.done())))
            for future in lows:
                assert future.result(timeout=90)["output"].tolist() == [[pytest.approx(HIGH_S)]]
            still_streaming = streamer.is_alive()
            wait_until = time.monotonic() + 5
            while len(waiting_at) < len(lows) and time.monotonic() < wait_until:
                time.sleep(0.01)
        finally:
            stop.set()
            streamer.join(timeout=30)
        for future in highs:
            future.result(timeout=300)
    # Then the low ones finished while the stream went on, priority-0 requests still waiting
    # (more than a batch of them: a low one did not only share the stream's last batch)
    assert still_streaming
    assert len(waiting_at) == len(lows) and max(waiting_at) > MAX_BATCH, waiting_at
    print(f"\n[{consumer}] low requests done with {waiting_at} priority-0 requests waiting, "
          f"{len(highs)} sent in all")


def test_a_level_over_its_bound_refuses_with_queue_full_and_its_default_timeout_is_the_expiry(
        served: tuple[str, str]) -> None:
    consumer, url = served
    r = redis.Redis.from_url(url)
    queue = "infer.unserved"  # nothing takes from it: the level fills
    kwargs: dict[str, Any] = {"model": "unserved", "inputs": []}
    with _client(url) as client:
        try:
            for _ in range(3):
                client.send(TASK_NAME, queue, kwargs, priority=7, timeout_s=0).sent()
            with pytest.raises(QueueFull, match="priority level 6 of queue infer.unserved holds 3"):
                client.send(TASK_NAME, queue, kwargs, priority=8, timeout_s=0).sent()
            client.send(TASK_NAME, queue, kwargs, priority=0, timeout_s=0).sent()  # level 0: open
            assert r.llen(priority_list(queue, 6)) == 3 and r.llen(queue) == 1
            submitted = client.sender.submission("unserved", _rows(1.0), check=False, priority=9)
            assert submitted.expires == 30
        finally:
            r.delete(queue, *(priority_list(queue, p) for p in (3, 6, 9)))
