"""The engine's exceptions as Celery users know them.

The engine imports no Celery, so its time limits raise :class:`~asyncinfer.errors.SoftTimeLimit`
and :class:`~asyncinfer.errors.HardTimeLimit`; results and retries speak Celery's
``SoftTimeLimitExceeded`` and ``TimeLimitExceeded``, on both consumers.
"""

from __future__ import annotations

from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from asyncinfer.errors import HardTimeLimit, SoftTimeLimit

__all__ = ["as_celery"]


def as_celery(exc: BaseException) -> BaseException:
    """``exc``, or Celery's own exception for an engine time limit (same message)."""
    if isinstance(exc, SoftTimeLimit):
        return SoftTimeLimitExceeded(str(exc))
    if isinstance(exc, HardTimeLimit):
        return TimeLimitExceeded(str(exc))
    return exc
