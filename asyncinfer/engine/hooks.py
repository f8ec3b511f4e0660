"""What a model runner tells its owner, and what it does when nobody listens.

The runner calls these at fixed points of a batch's life; the worker passes its own (the fast
consumer's leases mark a batch going onto the device, the metrics record each finished batch, the
worker replaces a wedged process). The defaults here do nothing, or fail the request.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.completion import settle
from asyncinfer.engine.hangs import Hung, HungHandler

__all__ = ["DeviceHooks", "LaunchGate", "LaunchObserver", "WedgedHandler", "admit_all",
           "ignore_batch", "ignore_hung", "ignore_launch", "settle_wedged"]

#: Called when a request's hard time limit passes while its batch is on the device.
WedgedHandler = Callable[[WorkItem, BaseException], None]
#: Called with a batch's items on the device thread just before the batch goes onto the device.
LaunchObserver = Callable[[Sequence[WorkItem]], None]
#: Called with a batch's items before it is prepared for the device: those that may run (it may
#: block: worker/requests/lease_gate.py).
LaunchGate = Callable[[Sequence[WorkItem]], list[WorkItem]]


def ignore_launch(items: Sequence[WorkItem]) -> None:
    """No one hears of batches going onto the device."""


def admit_all(items: Sequence[WorkItem]) -> list[WorkItem]:
    """Every request of a batch may run."""
    return list(items)


def ignore_batch(model: str, device: str, rows: int, compute_s: float,
                 waits_s: Sequence[float], phases_s: tuple[float, float, float]) -> None:
    """No one hears of finished batches."""


def ignore_hung(hung: Hung) -> None:
    """No one acts on a hang (the watch logged it): the batch stays on the device."""


def settle_wedged(item: WorkItem, exc: BaseException) -> None:
    """Default for a wedged device when no worker handles it: fail the request."""
    settle(item.future, exc=exc)


@dataclass(frozen=True)
class DeviceHooks:
    """What the runners of a device tell whoever serves its requests, together: given at once
    (:meth:`~asyncinfer.worker.runtime.WorkerRuntime.use`), never one by one."""

    #: A request's hard time limit passed while its batch was on the device.
    on_wedged: WedgedHandler = settle_wedged
    #: What each batch's requests are settled inside (a result writer gathers them: one write).
    settling: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
    #: A batch goes onto the device (the leases mark it, so a death counts against it).
    on_launch: LaunchObserver = ignore_launch
    #: Which of a batch's requests are still this worker's to run (the leases' launch gate).
    admit: LaunchGate = admit_all
    #: A batch stayed on the device past the hang limit (engine/hangs.py): once per runner.
    on_hung: HungHandler = ignore_hung
    #: A batch stayed on the device past the stall limit (engine/hangs.py): once per batch.
    on_stalled: HungHandler = ignore_hung
