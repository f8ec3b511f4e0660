"""A request's soft and hard time limits, watched on the runner's timer (the rules:
:mod:`asyncinfer.policy.time_limits`).

The soft limit fails the request with :class:`~asyncinfer.errors.SoftTimeLimit` wherever it is;
the hard limit fails a request still waiting with :class:`~asyncinfer.errors.HardTimeLimit`, and one
whose batch is still on the device means the device is wedged: whoever serves the requests is told
(``on_wedged``), and from then on the requests still waiting are left unanswered, to be redelivered
once the process is replaced. A decoupled model's request is checked between its steps
(engine/streaming.py): its hard limit fails it wherever it is, and its row stops at the next step
(a single step that never returns is not caught).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.completion import settle
from asyncinfer.engine.hooks import WedgedHandler
from asyncinfer.engine.timer import TimeLimits, Timer
from asyncinfer.errors import HardTimeLimit, SoftTimeLimit

__all__ = ["LimitWatch"]

log = logging.getLogger(__name__)


class LimitWatch:
    """Watches the time limits of ``model``'s requests on ``timer``; ``on_wedged()`` gives whom to
    tell when a batch overruns its hard limit on the device."""

    def __init__(self, model: str, timer: Timer | None, on_wedged: Callable[[], WedgedHandler],
                 decoupled: bool = False) -> None:
        self.model = model
        #: The model streams (its batches stay on the device step after step).
        self.decoupled = decoupled
        self.timer = timer
        self.on_wedged = on_wedged
        #: Set once a batch overran its hard time limit on the device: the process is being
        #: replaced, and the requests still waiting are left to be redelivered, not failed.
        self.wedged = False

    def watch(self, item: WorkItem, limits: TimeLimits) -> None:
        """Start the clocks of ``item`` (counted from when the worker took it)."""
        if self.timer is None:
            raise RuntimeError(f"model '{self.model}': time limits need the runner's timer")
        elapsed_s = time.perf_counter() - item.received_at
        if limits.soft_s is not None:
            self.timer.call_later(limits.soft_s - elapsed_s, lambda: self._soft_limit(item, limits))
        if limits.hard_s is not None:
            self.timer.call_later(limits.hard_s - elapsed_s, lambda: self._hard_limit(item, limits))

    def _soft_limit(self, item: WorkItem, limits: TimeLimits) -> None:
        settle(item.future, exc=SoftTimeLimit(
            f"request {item.request.id}: soft time limit ({limits.soft_s:g} s) exceeded on model "
            f"'{self.model}' ({'on the device' if item.on_device else 'waiting for the device'})"))

    def _hard_limit(self, item: WorkItem, limits: TimeLimits) -> None:
        if not item.on_device and (item.future.done() or self.wedged):
            return  # answered, or left unanswered for redelivery once the process is replaced
        where = "its batch is still on the device" if item.on_device else "waiting for the device"
        exc = HardTimeLimit(f"request {item.request.id}: time limit ({limits.hard_s:g} s) "
                            f"exceeded on model '{self.model}' ({where})")
        if item.on_device and self.decoupled:  # its row stops at the next step
            settle(item.future, exc=exc)
        elif item.on_device:  # the device has not come back in time: it is wedged
            log.critical("model %s: %s; the device is wedged", self.model, exc)
            self.wedged = True
            self.on_wedged()(item, exc)
        else:
            settle(item.future, exc=exc)
