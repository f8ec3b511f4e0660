"""Retries, one policy: which failures are retried and how long each retry waits (Celery's task
options, read once), within the fleet's retry budget (:class:`Retries`).

``asyncinfer.infer`` carries Celery's own retry options — ``autoretry_for``, ``max_retries``,
``retry_backoff``, ``retry_backoff_max``, ``retry_jitter`` — set from ``ASYNCINFER_*`` settings
and overridable as Celery users do (``task_annotations``). Both consumers read them into one
:class:`RetryPolicy`, and decide through the worker's one :class:`Retries` (its policy's), so a
retry is decided the same way on each; the backoff is in fractions of a second (Celery's own
autoretry rounds to whole seconds).

Transient (retried): :class:`~asyncinfer.errors.TransientError` (a model may raise it), device
out-of-memory, device runtime errors and lost connections (wrapped as
:class:`~asyncinfer.errors.TransientModelError`), Celery's ``SoftTimeLimitExceeded``. Never
retried: bad input (:class:`~asyncinfer.errors.InvalidRequest`) and other model errors.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded

from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.engine.failures import TRANSIENT_CAUSES
from asyncinfer.errors import InvalidRequest, RetryBudgetExhausted, TransientError

__all__ = ["AUTORETRY_FOR", "RetryPolicy", "Retries", "is_transient", "retry_budget_for"]

#: What ``asyncinfer.infer`` retries by default.
AUTORETRY_FOR: tuple[type[BaseException], ...] = (TransientError, SoftTimeLimitExceeded)

#: The engine's transient causes, and the broker client's lost connections (a model that calls
#: out to a store that went away).
_TRANSIENT_CAUSES: tuple[type[BaseException], ...] = (*TRANSIENT_CAUSES, redis.ConnectionError,
                                                      redis.TimeoutError)


def is_transient(exc: BaseException) -> bool:
    """Whether a model's exception is worth retrying (see the module documentation)."""
    return isinstance(exc, (TransientError, *_TRANSIENT_CAUSES))


@dataclass(frozen=True)
class RetryPolicy:
    """Celery's retry options of one task."""

    autoretry_for: tuple[type[BaseException], ...] = AUTORETRY_FOR
    max_retries: int | None = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 600.0
    jitter: bool = True

    @classmethod
    def of_task(cls, task: Any) -> RetryPolicy:
        """The options of ``task`` (a Celery task, after annotations)."""
        backoff = getattr(task, "retry_backoff", False)
        return cls(autoretry_for=tuple(getattr(task, "autoretry_for", ()) or ()),
                   max_retries=getattr(task, "max_retries", 3),
                   backoff_s=1.0 if backoff is True else float(backoff or 0.0),
                   backoff_max_s=float(getattr(task, "retry_backoff_max", 600)),
                   jitter=bool(getattr(task, "retry_jitter", True)))

    def should_retry(self, exc: BaseException, retries: int) -> bool:
        """Whether a request that failed with ``exc`` after ``retries`` retries goes again."""
        if isinstance(exc, InvalidRequest) or not self.autoretry_for:
            return False
        if not isinstance(exc, self.autoretry_for):
            return False
        return self.max_retries is None or retries < self.max_retries

    def countdown_s(self, retries: int, rng: random.Random | None = None) -> float:
        """Seconds before retry number ``retries + 1``: exponential backoff, full jitter."""
        if self.backoff_s <= 0:
            return 0.0
        ceiling = min(self.backoff_max_s, self.backoff_s * (2 ** retries))
        return (rng or random).uniform(0.0, ceiling) if self.jitter else ceiling


class Retries:
    """The one place a retry is decided, on both consumers: the task's retry ``options`` say
    whether a failure goes again and after which backoff (:meth:`countdown_s`, as it fails); the
    fleet's ``budget`` says whether it may (:meth:`refused`, one round trip for all the retries
    of a written batch, just before the write)."""

    def __init__(self, options: RetryPolicy, budget: Any = None) -> None:
        self.options = options
        #: The fleet's :class:`~asyncinfer.policy.retry_budget.RetryBudget` (None: not budgeted).
        self.budget = budget

    def countdown_s(self, exc: BaseException, retries: int) -> float | None:
        """Seconds before a request that failed with ``exc`` after ``retries`` retries runs again,
        or None when it is not retried (the task's retry options)."""
        if not self.options.should_retry(exc, retries):
            return None
        return self.options.countdown_s(retries)

    def refused(self, request_ids: list[str],
                causes: list[BaseException]) -> list[RetryBudgetExhausted | None]:
        """Ask the fleet's retry budget for these retries (one round trip); for each, None when it
        is granted, else the final error it fails with."""
        budget = self.budget
        if budget is None or not request_ids:
            return [None] * len(request_ids)
        decision = budget.spend(len(request_ids))
        refused: list[RetryBudgetExhausted | None] = []
        for i, (request_id, cause) in enumerate(zip(request_ids, causes, strict=True)):
            if i < decision.granted:
                refused.append(None)
                continue
            err = RetryBudgetExhausted(f"request {request_id}: not retried after "
                                       f"{type(cause).__name__}: {cause}: {budget.describe(decision)}")
            err.__cause__ = cause
            refused.append(err)
        return refused

    def count_first_attempts(self, n: int) -> None:
        """Count ``n`` first attempts towards the budget (what it grants retries against)."""
        if self.budget is not None and n:
            self.budget.count_requests(n)


def retry_budget_for(app: Celery) -> Any:
    """A :class:`~asyncinfer.policy.retry_budget.RetryBudget` for a worker of ``app`` (on the
    result backend's Redis; the budget itself is the fleet's, kept there)."""
    from asyncinfer.policy.retry_budget import RetryBudget

    settings = settings_of(app) or Settings.from_env()
    return RetryBudget(app.backend.client, ratio=settings.retry_budget_ratio,
                       minimum=settings.retry_budget_min, window_s=settings.retry_budget_window_s)
