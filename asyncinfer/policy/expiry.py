"""Deadlines and revocation, one policy: a request waits for its ``eta`` (a retry's backoff), is
revoked when the worker was told so (Celery's ``revoke``, kept in its worker state), and expires
past its ``expires``; a request that runs carries the seconds it has left into the batcher, which
drops it if they pass before its batch starts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery.exceptions import TaskRevokedError
from celery.worker import state as worker_state

from asyncinfer.policy.admission import DELAY, EXPIRED, GO, REVOKED, RUN, Admission
from asyncinfer.wire.envelope import seconds_until

__all__ = ["Expiry", "is_revoked"]


def is_revoked(request_id: str) -> bool:
    """Whether this worker was told to revoke ``request_id`` (Celery's ``revoke``, kept by its
    worker state, on both consumers)."""
    return request_id in worker_state.revoked


class Expiry:
    """Holds a request until its ``eta``, revokes what ``revoked(request_id)`` says, expires what is
    past its ``expires``."""

    def __init__(self, revoked: Callable[[str], bool] = is_revoked) -> None:
        self.revoked = revoked

    @staticmethod
    def delay(eta: Any) -> Admission | None:
        """DELAY while ``eta`` (not yet waited for) is ahead; else None."""
        if eta:
            delay_s = seconds_until(eta)
            if delay_s is not None and delay_s > 0:
                return Admission(DELAY, delay_s=delay_s)
        return None

    def judge(self, request_id: str, expires: Any) -> Admission:
        """REVOKED or EXPIRED, else RUN with the seconds left until ``expires``."""
        if self.revoked(request_id):
            return Admission(REVOKED, error=TaskRevokedError("revoked"))
        left_s = seconds_until(expires)
        if left_s is None:
            return GO
        if left_s <= 0:
            return Admission(EXPIRED, error=TaskRevokedError("expired"))
        return Admission(RUN, expires_in_s=left_s)
