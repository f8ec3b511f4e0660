"""The result watcher's reading of pub/sub messages already in the connection's hiredis reader
(client/pubsub_reader.py ``buffered_message``), against a real Redis: a burst of messages comes
out whole and in order, mixed with what redis-py reads itself, and a subscribe confirmation
read there keeps redis-py's record of the subscriptions."""

from __future__ import annotations

import select

import pytest
import redis

from asyncinfer.client.pubsub_reader import buffered_message
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


def _drain(pubsub: redis.client.PubSub, want: int) -> list[tuple[bytes, bytes]]:
    """Read as the watcher reads: buffered messages first, redis-py's get_message otherwise."""
    got: list[tuple[bytes, bytes]] = []
    while len(got) < want:
        channel, data = buffered_message(pubsub)
        if channel is None:
            select.select([pubsub.connection._sock], [], [], 5)
            message = pubsub.get_message(timeout=5)
            if message is None or message["type"] != "message":
                continue
            channel, data = message["channel"], message["data"]
        got.append((channel, data))
    return got


def test_a_burst_comes_out_whole_and_in_order(redis_url: str, redis_client: redis.Redis) -> None:
    pubsub = redis.Redis.from_url(redis_url).pubsub()
    try:
        pubsub.subscribe("burst-a")
        wait_for(lambda: pubsub.get_message(timeout=1) is not None, 10, "subscribed")
        assert isinstance(pubsub.connection._parser, redis._parsers.hiredis._HiredisParser)
        sent = [(b"burst-a", f"payload {i} ".encode() * (1 + i % 50)) for i in range(300)]
        pipe = redis_client.pipeline(transaction=False)
        for channel, data in sent:
            pipe.publish(channel, data)
        pipe.execute()
        assert _drain(pubsub, len(sent)) == sent
    finally:
        pubsub.close()


def test_a_subscribe_confirmation_read_there_is_recorded(redis_url: str,
                                                        redis_client: redis.Redis) -> None:
    pubsub = redis.Redis.from_url(redis_url).pubsub()
    try:
        pubsub.subscribe("burst-b")
        wait_for(lambda: pubsub.get_message(timeout=1) is not None, 10, "subscribed")
        redis_client.publish("burst-b", b"before")
        pubsub.subscribe("burst-c")  # its confirmation lands behind the first message
        redis_client.publish("burst-c", b"after")
        assert _drain(pubsub, 2) == [(b"burst-b", b"before"), (b"burst-c", b"after")]
        assert set(pubsub.channels) == {b"burst-b", b"burst-c"}
        pubsub.unsubscribe("burst-b")
        redis_client.publish("burst-c", b"later")
        assert _drain(pubsub, 1) == [(b"burst-c", b"later")]
        wait_for(lambda: (buffered_message(pubsub), pubsub.get_message(timeout=0.1),
                          set(pubsub.channels))[2] == {b"burst-c"}, 10, "the unsubscribe recorded")
    finally:
        pubsub.close()
