"""A hung device, found without a time limit (engine/hangs.py), treated as a death of its batch.

When a batch stays on the device past the hang limit, the worker process:

1. notes the hang against each request of the hung batch (``note``: the broker keeps the line
   for as long as it keeps death counts), so that the request that fails for good names it;
2. gives back at once everything it holds that is not on the device (``give_back(keep)``: it
   takes no more, writes what finished, and sends the rest back to their queues unmarked, for any
   worker), and keeps what is on the device;
3. leaves with :data:`~asyncinfer.policy.time_limits.EXIT_WEDGED` (``Departure``), so that its
   supervisor starts a fresh one.

What it kept is still leased to it and marked as on its device: once the process is gone, the
fleet's lease sweep (or its successor on the same host, at start) puts those requests back and
counts a worker death against each (broker/leases.py); the note makes it count as two
(policy/deaths.py). A request that hangs every device therefore runs alone after the first hang
and fails with ``WorkerLost`` at the second (``ASYNCINFER_MAX_WORKER_DEATHS``, 3), its error
naming the hang; its batch-mates run again, each alone. Once per process.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from asyncinfer.engine.hangs import Hung
from asyncinfer.policy.time_limits import Departure

__all__ = ["Hang"]

log = logging.getLogger(__name__)


class Hang:
    """What a worker does about a hung batch (see the module)."""

    def __init__(self, note: Callable[[Hung], None], give_back: Callable[[set[str]], None], *,
                 exit_after_s: float = 2.0, leave: Callable[[int], Any] = os._exit) -> None:
        self.note = note
        self.give_back = give_back
        self.departure = Departure(exit_after_s, leave)

    def __call__(self, hung: Hung) -> None:
        if not self.departure.first():
            return
        log.critical("the device hung (%s); this worker process gives back what it had not "
                     "started and exits to be replaced; a death is counted against the %d "
                     "request(s) on the device", hung.describe(), len(hung.on_device))
        for step in (lambda: self.note(hung),
                     lambda: self.give_back({item.request.id for item in hung.on_device})):
            try:
                step()
            except Exception:  # noqa: BLE001 - it leaves either way; the leases give all back
                log.exception("while leaving a hung device")
        self.departure.go()
