"""The launch gate (worker/requests/lease_gate.py): a batch goes onto the device only with the
requests whose leases are still this worker's; while Redis cannot say, the device waits."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from asyncinfer.worker.requests.holdings import Holdings
from asyncinfer.worker.requests.lease_gate import LeaseGate
from asyncinfer.worker.requests.taken import TakenMessage

pytestmark = pytest.mark.timeout(30)


class FakeLeases:
    """A shard's leases: the last renewal's time, and what a renewal answers (a set of tags
    leased to another worker, or an error to raise), in turn."""

    def __init__(self, answers: list[Any], lease_s: float = 10.0, renewed_ago_s: float = 0.0):
        self.lease_s = lease_s
        self.renewed_at = time.perf_counter() - renewed_ago_s
        self.answers = answers
        self.calls = 0

    def renew(self) -> list[str]:
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        self.renewed_at = time.perf_counter()
        return sorted(answer)


def held(holdings: Holdings, name: str, *, taken_ago_s: float = 0.0,
         message: Any = None) -> tuple[Any, TakenMessage]:
    """A work item of request ``name``, held under tag ``tag-<name>``."""
    d = TakenMessage(raw=b"", queue="infer.m", tag=f"tag-{name}", request_id=name,
                     received_at=time.perf_counter() - taken_ago_s, message=message)
    holdings.add(d)
    return SimpleNamespace(request=SimpleNamespace(id=name)), d


def test_a_batch_whose_leases_are_fresh_launches_whole_without_a_round_trip() -> None:
    holdings, leases = Holdings(10), FakeLeases([])
    gate = LeaseGate(holdings, [leases], threading.Event())
    # Given requests taken long ago but renewed just now, and one taken just now
    items = [held(holdings, "a", taken_ago_s=60)[0], held(holdings, "b")[0]]
    # Then all launch, and Redis is not asked
    assert gate.admit(items) == items
    assert leases.calls == 0 and holdings.in_flight == 2


def test_a_batch_in_doubt_launches_without_what_another_worker_holds_now() -> None:
    # Given a worker whose last renewal was 6 s ago (over half its 10 s lease): two renewals
    # missed, as when cut off from Redis
    holdings = Holdings(10)
    leases = FakeLeases([{"tag-b"}], renewed_ago_s=6.0)
    gate = LeaseGate(holdings, [leases], threading.Event())
    (a, _), (b, db), (c, _) = (held(holdings, n, taken_ago_s=7) for n in "abc")
    # When a batch of three is about to launch, and Redis says b went to another worker
    admitted = gate.admit([a, b, c])
    # Then the gate renewed once, and a and c launch; b is given up here, unrun
    assert admitted == [a, c]
    assert leases.calls == 1 and gate.given_up == 1
    assert not holdings.holds(db) and holdings.in_flight == 2


def test_the_device_waits_while_redis_cannot_say_then_runs_what_is_still_its_own() -> None:
    holdings = Holdings(10)
    down = redis.ConnectionError("Connection refused")
    leases = FakeLeases([down, down, set()], renewed_ago_s=9.0)
    gate = LeaseGate(holdings, [leases], threading.Event())
    gate.retry_s = 0.05
    a, _ = held(holdings, "a", taken_ago_s=9)
    # When Redis fails twice, then answers that the lease is still this worker's
    began = time.perf_counter()
    admitted = gate.admit([a])
    # Then the batch waited for the answer, and launches
    assert admitted == [a]
    assert leases.calls == 3 and gate.waited == 1 and gate.given_up == 0
    assert time.perf_counter() - began >= 0.1


def test_a_stop_while_the_device_waits_launches_nothing() -> None:
    holdings = Holdings(10)
    stopping = threading.Event()
    leases = FakeLeases([redis.ConnectionError("down")] * 1000, renewed_ago_s=9.0)
    gate = LeaseGate(holdings, [leases], stopping)
    gate.retry_s = 0.05
    a, da = held(holdings, "a", taken_ago_s=9)
    threading.Timer(0.2, stopping.set).start()
    # Then nothing launches, and what it held stays held (the stop gives it back to its queue)
    assert gate.admit([a]) == []
    assert holdings.holds(da)


def test_what_a_renewal_found_lost_while_its_batch_was_formed_stops_at_the_gate() -> None:
    # Given leases renewed just now (no doubt), and a request the lease thread's renewal found
    # leased to another worker after its batch was formed (the pipeline marks it lost)
    holdings, leases = Holdings(10), FakeLeases([])
    gate = LeaseGate(holdings, [leases], threading.Event())
    (a, _), (b, db) = held(holdings, "a"), held(holdings, "b")
    db.lost = True
    # Then it is given up without a round trip, and the other launches
    assert gate.admit([a, b]) == [a]
    assert leases.calls == 0 and not holdings.holds(db)


def test_kombus_deliveries_and_unleased_shards_pass_as_they_are() -> None:
    holdings = Holdings(10)
    leases = FakeLeases([], renewed_ago_s=60.0)
    # Given a delivery of Celery's consumer (kombu's message) on a leased shard, and one taken
    # on a shard without leases (ASYNCINFER_LEASE_S=0), both long ago
    gate = LeaseGate(holdings, [leases, None], threading.Event())
    kombu, _ = held(holdings, "k", taken_ago_s=60, message=object())
    item, d = held(holdings, "u", taken_ago_s=60)
    d.shard = 1
    # Then both launch, and Redis is not asked
    assert gate.admit([kombu, item]) == [kombu, item]
    assert leases.calls == 0
