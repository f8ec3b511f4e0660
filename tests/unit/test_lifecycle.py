"""The request lifecycle in process: admission, the one in-flight account, the policy's limits, and
the outcomes the fast consumer hands its writer (a recording writer, a scripted budget)."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import states
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError

from asyncinfer.constants import TASK_NAME
from asyncinfer.engine.timer import TimeLimits
from asyncinfer.errors import (
    InvalidRequest,
    RequestExpired,
    RetryBudgetExhausted,
    SoftTimeLimit,
    TransientError,
)
from asyncinfer.policy.admission import DELAY, EXPIRED, REFUSED, REVOKED, RUN
from asyncinfer.policy.policy import Policy
from asyncinfer.policy.retries import RetryPolicy
from asyncinfer.policy.retry_budget import BudgetDecision
from asyncinfer.wire.envelope import parse_envelope
from asyncinfer.wire.messages import task_message
from asyncinfer.worker.lifecycle import Settlement, admit, already_answered
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.outcomes import Outcomes
from asyncinfer.worker.requests.holdings import ACTIVE, RESERVED, SCHEDULED, Holdings
from asyncinfer.worker.requests.taken import TakenMessage


def _iso(delta_s: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=delta_s)).isoformat()


def _never(request_id: str) -> bool:
    return False


# -- admission -----------------------------------------------------------------------------------


def test_admission_runs_delays_refuses_revokes_and_expires() -> None:
    assert admit("r", TASK_NAME, "infer.m", revoked=_never).verdict == RUN
    later = admit("r", TASK_NAME, "infer.m", eta=_iso(30), revoked=_never)
    assert later.verdict == DELAY and 29 < later.delay_s <= 30.5  # on the broker clock (ms off)
    assert admit("r", TASK_NAME, "infer.m", eta=_iso(-1), revoked=_never).verdict == RUN
    refused = admit("r", "celery.map", "infer.m", revoked=_never)
    assert refused.verdict == REFUSED and isinstance(refused.error, InvalidRequest)
    assert str(refused.error) == ("request r: task 'celery.map' is refused: only asyncinfer.infer "
                                  "is served on queue infer.m")
    revoked = admit("r", TASK_NAME, "infer.m", revoked=lambda rid: rid == "r")
    assert revoked.verdict == REVOKED and isinstance(revoked.error, TaskRevokedError)
    expired = admit("r", TASK_NAME, "infer.m", expires=_iso(-1), revoked=_never)
    assert expired.verdict == EXPIRED and str(expired.error) == "expired"
    assert admit("r", TASK_NAME, "infer.m", expires=_iso(60), revoked=_never).verdict == RUN


def test_a_delay_comes_before_the_other_rules_and_revocation_before_expiry() -> None:
    # a retry waiting for its eta is judged when it comes due, as Celery's worker judges it
    assert admit("r", "other", "q", eta=_iso(10), revoked=_never).verdict == DELAY
    both = admit("r", TASK_NAME, "q", expires=_iso(-1), revoked=lambda rid: True)
    assert both.verdict == REVOKED


def test_only_a_final_state_answers_a_redelivered_copy() -> None:
    assert [already_answered(s) for s in (states.SUCCESS, states.FAILURE, states.REVOKED)] == [True] * 3
    assert [already_answered(s) for s in (states.PENDING, states.STARTED, states.RETRY, None)] == \
        [False] * 4


# -- the one in-flight account --------------------------------------------------------------------


def _delivery(request_id: str = "r1", task: str = TASK_NAME, retries: int = 0) -> TakenMessage:
    raw = task_message(task, request_id, {"model": "m", "inputs": []}, "infer.m")
    envelope = json.loads(raw)
    envelope["headers"]["retries"] = retries
    d = TakenMessage(raw=json.dumps(envelope).encode(), queue="infer.m", received_at=0.0, key="infer.m")
    parse_envelope(d)
    return d


def test_takes_under_way_reserve_their_share_of_the_room_and_never_take_more_together() -> None:
    # Given a bound of 10, one held, and three intakes (a spread cluster URL's shards)
    holdings = Holdings(max_in_flight=10)
    holdings.add(_delivery("held"))
    # When three takes are under way at once, each reserving its share (at most a third: 4)
    shares = [holdings.reserve(lambda: True, shares=3) for _ in range(3)]
    # Then together they never count on more than the room, the last getting what is left
    assert shares == [4, 4, 1] and holdings.room(stopping=lambda: True) == 0
    # and as what the first took (2 of its 4) is held and its reservation given back, the rest frees
    holdings.add(_delivery("t1"))
    holdings.add(_delivery("t2"))
    holdings.unreserve(4)
    assert holdings.room(stopping=lambda: True) == 2 and holdings.in_flight == 3
    holdings.unreserve(4)
    holdings.unreserve(1)
    assert holdings.room(stopping=lambda: True) == 7
    # One intake (one Redis) reserves the whole room, as one take did
    assert holdings.reserve(lambda: True) == 7


def test_a_take_at_the_bound_waits_for_a_quarter_of_it_free_and_then_takes_all_the_room() -> None:
    from asyncinfer.policy.backpressure import Backpressure

    # Given a consumer's bound of 20 at the default refill (a quarter: takes of at least 5)
    least = Backpressure(max_in_flight=64, refill_fraction=0.25).least_take
    holdings = Holdings(max_in_flight=20, least_take=least)
    held = [_delivery(f"r{i}") for i in range(20)]
    holdings.add(*held)
    # When answers free the room one at a time, no take is worth it before 5 are free
    for answered in range(1, 5):
        holdings.release([held[answered - 1]])
        assert holdings.room(stopping=lambda: True) == answered
    waiter = threading.Thread(target=lambda: got.append(holdings.reserve(lambda: False)))
    got: list[int] = []
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and got == []  # a take waits with 4 free
    holdings.release([held[4]])
    waiter.join(10)
    # Then the fifth answer lets one take reserve all 5
    assert got == [5] and holdings.room(stopping=lambda: True) == 0
    # A bound under 4 takes at each answer, and so does a refill fraction of 0
    assert least(20) == 5 and least(3) == 1 and Backpressure(64).least_take(1000) == 1


@pytest.mark.parametrize("below", ["priority 3", "a lower level's list"])
def test_while_anything_a_better_request_may_pass_is_held_a_take_comes_at_each_answer(
        below: str) -> None:
    from asyncinfer.constants import priority_list
    from asyncinfer.policy.backpressure import Backpressure

    least = Backpressure(max_in_flight=64, refill_fraction=0.25).least_take
    holdings = Holdings(max_in_flight=20, least_take=least)
    held = [_delivery(f"r{i}") for i in range(19)]
    low = _delivery("low")
    if below == "priority 3":
        low.envelope["properties"]["priority"] = 3
    else:
        low.key = priority_list("infer.m", 6)
    holdings.add(*held, low)
    # When one answer frees one place while the low one is held, one take reserves it
    holdings.release([held[0]])
    assert holdings.reserve(lambda: False) == 1
    holdings.unreserve(1)
    # and once the low one is answered, a take waits for a quarter of the bound again
    holdings.release([low])
    assert holdings.room(stopping=lambda: True) == 2
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(holdings.reserve(lambda: False)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and got == []
    holdings.release(held[1:4])
    waiter.join(10)
    assert got == [5]


def test_holdings_count_what_is_held_and_not_scheduled() -> None:
    holdings = Holdings(max_in_flight=2)
    a, b, c = _delivery("a"), _delivery("b"), _delivery("c")
    holdings.add(a)
    holdings.add(b)
    holdings.add(a)  # held once
    assert holdings.in_flight == 2
    assert holdings.room(stopping=lambda: True) == 0  # full: returns once told to stop
    holdings.schedule(b)
    holdings.schedule(b)  # counted out once
    assert holdings.in_flight == 1 and holdings.room(stopping=lambda: False) == 1
    holdings.add(c)
    holdings.start(c)
    assert {h.delivery.request_id: h.state for h in holdings.held()} == {
        "a": RESERVED, "b": SCHEDULED, "c": ACTIVE}
    assert next(h for h in holdings.held() if h.delivery is c).started_at is not None
    holdings.resume(b)
    assert holdings.in_flight == 3
    holdings.release([a, b, c, _delivery("never-held")])
    assert holdings.in_flight == 0 and holdings.held() == [] and holdings.drain(0.0) == 0
    assert holdings.find("a") is None


def test_releasing_a_scheduled_message_does_not_count_it_twice() -> None:
    holdings = Holdings(max_in_flight=4)
    d = _delivery()
    holdings.add(d)
    holdings.schedule(d)
    holdings.release([d])
    assert holdings.in_flight == 0


# -- the policy ----------------------------------------------------------------------------------


def test_a_messages_time_limits_override_the_policys_defaults_one_by_one() -> None:
    policy = Policy(retry=RetryPolicy(), time_limits=TimeLimits(soft_s=10.0, hard_s=30.0),
                    max_in_flight=8)
    assert policy.limits_for(None) == TimeLimits(10.0, 30.0)
    assert policy.limits_for([None, None]) == TimeLimits(10.0, 30.0)
    assert policy.limits_for([5, None]) == TimeLimits(soft_s=10.0, hard_s=5.0)
    assert policy.limits_for([None, 2]) == TimeLimits(soft_s=2.0, hard_s=30.0)


# -- outcomes ------------------------------------------------------------------------------------


class _Writer:
    """Records what the outcomes hand over, as the result writer would write it."""

    def __init__(self) -> None:
        self.put_outcomes: list[Outcome] = []
        self.before_write: Any = None
        self.on_written: Any = None

    def put(self, outcome: Outcome) -> None:
        self.put_outcomes.append(outcome)


class _Budget:
    def __init__(self, granted: int) -> None:
        self.granted = granted
        self.asked: list[int] = []

    def spend(self, wanted: int) -> BudgetDecision:
        self.asked.append(wanted)
        return BudgetDecision(min(wanted, self.granted), 100, 100)

    def describe(self, decision: BudgetDecision) -> str:
        return f"budget spent ({decision.spent} retries)"


def _outcomes(granted: int = 10, max_retries: int = 2) -> tuple[Outcomes, _Writer, Holdings, _Budget]:
    writer, holdings, budget = _Writer(), Holdings(8), _Budget(granted)
    policy = Policy(retry=RetryPolicy(max_retries=max_retries, backoff_s=0.5, jitter=False),
                    time_limits=TimeLimits(), max_in_flight=8, budget=budget)
    outcomes = Outcomes(writer, Settlement("w@h", "cpu", policy), holdings,  # type: ignore[arg-type]
                        response=lambda request, done, hostname: {"id": request, "by": hostname})
    return outcomes, writer, holdings, budget


def test_a_transient_failure_goes_back_with_its_backoff_then_fails_when_retries_run_out() -> None:
    outcomes, writer, _, _ = _outcomes(max_retries=2)
    outcomes.fail(_delivery(retries=1), TransientError("busy"))
    [retry] = writer.put_outcomes
    assert retry.state == states.RETRY
    message = json.loads(retry.retry or "{}")
    assert message["headers"]["retries"] == 2 and message["headers"]["eta"]
    outcomes.fail(_delivery(retries=2), TransientError("busy"))
    assert writer.put_outcomes[-1].state == states.FAILURE and writer.put_outcomes[-1].retry is None


def test_bad_input_and_other_tasks_are_never_retried() -> None:
    outcomes, writer, _, _ = _outcomes()
    outcomes.fail(_delivery(), InvalidRequest("request r1: bad"))
    outcomes.fail(_delivery(task="other.task"), TransientError("busy"))
    assert [o.state for o in writer.put_outcomes] == [states.FAILURE, states.FAILURE]


def test_the_budget_is_asked_once_per_batch_and_refused_retries_fail_with_one_line(
        caplog: pytest.LogCaptureFixture) -> None:
    outcomes, writer, _, budget = _outcomes(granted=1)
    first, second = _delivery("first"), _delivery("second")
    outcomes.fail(first, TransientError("busy"))
    outcomes.fail(second, TransientError("busy"))
    batch = list(writer.put_outcomes)
    with caplog.at_level(logging.INFO, logger="asyncinfer.worker.lifecycle"):
        outcomes.before_write(batch)
    assert budget.asked == [2]
    assert [o.state for o in batch] == [states.RETRY, states.FAILURE]
    assert isinstance(batch[1].result, RetryBudgetExhausted) and batch[1].retry is None
    assert str(batch[1].result) == ("request second: not retried after TransientError: busy: "
                                    "budget spent (100 retries)")
    lines = [r.getMessage() for r in caplog.records]
    assert sum("request second failed:" in line for line in lines) == 1
    assert sum("request first: retry 1 after TransientError" in line for line in lines) == 1


def _done(result: Any = None, exc: BaseException | None = None) -> Future[Any]:
    future: Future[Any] = Future()
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
    return future


def test_settling_maps_the_engines_errors_to_celerys_states() -> None:
    outcomes, writer, holdings, _ = _outcomes(max_retries=0)
    ok_d, late_d, slow_d = _delivery("ok"), _delivery("late"), _delivery("slow")
    holdings.add(ok_d, late_d, slow_d)  # taken: held until answered
    outcomes.settle(ok_d, "ok", _done("done"), None)  # type: ignore[arg-type]
    outcomes.settle(late_d, "late", _done(exc=RequestExpired(  # type: ignore[arg-type]
        "request late: expired before it reached the device")), None)
    outcomes.settle(slow_d, "slow", _done(exc=SoftTimeLimit(  # type: ignore[arg-type]
        "request slow: soft time limit")), None)
    ok, late, slow = writer.put_outcomes
    assert (ok.state, ok.result) == (states.SUCCESS, {"id": "ok", "by": "w@h"})
    assert late.state == states.REVOKED and isinstance(late.result, TaskRevokedError)
    assert str(late.result) == "request late: expired before it reached the device"
    assert slow.state == states.FAILURE and isinstance(slow.result, SoftTimeLimitExceeded)


def test_a_response_that_cannot_be_built_is_that_requests_failure() -> None:
    writer, holdings = _Writer(), Holdings(8)
    policy = Policy(retry=RetryPolicy(max_retries=0), time_limits=TimeLimits(), max_in_flight=8)

    def broken(request: Any, done: Any, hostname: str) -> Any:
        raise ValueError("cannot encode")

    outcomes = Outcomes(writer, Settlement("w@h", "cpu", policy), holdings,  # type: ignore[arg-type]
                        response=broken)
    d = _delivery("r")
    holdings.add(d)
    outcomes.settle(d, "r", _done("done"), None)  # type: ignore[arg-type]
    [failed] = writer.put_outcomes
    assert failed.state == states.FAILURE and str(failed.result) == "cannot encode"


def test_a_request_given_up_meanwhile_is_not_answered_here() -> None:
    # its lease went to another worker, which runs it (pipeline.forget released it)
    outcomes, writer, holdings, _ = _outcomes(max_retries=0)
    d = _delivery("gone")
    holdings.add(d)
    holdings.release([d])
    outcomes.settle(d, "gone", _done(exc=SoftTimeLimit("request gone: soft time limit")),  # type: ignore[arg-type]
                    None)
    assert writer.put_outcomes == []


def test_written_outcomes_are_no_longer_held() -> None:
    outcomes, writer, holdings, _ = _outcomes()
    d = _delivery()
    holdings.add(d)
    outcomes.acknowledge(d)
    outcomes.written(writer.put_outcomes)
    assert holdings.in_flight == 0 and holdings.held() == []
