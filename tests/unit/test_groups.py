"""The grouping rules (client/grouped.py: Pending, Group) without a thread or a loop: one group's
pipeline on fakeredis, what each reply means for each request."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest

from asyncinfer.broker.publisher import _PUBLISH, PUBLISHED, Publisher
from asyncinfer.client.grouped import Entry, Group, Pending
from asyncinfer.constants import priority_list
from asyncinfer.errors import BrokerRefused, QueueFull

Told = list[tuple[str, int | None, BaseException | None]]


def _entries(publisher: Publisher, told: Told, ids: list[str], *, queue: str = "infer.m",
             bound: int = 0, timeout_s: float = 0.0) -> list[Entry]:
    def done(request_id: str) -> Any:
        return lambda status, error: told.append((request_id, status, error))

    return [Entry(publisher.prepare(queue, i, f"msg-{i}", claim=False, max_queue_size=bound,
                                    timeout_s=timeout_s), done(i)) for i in ids]


def _refused(request_id: str, exc: Exception) -> BrokerRefused:
    return BrokerRefused(f"request {request_id}: refused ({exc})")


@pytest.fixture()
def publisher() -> Publisher:
    client = fakeredis.FakeRedis()
    client.script_load(_PUBLISH)
    return Publisher(client, claim_ttl_s=60)


def test_pending_takes_each_queue_in_order_up_to_the_group_limit(publisher: Publisher) -> None:
    told: Told = []
    pending = Pending()
    pending.max_requests = 3
    for entry in (_entries(publisher, told, ["a1", "a2"], queue="infer.a")
                  + _entries(publisher, told, ["b1", "b2"], queue="infer.b")):
        pending.add(entry)
    first, _ = pending.take(now=0.0)
    second, wake_at = pending.take(now=0.0)
    assert [[e.push.request_id for e in q] for q in first] == [["a1", "a2"], ["b1"]]
    assert [[e.push.request_id for e in q] for q in second] == [["b2"]]
    assert wake_at is None and not pending


def test_a_queue_put_back_goes_first_and_waits_its_pause(publisher: Publisher) -> None:
    told: Told = []
    pending = Pending()
    a1, a2, a3 = _entries(publisher, told, ["a1", "a2", "a3"])
    pending.add(a3)
    pending.put_back([a1, a2], pause_s=60.0)
    taken, wake_at = pending.take(now=0.0 + 1.0)  # a monotonic clock well before the pause ends
    assert taken == [] and wake_at is not None and bool(pending)
    taken, _ = pending.take(now=wake_at)
    assert [e.push.request_id for e in taken[0]] == ["a1", "a2", "a3"]


def test_a_group_over_the_bound_sends_the_first_and_refuses_or_keeps_the_rest(
        publisher: Publisher) -> None:
    told: Told = []
    # Given four requests for a queue bounded at 2: the first two without a wait, two with one
    refused_now = _entries(publisher, told, ["r1", "r2", "r3"], bound=2)
    waiting = _entries(publisher, told, ["w1"], bound=2, timeout_s=30)
    group = Group([refused_now + waiting], publisher, _refused)
    group.read(group.fill(publisher.client.pipeline(transaction=False)).execute(
        raise_on_error=False))
    group.confirm()
    # Then two are pushed, in order; the third is refused naming the bound; the fourth goes back
    assert publisher.client.lrange("infer.m", 0, -1) == [b"msg-r2", b"msg-r1"]
    assert [(i, s) for i, s, _ in told] == [("r3", None), ("r1", PUBLISHED), ("r2", PUBLISHED)]
    assert isinstance(told[0][2], QueueFull) and "max_queue_size 2" in str(told[0][2])
    assert [([e.push.request_id for e in entries], pause_s > 0)
            for entries, pause_s in group.again] == [(["w1"], True)]


def test_redis_without_the_script_gets_its_text_in_the_next_group(publisher: Publisher) -> None:
    told: Told = []
    publisher.client.script_flush()
    group = Group([_entries(publisher, told, ["a1", "a2"], bound=5)], publisher, _refused)
    group.read(group.fill(publisher.client.pipeline(transaction=False)).execute(
        raise_on_error=False))
    assert group.script_lost and told == [] and publisher.client.llen("infer.m") == 0
    again = Group([group.again[0][0]], publisher, _refused, script_lost=True)
    again.read(again.fill(publisher.client.pipeline(transaction=False)).execute(
        raise_on_error=False))
    again.confirm()
    assert [(i, s) for i, s, _ in told] == [("a1", PUBLISHED), ("a2", PUBLISHED)]
    assert not again.script_lost


def test_an_error_reply_ends_every_request_of_that_call(publisher: Publisher) -> None:
    told: Told = []
    publisher.client.set("infer.m", "not a list")
    group = Group([_entries(publisher, told, ["a1", "a2"], bound=5)], publisher, _refused)
    group.read(group.fill(publisher.client.pipeline(transaction=False)).execute(
        raise_on_error=False))
    assert [i for i, _, _ in told] == ["a1", "a2"]
    for request_id, status, error in told:
        assert status is None and isinstance(error, BrokerRefused)
        assert str(error).startswith(f"request {request_id}: refused (")
        assert "WRONGTYPE" in str(error) or "wrong kind" in str(error).lower()


class _Recording:
    """A pipeline that records the commands queued on it."""

    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def lpush(self, key: str, *values: str) -> None:
        self.commands.append(("LPUSH", key, *values))

    def evalsha(self, *args: Any) -> None:
        self.commands.append(("EVALSHA", *args[:2]))

    def eval(self, *args: Any) -> None:
        self.commands.append(("EVAL", args[1]))


def test_with_nothing_to_check_a_group_is_one_push_per_priority_list(publisher: Publisher) -> None:
    def push(request_id: str, **options: Any) -> Entry:
        return Entry(publisher.prepare("infer.q", request_id, f"m-{request_id}", **options),
                     lambda status, error: None)

    plain = [push("r1", claim=False), push("r2", claim=False, priority=9),
             push("r3", claim=False)]
    pipe = _Recording()
    Group([plain], publisher, _refused).fill(pipe)
    assert pipe.commands == [("LPUSH", "infer.q", "m-r1", "m-r3"),
                             ("LPUSH", priority_list("infer.q", 9), "m-r2")]
    # a claim or a bound goes through the script, one call for the queue's requests
    checked = [push("r4", claim=True), push("r5", claim=False, max_queue_size=10)]
    pipe = _Recording()
    Group([checked], publisher, _refused).fill(pipe)
    assert [c[0] for c in pipe.commands] == ["EVALSHA"]
