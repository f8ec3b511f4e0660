"""The gateway's answer to each error a request raised (gateway/call_errors.py): its status and
words, for the errors the client's futures raise (revokes, Celery's time limits)."""

from __future__ import annotations

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError, TimeLimitExceeded

from asyncinfer.client.responses import revoked_error as client_revoked
from asyncinfer.errors import HardTimeLimit
from asyncinfer.gateway.call_errors import error_for, revoked_error


def test_a_revoke_from_the_client_is_499_naming_the_request_once() -> None:
    for stored, said in [("revoked", "request r-1: revoked"),
                         ("purged", "request r-1: revoked (purged)"),
                         ("request r-1: revoked while model 'm' streamed it",
                          "request r-1: revoked while model 'm' streamed it")]:
        answer = revoked_error("r-1", client_revoked("r-1", stored))
        assert (answer.status, answer.message) == (499, said)
        assert error_for(client_revoked("r-1", stored)).status == 499
    # Celery's own, as before
    assert revoked_error("r-1", TaskRevokedError("revoked")).message == "request r-1: revoked (revoked)"


def test_an_expiry_from_the_client_is_504() -> None:
    expired = client_revoked("r-2", "expired")
    assert isinstance(expired, TaskRevokedError)
    answer = revoked_error("r-2", expired)
    assert (answer.status, answer.message) == (
        504, "request r-2: expired before a worker ran it (parameter 'timeout' or the deadline)")
    assert error_for(expired).status == 504


@pytest.mark.parametrize(("exc", "said"), [
    (TimeLimitExceeded("request r-3: time limit (2 s) exceeded on model 'sleep' (its batch is "
                       "still on the device)"),  # the engine's
     "request r-3: time limit (2 s) exceeded on model 'sleep' (its batch is still on the device)"),
    (TimeLimitExceeded("request r-3: time limit (2 s) exceeded"),  # the pool's, as the client names it
     "request r-3: time limit (2 s) exceeded"),
    (TimeLimitExceeded(2.0), "time limit (2 s) exceeded"),  # never TimeLimitExceeded(2.0,)
    (SoftTimeLimitExceeded(), "soft time limit exceeded"),
    (HardTimeLimit("request r-3: time limit (2 s) exceeded"), "request r-3: time limit (2 s) exceeded"),
])
def test_a_time_limit_is_504_in_words(exc: BaseException, said: str) -> None:
    answer = error_for(exc)
    assert (answer.status, answer.message, answer.grpc_code) == (504, said, "DEADLINE_EXCEEDED")
