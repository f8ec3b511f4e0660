"""How much a consumer holds: a few device batches per instance, never more than its bound."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from asyncinfer.policy.backpressure import held_at_most

pytestmark = pytest.mark.timeout(30)


def _runner(max_batch_size: int, instances: int, batch_s: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(max_batch_size=max_batch_size, batch_s=batch_s,
                           options=SimpleNamespace(instances=instances))


def test_a_worker_holds_a_few_batches_per_instance_within_its_in_flight_bound() -> None:
    # one instance of batch 32, its pace not known yet: two batches, not the 128 of the bound
    assert held_at_most(128, 2, 0.25, [_runner(32, 1)]) == 64
    # two models, two instances of one: summed
    assert held_at_most(512, 2, 0.25, [_runner(32, 2), _runner(8, 1)]) == 2 * 32 * 2 + 2 * 8
    # never past the bound
    assert held_at_most(32, 2, 0.25, [_runner(32, 2)]) == 32
    # a model that does not batch: two at a time
    assert held_at_most(128, 2, 0.25, [_runner(1, 1)]) == 2
    # 0, or nothing loaded yet: the bound alone
    assert held_at_most(128, 0, 0.25, [_runner(32, 1)]) == 128
    assert held_at_most(128, 2, 0.25, []) == 128


def test_a_fast_device_holds_what_it_gets_through_in_the_hold_time_a_slow_one_its_floor() -> None:
    # a batch in 2 ms: 0.25 s is 125 batches, so the bound decides
    assert held_at_most(128, 2, 0.25, [_runner(32, 1, batch_s=0.002)]) == 128
    # a batch in 50 ms: five batches in 0.25 s
    assert held_at_most(512, 2, 0.25, [_runner(32, 1, batch_s=0.05)]) == 160
    # a batch in 132 ms: under two batches in 0.25 s, so the floor of two
    assert held_at_most(512, 2, 0.25, [_runner(32, 1, batch_s=0.132)]) == 64


def test_the_workers_policy_holds_by_its_own_hold_settings() -> None:
    from asyncinfer.engine.timer import TimeLimits
    from asyncinfer.policy.policy import Policy
    from asyncinfer.policy.retries import RetryPolicy

    policy = Policy(retry=RetryPolicy(), time_limits=TimeLimits(), max_in_flight=128,
                    hold_batches=3, hold_s=0.5)
    assert policy.backpressure.held_at_most([_runner(32, 1)]) == 96
    assert policy.backpressure.held_at_most([_runner(32, 1, batch_s=0.05)]) == 128  # 320 by pace


def _taken(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, tag=f"tag-{request_id}", message=None,
                           list_key="infer.m", envelope={})


def test_a_batch_that_runs_alone_waits_for_what_ran_before_it_and_no_more() -> None:
    from asyncinfer.worker.requests.holdings import Holdings

    holdings = Holdings(128)
    ran, waiting, retry, alone = (_taken(i) for i in ("ran", "waiting", "retry", "alone"))
    holdings.add(ran, waiting, retry, alone)
    holdings.launched({"ran", "retry"})  # two went onto the device; one waits in the batcher
    holdings.schedule(retry)  # and one of them waits for its eta as a retry
    # What ran before and is not answered yet holds the alone batch back (a timeout tells)...
    assert holdings.settle({"alone"}, timeout_s=0.05) == 1
    # ...until its answer is stored; what never ran (and the retry waiting) does not
    release = threading.Timer(0.05, holdings.release, args=([ran],))
    release.start()
    assert holdings.settle({"alone"}, timeout_s=10) == 0
    release.join()
    holdings.resume(retry)  # due again: it waits for the device, launched no more
    assert holdings.settle({"alone"}, timeout_s=0.05) == 0


def test_a_launch_marks_each_held_copy_of_its_requests_and_a_release_forgets_only_its_own() -> None:
    from asyncinfer.worker.requests.holdings import Holdings

    holdings = Holdings(128)
    first, again, other = _taken("dup"), _taken("dup"), _taken("other")  # "dup" held twice
    holdings.add(first, again, other)
    holdings.launched({"dup"})
    assert {h.delivery.request_id: h.launched for h in holdings.held() if h.delivery is other} == {
        "other": False}
    assert [h.launched for h in holdings.held() if h.delivery.request_id == "dup"] == [True, True]
    assert holdings.find("dup") is first
    holdings.release([first])
    assert holdings.find("dup") is again  # the other copy is still held, and found
    assert holdings.settle({"other"}, timeout_s=0.05) == 1
    holdings.release([again])
    assert holdings.find("dup") is None
    assert holdings.settle({"other"}, timeout_s=0.05) == 0
    holdings.launched({"dup", "never-held"})  # nothing held under them: nothing to mark
    assert [h.launched for h in holdings.held()] == [False]
