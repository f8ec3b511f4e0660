"""The lost check's rules (client/lost_check.py) on fakeredis with a hand-driven clock, and the
publisher writing the trace in the same script as the push."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
import redis

from asyncinfer.broker.publisher import PUBLISHED, Publisher
from asyncinfer.client.lost_check import LostCheck, lost_error, trace_ttl_s
from asyncinfer.errors import AsyncInferError, RequestLost
from asyncinfer.wire.keys import CLAIM_PREFIX, TRACES_KEY
from tests.support.publishing import publish_one


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def r() -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis()
    yield client
    client.close()


def result_key(request_id: str) -> str:
    return "celery-task-meta-" + request_id


def make_check(r: Any, clock: Clock, lost_after_s: float = 10.0,
               ttl_s: float = 3600.0) -> LostCheck:
    return LostCheck(r, r, result_key, lost_after_s=lost_after_s, trace_ttl_s=ttl_s, clock=clock)


def look_every_period(check: LostCheck, clock: Clock, looks: int) -> list[str]:
    lost: list[str] = []
    for _ in range(looks):
        clock.now += check.period_s
        lost += check.look()
    return lost


def test_a_request_whose_trace_and_result_are_gone_is_lost_after_two_looks(r: redis.Redis) -> None:
    # Given a traced request whose trace the broker then lost
    clock = Clock()
    check = make_check(r, clock)
    r.set(CLAIM_PREFIX + "a", "infer.m")
    check.trace("a")
    assert look_every_period(check, clock, 1) == []
    r.delete(CLAIM_PREFIX + "a")
    # Then the first look that misses it only counts, the second declares it lost
    assert look_every_period(check, clock, 1) == []
    assert look_every_period(check, clock, 1) == ["a"]
    assert len(check) == 0 and look_every_period(check, clock, 3) == []


def test_a_generated_id_s_trace_is_its_field_of_the_traces_hash(r: redis.Redis) -> None:
    # Given a request with a generated ID, traced in the hash (its claim key never written)
    clock = Clock()
    check = make_check(r, clock)
    r.hset(TRACES_KEY, "g", "infer.m")
    check.trace("g")
    assert look_every_period(check, clock, 3) == []  # traced: never lost while it is there
    # When the broker loses the field (and no result was stored)
    r.hdel(TRACES_KEY, "g")
    # Then it is lost after two looks
    assert look_every_period(check, clock, 2) == ["g"]


def test_traced_or_finished_requests_are_never_lost(r: redis.Redis) -> None:
    clock = Clock()
    check = make_check(r, clock)
    r.set(CLAIM_PREFIX + "queued", "infer.m")
    r.set(CLAIM_PREFIX + "done", "infer.m")
    r.set(result_key("done"), b"{}")
    r.set(result_key("stored-no-trace"), b"{}")  # an expired trace beside a stored result
    for request_id in ("queued", "done", "stored-no-trace"):
        check.trace(request_id)
    assert look_every_period(check, clock, 20) == []
    assert len(check) == 3


def test_a_look_between_the_two_misses_that_finds_the_trace_starts_over(r: redis.Redis) -> None:
    clock = Clock()
    check = make_check(r, clock)
    check.trace("a")
    assert look_every_period(check, clock, 1) == []  # missing once
    r.set(CLAIM_PREFIX + "a", "infer.m")
    assert look_every_period(check, clock, 1) == []  # there again: the count starts over
    r.delete(CLAIM_PREFIX + "a")
    assert look_every_period(check, clock, 1) == []
    assert look_every_period(check, clock, 1) == ["a"]


def test_a_request_never_seen_with_a_trace_is_not_judged(r: redis.Redis) -> None:
    # Given an ID looked up by another producer's request: no trace at the first look
    clock = Clock()
    check = make_check(r, clock)
    check.trace("other", seen=False)
    r.set(CLAIM_PREFIX + "ours", "infer.m")
    check.trace("ours", seen=False)
    assert not check.judges("ours") and not check.judges("other")
    assert look_every_period(check, clock, 1) == []
    assert len(check) == 1  # "other" is left alone; "ours" was seen and is judged from now on
    assert check.judges("ours") and not check.judges("other")
    r.delete(CLAIM_PREFIX + "ours")
    assert look_every_period(check, clock, 2) == ["ours"]


def test_looks_that_fail_say_nothing(r: redis.Redis) -> None:
    class Down:
        def pipeline(self, transaction: bool = True) -> Any:
            raise redis.ConnectionError("restarting")

    clock = Clock()
    check = LostCheck(Down(), r, result_key, lost_after_s=10, trace_ttl_s=3600, clock=clock)
    check.trace("a")
    assert look_every_period(check, clock, 10) == [] and len(check) == 1


def test_a_request_waited_on_longer_than_its_trace_lives_is_no_longer_judged(r: redis.Redis) -> None:
    clock = Clock()
    check = make_check(r, clock, lost_after_s=10, ttl_s=60)
    check.trace("a")
    clock.now += 60
    assert look_every_period(check, clock, 3) == [] and len(check) == 0


def test_looks_come_every_half_bound_and_read_in_chunks(r: redis.Redis) -> None:
    clock = Clock()
    check = make_check(r, clock, lost_after_s=10)
    check.chunk = 7
    for i in range(20):
        r.set(CLAIM_PREFIX + str(i), "infer.m")
        check.trace(str(i))
    assert check.due_in_s() == 5.0 and check.look() == [] and check.looks == 0  # not due
    clock.now += 5
    assert check.look() == [] and check.looks == 1 and check.keys_read == 20
    assert check.due_in_s() == 5.0


def test_forgotten_requests_are_not_judged(r: redis.Redis) -> None:
    clock = Clock()
    check = make_check(r, clock)
    check.trace("a")
    check.forget("a")
    assert look_every_period(check, clock, 5) == []


def test_the_error_names_the_request_and_what_to_do() -> None:
    error = lost_error("req-1")
    assert isinstance(error, RequestLost) and isinstance(error, AsyncInferError)
    assert "request req-1" in str(error) and "same request_id ('req-1')" in str(error)


def test_the_trace_lives_as_long_as_a_result() -> None:
    assert trace_ttl_s(30, 3600) == 3600
    assert trace_ttl_s(30, 0) == 86400  # results that never expire: a day
    assert trace_ttl_s(0, 3600) == 0  # the check off: no trace


def test_the_publisher_writes_the_trace_with_the_push(r: redis.Redis) -> None:
    # Given a publisher that traces (the lost check on) and a generated request ID
    publisher = Publisher(r, claim_ttl_s=3600, mark_ttl_s=120)
    assert publish_one(publisher, "infer.m", "gen-1", "msg", claim=False) == PUBLISHED
    # Then the trace is there beside the message: a field of the traces hash, no key of its own
    assert r.hget(TRACES_KEY, "gen-1") == b"infer.m"
    assert not r.exists(CLAIM_PREFIX + "gen-1")
    assert r.lrange("infer.m", 0, -1) == [b"msg"]
    # and a caller-chosen ID keeps its claim's TTL (the result's expiry)
    assert publish_one(publisher, "infer.m", "mine", "msg2", claim=True) == PUBLISHED
    assert r.ttl(CLAIM_PREFIX + "mine") > 120


def test_without_the_check_a_generated_id_is_a_plain_push(r: redis.Redis) -> None:
    publisher = Publisher(r, claim_ttl_s=3600)
    assert publish_one(publisher, "infer.m", "gen-1", "msg", claim=False) == PUBLISHED
    assert r.get(CLAIM_PREFIX + "gen-1") is None and r.llen("infer.m") == 1


def test_the_gateway_answers_a_lost_request_with_503_unavailable() -> None:
    from asyncinfer.gateway.call_errors import error_for

    answer = error_for(lost_error("req-1"))
    assert answer.status == 503 and answer.grpc_code == "UNAVAILABLE"
    assert "req-1" in answer.message
