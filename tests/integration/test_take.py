"""The atomic take: messages leave their queue only into kombu's unacknowledged bookkeeping, in a
form kombu itself restores."""

from __future__ import annotations

import json
import time

import pytest
import redis

from asyncinfer.broker.take import MAX_ENVELOPE_DEPTH, StartedText, Taker
from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.constants import PRIORITY_SEP, priority_lists
from asyncinfer.wire.keys import UNACKED_INDEX_KEY, UNACKED_KEY
from asyncinfer.wire.messages import task_message
from tests.support.databases import RedisDatabase


@pytest.fixture()
def broker(redis_db: RedisDatabase) -> tuple[str, redis.Redis]:
    return redis_db.url, redis_db.client


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
    ids = [json.loads(raw)["headers"]["id"] for _, raw, _, _, _ in taken]
    assert ids == ["base-0", "base-1", "base-2"] and {k for k, _, _, _, _ in taken} == {queue}
    assert all(recorded for _, _, recorded, _, _ in taken)
    for _, raw, _, _, _ in taken:
        tag = json.loads(raw)["properties"]["delivery_tag"]
        envelope, exchange, routing_key = json.loads(r.hget(UNACKED_KEY, tag))
        assert envelope == json.loads(raw) and (exchange, routing_key) == ("", queue)
        assert r.zscore(UNACKED_INDEX_KEY, tag) == pytest.approx(time.time(), abs=60)
    rest = Taker(r).take(lists, 10)
    assert [k for k, _, _, _, _ in rest] == [queue, f"{queue}{PRIORITY_SEP}3"]
    # popped, answered by the consumer, not recorded
    assert rest[0][1:] == (b"{not a kombu envelope", 0, False, 0) and rest[1][2] == 1
    assert r.hlen(UNACKED_KEY) == 4 and not any(r.llen(k) for k in lists)


def test_kombu_restores_what_the_take_recorded(broker) -> None:
    url, r = broker
    queue = "infer.m"
    original = _message("restore-me", queue)
    r.lpush(queue, original)
    [(_, raw, _, _, _)] = Taker(r).take(priority_lists([queue]), 5)
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


def _tagged(envelope: dict) -> str:
    return json.dumps(envelope)


HOSTILE = [
    ("headers a list", _tagged({"body": "e30=", "headers": [1, 2],
                                "properties": {"delivery_tag": "t-list"}})),
    ("headers a string", _tagged({"body": "e30=", "headers": "x",
                                  "properties": {"delivery_tag": "t-str"}})),
    ("properties missing", _tagged({"body": "e30=", "headers": {"id": "x"}})),
    ("delivery tag a number", _tagged({"body": "e30=", "properties": {"delivery_tag": 7}})),
    ("nested 100,000 deep in headers",
     '{"body": "e30=", "headers": {"x": ' + "[" * 100_000 + "]" * 100_000
     + '}, "properties": {"delivery_tag": "t-deep"}}'),
    ("nested 20 deep (over 16)", _tagged({"body": "e30=", "headers": {"x": json.loads("[" * 20 + "]" * 20)},
                               "properties": {"delivery_tag": "t-20"}})),
    ("not JSON", '{"body": "e30=", "properties": {"delivery_tag": "t-trunc"'),
    # the envelope (1), its headers (2) and 15 lists: one level over the rule
    ("nested 17 deep", _tagged({"body": "e30=", "headers": {"x": json.loads("[" * 15 + "]" * 15)},
                                "properties": {"delivery_tag": "t-17"}})),
]


def test_take_records_an_envelope_nested_exactly_as_deep_as_allowed(broker) -> None:
    """The nesting rule's edge: an envelope nested MAX_ENVELOPE_DEPTH deep is recorded."""
    _, r = broker
    queue = "infer.m"
    envelope = json.loads(_message("deep16", queue))
    envelope["headers"]["x"] = json.loads("[" * (MAX_ENVELOPE_DEPTH - 2) + "]" * (MAX_ENVELOPE_DEPTH - 2))
    r.lpush(queue, json.dumps(envelope))

    [(_, raw, recorded, _, _)] = Taker(r).take(priority_lists([queue]), 5)

    assert recorded and json.loads(raw)["headers"]["id"] == "deep16"
    assert r.hexists(UNACKED_KEY, envelope["properties"]["delivery_tag"])


