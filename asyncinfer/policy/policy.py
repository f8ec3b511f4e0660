"""One policy object: every rule a device worker applies to ``asyncinfer.infer`` requests.

Built once per worker from its settings and the task's options (after ``task_annotations``), and
passed explicitly to both consumers (the fast consumer, and Celery's stock path through the task
and its signals):

- **retries**: which failures are retried and after which backoff (:class:`RetryPolicy`), within
  the fleet's retry budget (:class:`~asyncinfer.policy.retry_budget.RetryBudget`);
- **time limits**: the soft and hard defaults (the task's, else ``task_*_time_limit``), which a
  message's own ``timelimit`` overrides (:meth:`Policy.limits_for`);
- **deadlines**: a message's ``expires`` (admission, :mod:`asyncinfer.worker.lifecycle`);
- **backpressure**: at most ``max_in_flight`` requests taken and unanswered (concurrency ×
  prefetch multiplier), bodies of at most ``max_payload_bytes``; the producers' side
  (``max_queue_size``, ``submit_timeout_s``) is the client's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.policy.retries import Retries, RetryPolicy, retry_budget_for
from asyncinfer.policy.time_limits import TimeLimits, time_limits_of

__all__ = ["Policy"]


@dataclass(frozen=True)
class Policy:
    """The rules of one worker (see the module documentation)."""

    retry: RetryPolicy
    time_limits: TimeLimits
    max_in_flight: int
    max_payload_bytes: int | None = None
    track_started: bool = True
    #: The fleet's retry budget (None: retries are not budgeted).
    budget: Any = None

    @cached_property
    def retries(self) -> Retries:
        """The retry decisions: the task's options within the fleet's budget."""
        return Retries(self.retry, self.budget)

    @classmethod
    def of_worker(cls, app: Any, settings: Settings | None = None) -> Policy:
        """The policy of a worker of ``app`` (its settings unless ``settings`` are given)."""
        settings = settings or settings_of(app) or Settings.from_env()
        task = app.tasks.get(TASK_NAME)
        return cls(retry=RetryPolicy.of_task(task) if task is not None else RetryPolicy(max_retries=0),
                   time_limits=time_limits_of(None, task, app.conf),
                   max_in_flight=settings.concurrency * settings.prefetch_multiplier,
                   max_payload_bytes=settings.max_payload_bytes or None,
                   track_started=bool(app.conf.task_track_started),
                   budget=retry_budget_for(app))

    def limits_for(self, timelimit: Any) -> TimeLimits:
        """The limits of a request whose message carries ``timelimit`` (``[hard, soft]``)."""
        if not timelimit or timelimit == [None, None]:
            return self.time_limits
        return time_limits_of(timelimit, defaults=self.time_limits)
