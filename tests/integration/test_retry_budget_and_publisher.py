"""Policy building blocks on a real Redis: the retry budget, and the publisher (its queue bound and
idempotency). The rest of the building blocks, in process: tests/unit/test_policy.py."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis

from asyncinfer.client.publisher import DUPLICATE, PUBLISHED, Publisher
from asyncinfer.constants import priority_list
from asyncinfer.errors import QueueFull
from asyncinfer.keys import CLAIM_PREFIX
from asyncinfer.policy.retry_budget import RetryBudget
from tests.support.databases import RedisDatabase


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


# -- publisher: queue bound and idempotency ------------------------------------------------------


def test_publisher_refuses_past_the_bound_and_names_the_request(scratch: redis.Redis) -> None:
    publisher = Publisher(scratch, claim_ttl_s=60)
    for i in range(3):
        assert publisher.publish("infer.q", f"r{i}", f"m{i}", claim=False, max_queue_size=3) == PUBLISHED
    with pytest.raises(QueueFull, match=r"request r3: queue infer.q holds 3 requests.*max_queue_size 3"):
        publisher.publish("infer.q", "r3", "m3", claim=False, max_queue_size=3)
    assert scratch.llen("infer.q") == 3
    assert not scratch.exists(CLAIM_PREFIX + "r3")


def test_with_no_claim_and_no_bound_a_publish_is_one_push_onto_its_priority_list(
        scratch: redis.Redis) -> None:
    scripts: list[str] = []
    publisher = Publisher(scratch, claim_ttl_s=60)
    publisher._publish = lambda **kw: scripts.append(kw) or [PUBLISHED]  # type: ignore[assignment]
    assert publisher.publish("infer.q", "r1", "m1", claim=False) == PUBLISHED
    assert publisher.publish("infer.q", "r2", "m2", claim=False, priority=9) == PUBLISHED
    assert scratch.lrange("infer.q", 0, -1) == [b"m1"]
    assert scratch.lrange(priority_list("infer.q", 9), 0, -1) == [b"m2"]
    assert scripts == [] and not scratch.exists(CLAIM_PREFIX + "r1")
    # a claim or a bound still goes through the script
    publisher.publish("infer.q", "r3", "m3", claim=True)
    publisher.publish("infer.q", "r4", "m4", claim=False, max_queue_size=10)
    assert len(scripts) == 2


class _RefusalsSeen:
    """A Redis client whose publish script reports each refusal (queue full) on ``refused``."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.refused = threading.Event()

    def register_script(self, text: str) -> Callable[..., Any]:
        script = self.client.register_script(text)

        def run(**kwargs: Any) -> Any:
            reply = script(**kwargs)
            if int(reply[0]) < 0:
                self.refused.set()
            return reply

        return run

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_publisher_waits_for_room_up_to_its_timeout(scratch: redis.Redis) -> None:
    watched = _RefusalsSeen(scratch)
    publisher = Publisher(watched, claim_ttl_s=60)
    publisher.publish("infer.q", "a", "m", claim=False, max_queue_size=1)
    drained = threading.Event()

    def drain() -> None:
        watched.refused.wait(30)  # the publisher found the queue full and waits for room
        scratch.rpop("infer.q")
        drained.set()

    threading.Thread(target=drain).start()
    assert publisher.publish("infer.q", "b", "m2", claim=False, max_queue_size=1,
                             timeout_s=30) == PUBLISHED
    assert drained.is_set()
    assert scratch.lrange("infer.q", 0, -1) == [b"m2"]


def test_publisher_sends_a_claimed_id_once(scratch: redis.Redis) -> None:
    publisher = Publisher(scratch, claim_ttl_s=120)
    assert publisher.publish("infer.q", "same", "m1", claim=True) == PUBLISHED
    assert publisher.publish("infer.q", "same", "m2", claim=True) == DUPLICATE
    assert scratch.lrange("infer.q", 0, -1) == [b"m1"]
    assert 0 < scratch.ttl(CLAIM_PREFIX + "same") <= 120
    # A stored result counts as sent too (a request sent by another producer).
    scratch.set("celery-task-meta-done", "{}")
    assert publisher.publish("infer.q", "done", "m3", claim=True,
                             result_key="celery-task-meta-done") == DUPLICATE
    assert scratch.llen("infer.q") == 1
