"""What to do with a request a worker took, before it runs: the verdict each admission policy gives
(:mod:`~asyncinfer.policy.expiry`, the allow-list of :mod:`~asyncinfer.policy.task_policy`,
:mod:`~asyncinfer.policy.deaths`), in one record that both consumers act on."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Admission", "GO", "RUN", "DELAY", "REFUSED", "REVOKED", "EXPIRED"]

RUN, DELAY, REFUSED, REVOKED, EXPIRED = "run", "delay", "refused", "revoked", "expired"


@dataclass(frozen=True)
class Admission:
    """What to do with a request now: its ``verdict``, and the delay or the error that goes with it."""

    verdict: str
    delay_s: float = 0.0
    error: BaseException | None = None
    #: For RUN: seconds left until the request's ``expires`` (None: no deadline).
    expires_in_s: float | None = None


#: Run it, no deadline.
GO = Admission(RUN)
