"""The atomic take: messages leave their queue only into kombu's unacknowledged bookkeeping, in a
form kombu itself restores."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis

from asyncinfer.celery_app import create_app
from asyncinfer.celery_wire import UNACKED_INDEX_KEY, UNACKED_KEY, task_message
from asyncinfer.config.settings import Settings
from asyncinfer.constants import PRIORITY_SEP, priority_lists
from asyncinfer.workers.take import Taker
from tests.conftest import url_with_db


@pytest.fixture()
def broker(redis_url: str) -> Iterator[tuple[str, redis.Redis]]:
    url = url_with_db(redis_url, 15)
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url, client
    client.flushdb()
    client.close()


def _message(request_id: str, queue: str) -> str:
    return task_message("asyncinfer.infer", request_id, {"model": "m", "inputs": []}, queue)


def test_take_pops_in_priority_order_and_records_each_message(broker) -> None:
    _, r = broker
    queue = "infer.m"
    lists = priority_lists([queue])
    for i in range(3):
        r.lpush(queue, _message(f"base-{i}", queue))
    r.lpush(f"{queue}{PRIORITY_SEP}3", _message("urgent", queue))
    r.lpush(queue, b"{not a kombu envelope")

    taken = Taker(r).take(lists, 3)

    # kombu serves the step-0 list first, oldest first; three at most
    ids = [json.loads(raw)["headers"]["id"] for _, raw in taken]
    assert ids == ["base-0", "base-1", "base-2"] and {k for k, _ in taken} == {queue}
    for _, raw in taken:
        tag = json.loads(raw)["properties"]["delivery_tag"]
        envelope, exchange, routing_key = json.loads(r.hget(UNACKED_KEY, tag))
        assert envelope == json.loads(raw) and (exchange, routing_key) == ("", queue)
        assert r.zscore(UNACKED_INDEX_KEY, tag) == pytest.approx(time.time(), abs=60)
    rest = Taker(r).take(lists, 10)
    assert [k for k, _ in rest] == [queue, f"{queue}{PRIORITY_SEP}3"]
    assert rest[0][1] == b"{not a kombu envelope"  # popped, answered by the consumer, not recorded
    assert r.hlen(UNACKED_KEY) == 4 and not any(r.llen(k) for k in lists)


def test_kombu_restores_what_the_take_recorded(broker) -> None:
    url, r = broker
    queue = "infer.m"
    original = _message("restore-me", queue)
    r.lpush(queue, original)
    [(_, raw)] = Taker(r).take(priority_lists([queue]), 5)
    assert r.llen(queue) == 0

    # A worker died holding it: kombu's own sweep (visibility timeout 0) puts it back.
    app = create_app(Settings(broker_url=url, visibility_timeout_s=0.0))
    with app.connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=10)
    [back] = r.lrange(queue, 0, -1)
    restored = json.loads(back)
    assert restored["headers"]["id"] == "restore-me" and restored["headers"]["redelivered"] is True
    assert restored["body"] == json.loads(original)["body"]
    assert r.hlen(UNACKED_KEY) == 0 and r.zcard(UNACKED_INDEX_KEY) == 0