@pytest.mark.parametrize("name, raw", HOSTILE)
def test_take_records_no_malformed_envelope(broker, name, raw) -> None:
    """What kombu's restore sweep could not load never enters its bookkeeping: such a message is
    popped (the consumer answers it) but not recorded."""
    _, r = broker
    queue = "infer.m"
    r.lpush(queue, raw)
    r.lpush(queue, _message("good", queue))

    taken = Taker(r).take(priority_lists([queue]), 5)

    assert [recorded for _, _, recorded, _, _ in taken] == [False, True], name
    assert r.hlen(UNACKED_KEY) == 1 and r.zcard(UNACKED_INDEX_KEY) == 1
    [entry] = r.hvals(UNACKED_KEY)
    assert json.loads(entry)[0]["headers"]["id"] == "good"


def test_take_keeps_a_body_that_is_not_base64(broker) -> None:
    """A producer that sends its body as an escaped JSON string (not base64) is still taken."""
    _, r = broker
    queue = "infer.m"
    envelope = json.loads(_message("plain-body", queue))
    envelope["body"] = json.dumps([[], {"model": "m", "say": "a \"quoted\" word"}, {}])
    envelope["properties"]["body_encoding"] = "utf-8"
    r.lpush(queue, json.dumps(envelope))

    [(_, raw, recorded, _, _)] = Taker(r).take(priority_lists([queue]), 5)

    assert recorded and json.loads(raw) == envelope
    stored, _, routing_key = json.loads(r.hget(UNACKED_KEY, envelope["properties"]["delivery_tag"]))
    assert stored == envelope and routing_key == queue


def test_kombu_sweep_survives_whatever_the_take_recorded(broker) -> None:
    """kombu's restore sweep (run by every worker) loads every recorded entry: after taking each
    hostile message (and one of invalid UTF-8, which kombu reads with replacement characters), a
    sweep with visibility timeout 0 puts back exactly the recorded ones and raises nothing."""
    url, r = broker
    queue = "infer.m"
    for _, raw in HOSTILE:
        r.lpush(queue, raw)
    r.lpush(queue, b'{"body": "e30=", "properties": {"delivery_tag": "t-\xff\xfe"}}')
    r.lpush(queue, _message("good", queue))
    taken = Taker(r).take(priority_lists([queue]), 50)
    recorded = [raw for _, raw, rec, _, _ in taken if rec]
    assert len(taken) == len(HOSTILE) + 2 and len(recorded) == 2  # the UTF-8 one and the good one

    app = create_app(Settings(broker_url=url, visibility_timeout_s=0.0))
    with app.connection_for_write() as conn:
        conn.default_channel.qos.restore_visible(num=100)
    assert r.llen(queue) == 2 and r.hlen(UNACKED_KEY) == 0


def test_take_stores_started_for_its_own_first_deliveries_only(broker) -> None:
    # Given a request, one with an eta, a redelivered one, another task's, and one whose ID needs
    # escaping in JSON
    _, r = broker
    queue = "infer.m"
    plain, odd = _message("plain", queue), _message('odd"id\\', queue)
    delayed = json.loads(_message("delayed", queue))
    delayed["headers"]["eta"] = "2030-01-01T00:00:00+00:00"
    again = json.loads(_message("again", queue))
    again["headers"]["redelivered"] = True
    other = task_message("other.task", "other", {}, queue)
    for raw in (plain, json.dumps(delayed), json.dumps(again), other, odd):
        r.lpush(queue, raw)
    started = StartedText(b"celery-task-meta-", '{"status": "STARTED", "task_id": ', "}", 60,
                          "asyncinfer.infer")
    # When they are taken with STARTED to store
    taken = Taker(r).take(priority_lists([queue]), 10, started)
    # Then only the plain first deliveries of the task are started, in the same step
    flags = {json.loads(raw)["headers"]["id"]: s for _, raw, _, s, _ in taken}
    assert flags == {"plain": True, "delayed": False, "again": False, "other": False,
                     'odd"id\\': True}
    assert json.loads(r.get("celery-task-meta-plain")) == {"status": "STARTED", "task_id": "plain"}
    assert json.loads(r.get('celery-task-meta-odd"id\\'))["task_id"] == 'odd"id\\'
    assert 0 < r.ttl("celery-task-meta-plain") <= 60
    assert not r.exists("celery-task-meta-delayed", "celery-task-meta-again", "celery-task-meta-other")


