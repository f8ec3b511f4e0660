"""A group's commands on one pooled connection, replies in order (broker/direct_pipeline.py),
against a real Redis: what redis-py's pipeline answers, a refused command's error in its place,
a dead connection raised and never reused."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from asyncinfer.broker.connections import redis_client
from asyncinfer.broker.direct_pipeline import DirectPipeline, direct_pipeline
from asyncinfer.ops.redis_server import free_port
from tests.support.databases import RedisDatabase

SCRIPT = "redis.call('LPUSH', KEYS[1], ARGV[1]); return {1, redis.call('LLEN', KEYS[1])}"


def _fill(pipe: object, sha: str) -> None:
    pipe.evalsha(sha, 1, "q", "a")  # type: ignore[attr-defined]
    pipe.lpush("q", "b", "c")  # type: ignore[attr-defined]
    pipe.lpush("text", "x")  # type: ignore[attr-defined]  # a string key: WRONGTYPE
    pipe.evalsha("0" * 40, 1, "q", "d")  # type: ignore[attr-defined]  # no such script
    pipe.eval(SCRIPT, 1, "q", "e")  # type: ignore[attr-defined]


def _shown(replies: list[object]) -> list[object]:
    return [type(r).__name__ if isinstance(r, Exception) else r for r in replies]


def test_it_answers_as_redis_pys_pipeline_with_each_refusal_in_its_place(redis_db: RedisDatabase) -> None:
    client = redis_client(redis_db.url)
    sha = client.script_load(SCRIPT)
    answers = []
    for pipe in (client.pipeline(transaction=False), direct_pipeline(client)):
        client.delete("q")
        client.set("text", "t")
        _fill(pipe, sha)
        answers.append(_shown(pipe.execute(raise_on_error=False)))
        assert client.lrange("q", 0, -1) == [b"e", b"c", b"b", b"a"]
    assert isinstance(direct_pipeline(client), DirectPipeline)
    assert answers[1] == answers[0] == [[1, 1], 3, "ResponseError", "NoScriptError", [1, 4]]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        pipe = direct_pipeline(client)
        pipe.lpush("text", "y")
        pipe.execute(raise_on_error=True)
    # the connection went back to the pool in order: the next command reads its own reply
    assert client.ping() is True and client.get("text") == b"t"
    client.close()


def test_a_dead_connection_is_raised_and_closed(redis_db: RedisDatabase) -> None:
    client = redis_client(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    pipe = direct_pipeline(client)
    pipe.lpush("q", "a")
    with pytest.raises(redis.ConnectionError):
        pipe.execute()
    assert DirectPipeline(client.connection_pool).execute() == []  # nothing queued: no connection


def test_a_single_connection_client_or_a_test_double_keeps_its_own_pipeline(
        redis_db: RedisDatabase) -> None:
    single = redis_client(redis_db.url, single_connection_client=True)
    fake = fakeredis.FakeRedis()
    assert not isinstance(direct_pipeline(single), DirectPipeline)
    assert not isinstance(direct_pipeline(fake), DirectPipeline)
    single.close()
