"""The reply channel against a real Redis and the session worker: a request the client sent costs
no subscription of its own; one another producer sent is watched on its own channel; a result
stored without an announcement is still found, and the watcher then falls back; a cut pub/sub
connection loses nothing."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
from celery import states

from asyncinfer.client import Client
from tests.support.processes import WorkerProcess
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture()
def quiet_client(redis_url: str, worker: WorkerProcess) -> Iterator[Client]:
    """A client whose watcher never looks a request up: it hears announcements or nothing."""
    c = Client(broker_url=redis_url)
    c.watcher.sweep_first_s = 3600.0
    try:
        yield c
    finally:
        c.close()


def _subscribers(r: redis.Redis, channel: str) -> int:
    return int(dict(r.pubsub_numsub(channel))[channel.encode()])


def test_a_request_the_client_sent_costs_no_subscription_of_its_own(
        quiet_client: Client, redis_client: redis.Redis) -> None:
    # Given a request that runs for a while (sleep 0.75 s)
    future = quiet_client.submit("sleep", np.array([[0.75]], np.float32))
    # While it runs, only the client's reply channel is subscribed, not the request's own channel
    key = quiet_client.watcher.key(future.id)
    wait_for(lambda: _subscribers(redis_client, quiet_client.watcher.channel) == 1, 10,
             "the reply channel's subscription")
    assert _subscribers(redis_client, key) == 0
    # And its result arrives through the reply channel
    assert future.result(timeout=30)["output"].tolist() == [[0.75]]
    # And so do 200 more, each with its own rows
    xs = np.random.default_rng(3).standard_normal((200, 1, 16)).astype(np.float32)
    futures = [quiet_client.submit("identity", x) for x in xs]
    for x, f in zip(xs, futures, strict=True):
        np.testing.assert_array_equal(f.result(timeout=60)["input"], x)
    assert not quiet_client.watcher._keyed and quiet_client.watcher._fallback_until == 0.0


def test_a_request_another_producer_sent_is_watched_on_its_own_channel(
        redis_url: str, quiet_client: Client, redis_client: redis.Redis) -> None:
    # Given a request sent by one client, and another client that waits for it by ID or sends
    # the same ID again (a duplicate: not sent twice)
    request_id = f"shared-{uuid.uuid4()}"
    first = quiet_client.submit("sleep", np.array([[0.75]], np.float32), request_id=request_id)
    other = Client(broker_url=redis_url)
    other.watcher.sweep_first_s = 3600.0
    try:
        by_id = other.future(request_id)
        again = other.submit("sleep", np.array([[0.75]], np.float32), request_id=request_id)
        # Then the other client subscribes to the request's own channel
        wait_for(lambda: _subscribers(redis_client, other.watcher.key(request_id)) == 1, 10,
                 "the request's own channel subscribed")
        # And all three hear the one result
        for future in (first, by_id, again):
            assert future.result(timeout=30)["output"].tolist() == [[0.75]]
    finally:
        other.close()


def test_a_result_stored_without_an_announcement_is_found_and_the_watcher_falls_back(
        redis_url: str, worker: WorkerProcess, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncinfer.client.result_watcher")
    c = Client(broker_url=redis_url)
    c.watcher.sweep_first_s = 0.2
    # (a result counts as late 3 s after it was stored, not 1 s: a loaded host may look up late)
    c.watcher.late_s = 3.0
    try:
        backend = c.app.backend
        # Given a result stored just now by something that does not announce it: it is found by
        # the first look-up, and, being fresh, is no sign of a missing announcement
        fresh, heard = f"fresh-{uuid.uuid4()}", []
        c.watcher.watch(fresh, heard.append, announced=True)
        backend.store_result(fresh, {"fresh": True}, states.SUCCESS)
        wait_for(lambda: bool(heard), 10, "the fresh result found by a look-up")
        assert heard[0]["result"] == {"fresh": True}
        assert c.watcher._fallback_until == 0.0
        # Given a result stored 3.5 s before it is looked up: its announcement should have come
        stale = f"stale-{uuid.uuid4()}"
        backend.store_result(stale, {"stale": True}, states.SUCCESS)
        time.sleep(3.5)
        c.watcher.watch(stale, heard.append, announced=True)
        wait_for(lambda: len(heard) == 2, 10, "the stale result found by a look-up")
        assert heard[1]["result"] == {"stale": True}
        # Then the watcher says so once and watches new requests on their own channels a while
        assert c.watcher._fallback_until > time.monotonic() + 50
        said = [r.getMessage() for r in caplog.records if "not announced" in r.getMessage()]
        assert len(said) == 1 and stale in said[0], said
        future = c.submit("identity", np.ones((1, 2), np.float32))
        assert future.id in c.watcher._keyed
        assert future.result(timeout=30)["input"].tolist() == [[1.0, 1.0]]
    finally:
        c.close()


def test_a_result_stored_unheard_after_its_key_was_read_is_found_by_a_look_up(
        redis_url: str, worker: WorkerProcess, redis_client: redis.Redis) -> None:
    # Given a request watched by ID on its own channel: its key read (nothing there yet) and
    # its channel subscribed
    c = Client(broker_url=redis_url)
    c.watcher.sweep_first_s = 0.2
    try:
        request_id, heard = f"unheard-{uuid.uuid4()}", []
        c.watcher.watch(request_id, heard.append)
        key = c.watcher.key(request_id)
        wait_for(lambda: _subscribers(redis_client, key) == 1, 10, "its channel subscribed")
        # When its result is stored and its announcement missed (as when Redis ran the read
        # after the store and the subscription after the publish: two connections, no order)
        meta = {"status": states.SUCCESS, "result": {"late": True}, "task_id": request_id,
                "date_done": "2026-01-01T00:00:00+00:00"}
        redis_client.set(key, c.app.backend.encode(meta))
        # Then a look-up finds it, and a result never announced on the reply channel is no
        # sign of an older worker (the watcher does not fall back)
        wait_for(lambda: bool(heard), 10, "the result found by a look-up")
        assert heard[0]["result"] == {"late": True}
        assert c.watcher._fallback_until == 0.0
    finally:
        c.close()


def test_a_cut_pub_sub_connection_loses_no_result(
        quiet_client: Client, redis_client: redis.Redis) -> None:
    # Given requests running while the watcher's pub/sub connection is cut twice
    futures = [quiet_client.submit("sleep", np.array([[t]], np.float32)) for t in (0.25, 0.5, 1.0)]
    cut: list[int] = []

    def new_connection_port() -> int | None:
        pubsub = quiet_client.watcher._pubsub
        sock = None if pubsub is None or pubsub.connection is None else pubsub.connection._sock
        try:
            port = None if sock is None else int(sock.getsockname()[1])
        except OSError:  # closed as we looked
            return None
        return port if port not in cut else None

    for _ in range(2):
        port = wait_for(new_connection_port, 10, "a pub/sub connection not yet cut")
        assert redis_client.client_kill_filter(_type=None, addr=f"127.0.0.1:{port}") == 1
        cut.append(port)
    # Then every result still arrives (the reconnect reads every watched key again)
    assert [f.result(timeout=30)["output"].tolist() for f in futures] == [[[0.25]], [[0.5]], [[1.0]]]


def test_results_of_many_threads_each_reach_their_own_future(quiet_client: Client) -> None:
    # Given eight threads submitting at once through one client
    results: dict[int, Any] = {}

    def send(n: int) -> None:
        results[n] = [quiet_client.infer("identity", np.full((1, 3), n * 100 + i, np.float32),
                                         timeout_s=60)["input"].tolist() for i in range(25)]

    threads = [threading.Thread(target=send, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    # Then each got its own rows back
    assert results == {n: [[[float(n * 100 + i)] * 3] for i in range(25)] for n in range(8)}
