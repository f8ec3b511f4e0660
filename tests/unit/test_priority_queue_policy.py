"""Per-priority queue policy (config/priority_policy.py): the option checked, a level's own bound
enforced by the publish script on that level's list (fakeredis), its default timeout the
request's expiry."""

from __future__ import annotations

from typing import Any

import fakeredis
import pytest

from asyncinfer.broker.publisher import _PUBLISH, PUBLISHED, Publisher
from asyncinfer.client.grouped import Entry, Group, Pending
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.config.priority_policy import LevelPolicy
from asyncinfer.constants import level_of, priority_list
from asyncinfer.errors import BrokerRefused, QueueFull

Told = list[tuple[str, int | None, BaseException | None]]


@pytest.fixture()
def publisher() -> Publisher:
    client = fakeredis.FakeRedis()
    client.script_load(_PUBLISH)
    return Publisher(client, claim_ttl_s=60)


def _entry(publisher: Publisher, told: Told, request_id: str, priority: int,
           level_bound: int = 0, timeout_s: float = 0.0) -> Entry:
    push = publisher.prepare("infer.m", request_id, f"msg-{request_id}", claim=False,
                             priority=priority, level_max_queue_size=level_bound,
                             timeout_s=timeout_s)
    return Entry(push, lambda status, error: told.append((request_id, status, error)))


def _send(publisher: Publisher, entries: list[Entry]) -> Group:
    pending = Pending()
    for entry in entries:
        pending.add(entry)
    queues, _ = pending.take(now=0.0)
    group = Group(queues, publisher, lambda i, e: BrokerRefused(f"request {i}: {e}"))
    group.read(group.fill(publisher.client.pipeline(transaction=False)).execute(
        raise_on_error=False))
    group.confirm()
    return group


def test_a_level_over_its_bound_refuses_with_queue_full_naming_the_level(
        publisher: Publisher) -> None:
    told: Told = []
    low = [_entry(publisher, told, f"low{i}", 9, level_bound=2) for i in range(3)]
    high = [_entry(publisher, told, f"high{i}", 0) for i in range(3)]
    group = _send(publisher, low + high)
    # the level-9 list holds its bound; the unbounded level 0 takes all three
    assert publisher.client.llen(priority_list("infer.m", 9)) == 2
    assert publisher.client.llen("infer.m") == 3
    outcomes = {i: (s, e) for i, s, e in told}
    assert [outcomes[f"low{i}"][0] for i in range(2)] == [PUBLISHED, PUBLISHED]
    error = outcomes["low2"][1]
    assert isinstance(error, QueueFull)
    assert "priority level 9 of queue infer.m holds 2 requests" in str(error)
    assert "priority_queue_policy max_queue_size 2" in str(error)
    assert all(outcomes[f"high{i}"][0] == PUBLISHED for i in range(3))
    assert group.again == []


def test_a_request_waiting_for_room_in_its_level_goes_back_alone(publisher: Publisher) -> None:
    told: Told = []
    publisher.client.lpush(priority_list("infer.m", 6), "old")
    waiting = _entry(publisher, told, "w", 7, level_bound=1, timeout_s=30)
    other = _entry(publisher, told, "o", 3, level_bound=1)
    group = _send(publisher, [waiting, other])
    assert [([e.push.request_id for e in entries]) for entries, _ in group.again] == [["w"]]
    assert [(i, s) for i, s, _ in told] == [("o", PUBLISHED)]


def test_the_option_is_checked_and_read_by_level() -> None:
    options = ModelOptions().merged({"priority_queue_policy": {
        "9": {"max_queue_size": 10, "default_timeout_s": 2.5}, "3": {"max_queue_size": 4}}})
    assert options.level_policy(9) == LevelPolicy(10, 2.5)
    assert options.level_policy(5) == LevelPolicy(4, 0.0)
    assert options.level_policy(0) == LevelPolicy()
    assert [level_of(p) for p in range(10)] == [0, 0, 0, 3, 3, 3, 6, 6, 6, 9]
    hash(options)  # still a frozen value


@pytest.mark.parametrize(("policy", "message"), [
    ({"5": {}}, "level '5' is not one of kombu's priority steps"),
    ({"9": {"max_queue": 1}}, r"priority_queue_policy\['9'\] must be an object with keys"),
    ({"9": {"max_queue_size": -1}}, r"max_queue_size must be an integer >= 0"),
    ({"0": {"default_timeout_s": "x"}}, r"default_timeout_s must be a finite number >= 0"),
    ([1], "priority_queue_policy must be an object of level"),
])
def test_a_bad_policy_is_refused_naming_the_rule(policy: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelOptions().merged({"priority_queue_policy": policy})
