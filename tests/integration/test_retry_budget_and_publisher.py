"""Policy building blocks on a real Redis: the retry budget, and the publisher's idempotency. The
rest of the building blocks, in process: tests/unit/test_policy.py."""

from __future__ import annotations

import re

import pytest
import redis

from asyncinfer.broker.publisher import CONFLICT, DUPLICATE, PUBLISHED, REUSED, Publisher, script_arguments
from asyncinfer.errors import RequestIdReused
from asyncinfer.policy.retry_budget import RetryBudget
from asyncinfer.wire.keys import CLAIM_PREFIX
from asyncinfer.wire.request_identity import identity
from tests.support.databases import RedisDatabase
from tests.support.publishing import publish_one


@pytest.fixture()
def scratch(redis_db: RedisDatabase) -> redis.Redis:
    """An emptied database of the session Redis that no worker uses."""
    return redis_db.client


# -- retry budget -------------------------------------------------------------------------------


def test_budget_grants_ratio_of_recent_requests_plus_minimum(scratch: redis.Redis) -> None:
    budget = RetryBudget(scratch, ratio=0.1, minimum=5, window_s=60)
    now = 6000.0  # window 100
    budget.count_requests(100, now=now)
    first = budget.spend(8, now=now)
    assert (first.granted, first.requests, first.spent) == (8, 100, 0)
    second = budget.spend(10, now=now)
    assert (second.granted, second.spent) == (7, 8)  # 0.1 × 100 + 5 = 15 in all
    third = budget.spend(1, now=now)
    assert third.granted == 0 and third.spent == 15
    assert "15 retries against 100 requests" in budget.describe(third)


def test_budget_counts_the_previous_window_and_forgets_older_ones(scratch: redis.Redis) -> None:
    budget = RetryBudget(scratch, ratio=0.5, minimum=0, window_s=10)
    budget.count_requests(10, now=100.0)   # window 10
    assert budget.spend(3, now=100.0).granted == 3
    # Window 11: the 10 requests and 3 retries of window 10 still count.
    assert budget.spend(5, now=110.0).granted == 2
    # Window 12: window 10 is forgotten; nothing arrived since, so nothing is granted.
    assert budget.spend(1, now=120.0).granted == 0
    budget.count_requests(4, now=120.0)
    assert budget.spend(5, now=120.0).granted == 0  # window 11's 2 retries still count
    assert budget.spend(5, now=130.0).granted == 2  # window 13: 0.5 × 4 requests of window 12
    ttl = scratch.ttl("asyncinfer:retry-budget:requests:12")
    assert 0 < ttl <= 20


def test_budget_counts_in_a_callers_pipeline(scratch: redis.Redis) -> None:
    budget = RetryBudget(scratch, ratio=1.0, minimum=0, window_s=10)
    pipe = scratch.pipeline(transaction=False)
    budget.count_requests(3, pipe, now=50.0)
    assert budget.spend(1, now=50.0).granted == 0  # not executed yet
    pipe.execute()
    assert budget.spend(5, now=50.0).granted == 3


def test_budget_rejects_nonsense_settings(scratch: redis.Redis) -> None:
    with pytest.raises(ValueError):
        RetryBudget(scratch, ratio=-1, minimum=0, window_s=1)
    with pytest.raises(ValueError):
        RetryBudget(scratch, ratio=0.1, minimum=0, window_s=0)


# -- publisher: idempotency (the queue bound, order and faults: test_grouped_publish.py) ---------


def test_publisher_sends_a_claimed_id_once(scratch: redis.Redis) -> None:
    publisher = Publisher(scratch, claim_ttl_s=120)
    assert publish_one(publisher, "infer.q", "same", "m1", claim=True) == PUBLISHED
    assert publish_one(publisher, "infer.q", "same", "m2", claim=True) == DUPLICATE
    assert scratch.lrange("infer.q", 0, -1) == [b"m1"]
    assert 0 < scratch.ttl(CLAIM_PREFIX + "same") <= 120
    # A stored result counts as sent too (a request sent by another producer).
    scratch.set("celery-task-meta-done", "{}")
    assert publish_one(publisher, "infer.q", "done", "m3", claim=True,
                    result_key="celery-task-meta-done") == DUPLICATE
    assert scratch.llen("infer.q") == 1


def _identity(data: list[int], **parameters: object) -> str:
    return identity("infer.q", {"inputs": [{"name": "x", "datatype": "INT32", "shape": [len(data)],
                                           "data": data}], "parameters": parameters})


def test_publisher_refuses_a_claimed_id_sent_again_as_another_request(scratch: redis.Redis) -> None:
    # Given a request sent with a caller-chosen ID
    publisher = Publisher(scratch, claim_ttl_s=120)
    first = _identity([1, 2, 3])
    assert publish_one(publisher, "infer.q", "seven", "m1", claim=True, identity=first) == PUBLISHED
    # When the same request is sent again, it is the same request: nothing more is pushed
    assert publish_one(publisher, "infer.q", "seven", "m2", claim=True,
                       identity=_identity([1, 2, 3])) == DUPLICATE
    # When other data, another version or other parameters come under the same ID, each is
    # refused naming the ID and what differs, and nothing is pushed
    for other, what in [(_identity([10, 20, 30]), "different inputs"),
                        (_identity([1, 2, 3], model_version="2"),
                         "different model version (first the latest version, now version 2)"),
                        (_identity([1, 2, 3], binary_data_output=True), "different parameters")]:
        with pytest.raises(RequestIdReused, match=rf"^request seven: this request ID was already "
                                                  rf"sent with a {re.escape(what)}"):
            publish_one(publisher, "infer.q", "seven", "m3", claim=True, identity=other)
    assert scratch.lrange("infer.q", 0, -1) == [b"m1"]
    assert scratch.get(CLAIM_PREFIX + "seven") == first.encode()


def test_publisher_takes_a_claim_too_bare_to_compare_as_the_same_request(
        scratch: redis.Redis) -> None:
    # Given claims an older client wrote (the queue alone, or "1" on another broker's backend)
    publisher = Publisher(scratch, claim_ttl_s=120)
    scratch.set(CLAIM_PREFIX + "old", "infer.q")
    scratch.set(CLAIM_PREFIX + "older", "1")
    # Then a new request under those IDs is the request they name: not pushed, not refused
    for request_id in ("old", "older"):
        assert publish_one(publisher, "infer.q", request_id, "m", claim=True,
                           identity=_identity([1])) == DUPLICATE
    assert scratch.llen("infer.q") == 0


def test_the_script_tells_another_identity_of_the_same_queue_from_another_queue(
        scratch: redis.Redis) -> None:
    # The reply's status: -4 (this queue, another identity) or -2 (another queue), as the script's
    # header says; both end in RequestIdReused, naming what differs.
    publisher = Publisher(scratch, claim_ttl_s=120)
    assert publish_one(publisher, "infer.q", "k", "m1", claim=True,
                       identity=_identity([1])) == PUBLISHED
    for queue, other, status in (("infer.q", _identity([2]), REUSED),
                                 ("infer.r", "infer.r", CONFLICT)):
        push = publisher.prepare(queue, "k", "m2", claim=True, identity=other)
        keys, args = script_arguments([push])
        assert int(publisher._publish(keys=keys, args=args)[0]) == status
