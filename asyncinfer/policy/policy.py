"""The worker's policy: every rule a device worker applies to ``asyncinfer.infer`` requests, the
list of its policies in one place, one module each.

Built once per worker from its settings and the task's options (after ``task_annotations``), and
passed explicitly to its pipeline (worker/pipeline.py), whichever transport feeds it:

- **expiry** (expiry.py): a request waits for its ``eta``, is revoked when revoked, expires past
  its ``expires``;
- **the allow-list** (task_policy.py): only ``asyncinfer.infer`` on an ``infer.*`` queue, the
  stage tasks of hosted models on a stage queue, nothing on the control queue;
- **deaths** (deaths.py): a request that saw a worker die on the device runs alone, and fails with
  ``WorkerLost`` after ``ASYNCINFER_MAX_WORKER_DEATHS``;
- **retries** (retries.py): which failures are retried and after which backoff, within the
  fleet's retry budget (retry_budget.py), decided in one place (:class:`Retries`);
- **time limits** (time_limits.py): the soft and hard defaults (the task's, else
  ``task_*_time_limit``), which a message's own ``timelimit`` overrides (:meth:`Policy.limits_for`);
  the engine enforces them, and a wedged device ends the process (engine/runner.py);
- **backpressure** (backpressure.py): at most ``max_in_flight`` requests taken and unanswered,
  within that what the device starts soon, bodies of at most ``max_payload_bytes``;
- **dead letters** (worker/dead_letters.py): where a model opts in, a request that failed for good
  leaves an entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import TASK_NAME
from asyncinfer.engine.timer import TimeLimits
from asyncinfer.policy.backpressure import Backpressure
from asyncinfer.policy.deaths import WorkerDeaths
from asyncinfer.policy.expiry import Expiry
from asyncinfer.policy.retries import Retries, RetryPolicy, retry_budget_for
from asyncinfer.policy.time_limits import time_limits_of

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
    #: Device batches per instance a consumer holds at least, and seconds of device work it
    #: holds (policy/backpressure.py).
    hold_batches: int = 2
    hold_s: float = 0.25
    #: The share of what it holds at most that a consumer at its bound waits to have free before
    #: it takes again (policy/backpressure.py).
    refill_fraction: float = 0.25
    #: Deadlines and revocation (policy/expiry.py).
    expiry: Expiry = field(default_factory=Expiry)
    #: Deaths on a device a request may see (policy/deaths.py; 0: not counted).
    deaths: WorkerDeaths = field(default_factory=WorkerDeaths)

    @cached_property
    def backpressure(self) -> Backpressure:
        """How much the worker takes and holds."""
        return Backpressure(self.max_in_flight, self.hold_batches, self.hold_s,
                            self.max_payload_bytes, self.refill_fraction)

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
                   budget=retry_budget_for(app), deaths=WorkerDeaths(settings.max_worker_deaths),
                   hold_batches=settings.hold_batches, hold_s=settings.hold_s,
                   refill_fraction=settings.refill_fraction)

    def limits_for(self, timelimit: Any) -> TimeLimits:
        """The limits of a request whose message carries ``timelimit`` (``[hard, soft]``)."""
        if not timelimit or timelimit == [None, None]:
            return self.time_limits
        return time_limits_of(timelimit, defaults=self.time_limits)
