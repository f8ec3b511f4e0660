"""Celery's soft and hard time limits, honoured by a device worker that runs no prefork pool.

Celery enforces ``soft_time_limit``/``time_limit`` only in its prefork pool (by signals), and a
signal could not interrupt device work anyway. Here the limits are watched by the worker's
:class:`~asyncinfer.engine.timer.Timer` and counted from the moment the worker took the request
(its STARTED state):

- soft limit: the request fails with Celery's ``SoftTimeLimitExceeded`` (a transient failure, so
  it is retried under the retry policy); its rows, if they are on the device, are dropped when
  the batch comes back;
- hard limit: a request still waiting fails with Celery's ``TimeLimitExceeded``; one whose batch
  is still on the device means the device is wedged — the request fails with
  ``TimeLimitExceeded`` and the worker process exits so that its supervisor replaces it, and the
  requests it held go back to their queues.

The limits come from the message (``apply_async(soft_time_limit=..., time_limit=...)``, header
``timelimit``), else the task's options (``task_annotations``), else ``task_soft_time_limit`` /
``task_time_limit`` (``ASYNCINFER_SOFT_TIME_LIMIT_S`` / ``ASYNCINFER_TIME_LIMIT_S``).
The value, :class:`~asyncinfer.engine.timer.TimeLimits`, is the engine's, which enforces it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.timer import TimeLimits

__all__ = ["time_limits_of", "Departure", "EXIT_WEDGED", "NO_LIMITS", "Wedge"]

log = logging.getLogger(__name__)

#: The exit status of a worker process that left because its device was wedged.
EXIT_WEDGED = 75


class Departure:
    """A worker process leaving because its device can no longer serve (wedged or hung): once,
    whoever sees it first (:meth:`first`), then with :data:`EXIT_WEDGED` after ``exit_after_s``
    (time for a writer to store what it must; 0: at once), so that its supervisor starts a fresh
    one."""

    def __init__(self, exit_after_s: float = 0.0, leave: Callable[[int], Any] = os._exit) -> None:
        self.exit_after_s = exit_after_s
        self.leave = leave
        self._lock = threading.Lock()
        self._seen = False

    def first(self) -> bool:
        """True for the first caller only."""
        with self._lock:
            if self._seen:
                return False
            self._seen = True
            return True

    def go(self) -> None:
        if self.exit_after_s > 0:
            timer = threading.Timer(self.exit_after_s, self._leave)
            timer.daemon = True
            timer.start()
        else:
            self._leave()

    def _leave(self) -> None:
        logging.shutdown()
        self.leave(EXIT_WEDGED)


class Wedge:
    """A request's hard time limit passed while its batch was still on the device: the device is
    wedged. The request fails (``fail(item, exc)``: stored as its transport stores answers), what
    the worker holds goes back (``give_back()``: the fast consumer's held requests to their
    queues at once; kombu's, the broker redelivers), and the process leaves (:class:`Departure`).
    Once per process, whichever request saw it first."""

    def __init__(self, fail: Callable[[WorkItem, BaseException], None],
                 give_back: Callable[[], None] = lambda: None, *, exit_after_s: float = 0.0,
                 leave: Callable[[int], Any] = os._exit) -> None:
        self.fail = fail
        self.give_back = give_back
        self.departure = Departure(exit_after_s, leave)

    def __call__(self, item: WorkItem, exc: BaseException) -> None:
        self.fail(item, exc)
        if not self.departure.first():
            return
        log.critical("the device is wedged (%s); this worker process exits to be replaced", exc)
        self.give_back()
        self.departure.go()


NO_LIMITS = TimeLimits()


def _positive(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def time_limits_of(timelimit: Any, task: Any = None, conf: Any = None, *,
                   defaults: TimeLimits | None = None) -> TimeLimits:
    """The limits of one request: its ``timelimit`` header ``[hard, soft]`` (Celery's order),
    else ``defaults`` when given, else ``task``'s ``time_limit``/``soft_time_limit``, else
    ``conf``'s task defaults."""
    hard = soft = None
    if isinstance(timelimit, (list, tuple)) and len(timelimit) == 2:
        hard, soft = _positive(timelimit[0]), _positive(timelimit[1])
    if defaults is not None:
        hard = defaults.hard_s if hard is None else hard
        soft = defaults.soft_s if soft is None else soft
    if hard is None:
        hard = _positive(getattr(task, "time_limit", None)) or _positive(
            getattr(conf, "task_time_limit", None))
    if soft is None:
        soft = _positive(getattr(task, "soft_time_limit", None)) or _positive(
            getattr(conf, "task_soft_time_limit", None))
    return TimeLimits(soft, hard) if (soft or hard) else NO_LIMITS
