"""A client far from Redis (a real Redis behind the bench's delay proxy) sends its requests in
groups (client/grouped.py) and keeps every promise of a submit: each request on its queue in the
order it was submitted, or its future ending with the error that says why."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from asyncinfer.bench.latency_proxy import LatencyProxy
from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import BrokerUnavailable, InvalidRequest, QueueFull
from asyncinfer.keys import CLAIM_PREFIX
from tests.support.databases import RedisDatabase

pytestmark = pytest.mark.timeout(120)

X = np.zeros((1, 4), np.float32)
#: Round trip through the proxy (ms): long enough that requests pile up behind each one.
RTT_MS = 20.0


@pytest.fixture()
def far(redis_db: RedisDatabase) -> Iterator[LatencyProxy]:
    """The test's database, a ``RTT_MS`` round trip away."""
    with LatencyProxy(redis_db.url, RTT_MS) as proxy:
        yield proxy


def _client(url: str, **options: object) -> Client:
    return Client(settings=Settings(broker_url=url, model_retention_s=0, **options))


def _queued_ids(db: RedisDatabase, queue: str) -> list[str]:
    """The request IDs on ``queue``, first to be taken first (consumers pop from the tail)."""
    return [_id_of(m) for m in reversed(db.client.lrange(queue, 0, -1))]


def _id_of(message: bytes) -> str:
    """The request ID in a queued message (kombu's envelope: its ``headers.id``)."""
    return str(json.loads(message)["headers"]["id"])


def _evalsha_calls(db: RedisDatabase) -> int:
    return int(db.client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def test_requests_far_from_redis_go_in_groups_in_submit_order(
        redis_db: RedisDatabase, far: LatencyProxy) -> None:
    # Given a client 20 ms from Redis
    client = _client(far.url)
    try:
        before = _evalsha_calls(redis_db)
        # When one thread submits 300 requests at once and waits until each is sent
        futures = [client.submit("m", X) for _ in range(300)]
        for future in futures:
            assert future.sent(timeout_s=60) is future
        # Then every one is on the queue once, in the order submitted
        assert _queued_ids(redis_db, "infer.m") == [f.id for f in futures]
        # in a few groups (one script call each), not one round trip per request
        assert 1 <= _evalsha_calls(redis_db) - before <= 30
        # each traced for the lost check, as a request sent alone is
        assert redis_db.client.get(CLAIM_PREFIX + futures[-1].id) == b"infer.m"
    finally:
        client.close()


def test_close_sends_what_is_still_pending(redis_db: RedisDatabase, far: LatencyProxy) -> None:
    client = _client(far.url)
    futures = [client.submit("m", X) for _ in range(200)]
    client.close()  # at once: most are still waiting for their group
    assert _queued_ids(redis_db, "infer.m") == [f.id for f in futures]
    assert all(f.sent(timeout_s=0) is f for f in futures)


def test_an_id_sent_twice_in_one_group_is_sent_once_and_another_model_is_refused(
        redis_db: RedisDatabase, far: LatencyProxy) -> None:
    client = _client(far.url)
    try:
        # Given the same caller-chosen ID three times in one burst, the third for another model
        first = client.submit("m", X, request_id="dup-1")
        second = client.submit("m", X, request_id="dup-1")
        other = client.submit("other", X, request_id="dup-1")
        plain = client.submit("m", X)
        # Then the first two are sent (as one request), the third refused naming the rule
        assert first.sent(timeout_s=30) is first and second.sent(timeout_s=30) is second
        with pytest.raises(InvalidRequest, match=r"request dup-1: this request ID was already sent "
                                                 r"to queue infer.m"):
            other.sent(timeout_s=30)
        with pytest.raises(InvalidRequest, match="request dup-1"):
            other.result(timeout=1)  # the future's outcome too
        assert _queued_ids(redis_db, "infer.m") == ["dup-1", plain.sent(timeout_s=30).id]
        assert redis_db.client.llen("infer.other") == 0
        assert redis_db.client.get(CLAIM_PREFIX + "dup-1") == b"infer.m"
    finally:
        client.close()


def test_a_full_queue_refuses_through_the_future_and_keeps_the_first(
        redis_db: RedisDatabase, far: LatencyProxy) -> None:
    # Given a bound of 5 on model m, and no wait for room
    client = _client(far.url, model_options='{"m": {"max_queue_size": 5}}')
    try:
        # When 8 requests are submitted in one burst
        futures = [client.submit("m", X) for _ in range(8)]
        # Then the first five are queued, in order, and the last three refused, each naming itself
        # and the bound, through sent() and result() alike
        for future in futures[:5]:
            assert future.sent(timeout_s=30) is future
        for future in futures[5:]:
            with pytest.raises(QueueFull, match=rf"request {future.id}: queue infer.m holds 5 "
                                                rf"requests.*max_queue_size 5"):
                future.sent(timeout_s=30)
            assert isinstance(future.exception(timeout=1), QueueFull)
        assert _queued_ids(redis_db, "infer.m") == [f.id for f in futures[:5]]
    finally:
        client.close()


def test_requests_waiting_for_room_keep_their_order(redis_db: RedisDatabase,
                                                    far: LatencyProxy) -> None:
    # Given a bound of 2 and a wait for room of 60 s
    client = _client(far.url, model_options='{"m": {"max_queue_size": 2}}')
    taken: list[str] = []
    stop = threading.Event()

    def consume() -> None:  # a slow consumer: one request at a time, from the tail
        while not stop.is_set() and len(taken) < 8:
            item = redis_db.client.brpop(["infer.m"], timeout=1)
            if item is not None:
                taken.append(_id_of(item[1]))
                stop.wait(0.03)

    try:
        # When 8 requests are submitted at once, more than the queue holds
        futures = [client.submit("m", X, timeout_s=60) for _ in range(8)]
        consumer = threading.Thread(target=consume)
        consumer.start()
        # Then each is sent once there is room, and they are taken in the order submitted
        for future in futures:
            assert future.sent(timeout_s=60) is future
        consumer.join(30)
        assert taken == [f.id for f in futures]
    finally:
        stop.set()
        client.close()


def test_redis_going_away_mid_group_ends_every_unsent_future(
        redis_db: RedisDatabase, far: LatencyProxy) -> None:
    # Given a client that reaches Redis only through the proxy, 20 ms away
    client = _client(far.url)
    try:
        # When 400 requests are submitted, and the proxy dies once the first group is back
        futures = [client.submit("m", X) for _ in range(400)]
        futures[0].sent(timeout_s=30)
        far.stop()
        # Then every future hears: sent, or BrokerUnavailable naming its request; none hangs
        sent, failed = [], []
        for future in futures:
            try:
                sent.append(future.sent(timeout_s=60).id)
            except BrokerUnavailable as exc:
                assert f"request {future.id}: broker unreachable" in str(exc)
                failed.append(future.id)
        assert failed, "the group in flight when Redis went away was not reported"
        # and each one reported sent is on the queue (Redis itself stayed up), in order
        queued = _queued_ids(redis_db, "infer.m")
        assert [i for i in queued if i in set(sent)] == sent
        assert set(queued) <= set(sent) | set(failed)
        assert len(sent) + len(failed) == 400
    finally:
        client.close()
