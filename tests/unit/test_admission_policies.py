"""The admission policies alone (policy/expiry.py, policy/task_policy.py's allow-list,
policy/deaths.py): each one's verdicts, and the order both consumers ask them in
(lifecycle.admit)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery.exceptions import TaskRevokedError

from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import InvalidRequest, WorkerLost
from asyncinfer.policy.admission import DELAY, EXPIRED, REFUSED, REVOKED, RUN
from asyncinfer.policy.deaths import WorkerDeaths
from asyncinfer.policy.expiry import Expiry
from asyncinfer.policy.task_policy import allow_infer_only
from asyncinfer.worker.lifecycle import admit


def _iso(delta_s: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=delta_s)).isoformat()


def test_expiry_holds_until_the_eta_then_revokes_or_expires_or_runs_with_what_is_left() -> None:
    expiry = Expiry(revoked=lambda request_id: request_id == "gone")
    held = expiry.delay(_iso(20))
    assert held is not None and held.verdict == DELAY and 19 < held.delay_s <= 20.5
    assert expiry.delay(_iso(-1)) is None and expiry.delay(None) is None
    revoked = expiry.judge("gone", _iso(60))
    assert revoked.verdict == REVOKED and isinstance(revoked.error, TaskRevokedError)
    expired = expiry.judge("late", _iso(-1))
    assert expired.verdict == EXPIRED and str(expired.error) == "expired"
    running = expiry.judge("ok", _iso(30))
    assert running.verdict == RUN and running.expires_in_s is not None \
        and 29 < running.expires_in_s <= 30.5
    assert expiry.judge("ok", None).verdict == RUN and expiry.judge("ok", None).expires_in_s is None


def test_the_allow_list_of_an_infer_queue_refuses_every_other_task_naming_the_rule() -> None:
    assert allow_infer_only("r", TASK_NAME, "infer.m") is None
    refused = allow_infer_only("r", "celery.map", "infer.m")
    assert refused is not None and refused.verdict == REFUSED
    assert isinstance(refused.error, InvalidRequest)
    assert str(refused.error) == ("request r: task 'celery.map' is refused: only asyncinfer.infer "
                                  "is served on queue infer.m")


def test_deaths_isolate_a_request_then_fail_it_for_good() -> None:
    deaths = WorkerDeaths(max_deaths=2)
    assert deaths.judge("r", 0) is None and not deaths.alone(0)
    assert deaths.judge("r", 1) is None and deaths.alone(1)  # runs, with the device to itself
    lost = deaths.judge("r", 2)
    assert lost is not None and lost.verdict == REFUSED and isinstance(lost.error, WorkerLost)
    assert "died 2 times" in str(lost.error) and "ASYNCINFER_MAX_WORKER_DEATHS=2" in str(lost.error)
    assert WorkerDeaths(0).judge("r", 9) is None  # not counted


def test_a_first_death_reruns_the_batch_a_second_isolates_the_request() -> None:
    from asyncinfer.config.settings import Settings

    deaths = WorkerDeaths(Settings().max_worker_deaths)  # the default bound, 3
    assert deaths.max_deaths == 3
    assert [(deaths.suspect(n), deaths.alone(n)) for n in range(3)] == [
        (False, False), (True, False), (False, True)]
    assert deaths.judge("r", 2) is None
    lost = deaths.judge("r", 3)
    assert lost is not None and "died 3 times" in str(lost.error)
    # with no room for a rerun below 3, alone after the first
    assert not WorkerDeaths(2).suspect(1) and WorkerDeaths(2).alone(1)


def test_admission_asks_the_eta_first_then_the_allow_list_then_revocation_and_expiry() -> None:
    gone = lambda request_id: True  # noqa: E731 - revoked, whatever else
    assert admit("r", "other", "infer.m", eta=_iso(10), revoked=gone).verdict == DELAY
    assert admit("r", "other", "infer.m", revoked=gone).verdict == REFUSED
    assert admit("r", TASK_NAME, "infer.m", expires=_iso(-1), revoked=gone).verdict == REVOKED
    assert admit("r", TASK_NAME, "infer.m", expires=_iso(-1),
                 revoked=lambda request_id: False).verdict == EXPIRED