def test_a_take_larger_than_one_commands_worth_records_and_leases_every_message(broker) -> None:
    """The take writes its bookkeeping with one variadic command per key, in calls of at most
    1,000 messages: a take of 1,500 across two lists records and leases each one."""
    from asyncinfer.broker.take import LeaseTerms
    from asyncinfer.wire.keys import LEASE_HOLDERS_KEY, LEASES_KEY

    _, r = broker
    queue = "infer.big"
    lists = priority_lists([queue])
    pipe = r.pipeline()
    for i in range(1200):
        pipe.lpush(queue, _message(f"big-{i}", queue))
    for i in range(300):
        pipe.lpush(f"{queue}{PRIORITY_SEP}3", _message(f"later-{i}", queue))
    pipe.execute()
    taken = Taker(r).take(lists, 1500, lease=LeaseTerms(10.0, "w1"))
    ids = [json.loads(raw)["headers"]["id"] for _, raw, _, _, _ in taken]
    assert ids == [f"big-{i}" for i in range(1200)] + [f"later-{i}" for i in range(300)]
    tags = [json.loads(raw)["properties"]["delivery_tag"] for _, raw, _, _, _ in taken]
    assert all(recorded for _, _, recorded, _, _ in taken)
    # a leased take leaves kombu's index alone: the leases give its messages back
    assert r.hlen(UNACKED_KEY) == 1500 and r.zcard(UNACKED_INDEX_KEY) == 0
    assert r.zcard(LEASES_KEY) == r.hlen(LEASE_HOLDERS_KEY) == 1500
    assert r.hget(LEASE_HOLDERS_KEY, tags[-1]) == f"w1\t{queue}{PRIORITY_SEP}3".encode()
    assert r.zscore(LEASES_KEY, tags[0]) == pytest.approx(time.time() + 10, abs=60)
    assert not any(r.llen(k) for k in lists)


def test_a_body_over_the_largest_kept_is_left_out_of_the_record_and_the_reply(broker) -> None:
    # Given a message whose base64 body (as kombu's Redis transport writes every body) is 6,000
    # bytes, and one whose body is small
    _, r = broker
    queue = "infer.m"
    big = json.loads(_message("big", queue))
    big["body"] = "QUJD" * 1500
    r.lpush(queue, json.dumps(big))
    small = _message("small", queue)
    r.lpush(queue, small)
    # When a worker that keeps bodies of at most 5,000 bytes takes both
    taken = Taker(r).take([queue], 2, max_body_bytes=5000)
    # Then the big one is recorded and returned without its body, its size said instead
    (_, raw, recorded, _, _), (_, small_raw, small_recorded, _, _) = taken
    assert recorded == -6000 and json.loads(raw)["body"] == "" and len(raw) < 1000
    tag = json.loads(raw)["properties"]["delivery_tag"]
    envelope, _, _ = json.loads(r.hget(UNACKED_KEY, tag))
    assert envelope["headers"]["id"] == "big" and envelope["body"] == ""
    assert r.hstrlen(UNACKED_KEY, tag) < 1000
    # And the small one whole, as before
    assert small_recorded == 1 and small_raw.decode() == small
