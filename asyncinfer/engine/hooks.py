"""What a model runner tells its owner, and what it does when nobody listens.

The runner calls these at fixed points of a batch's life; the worker passes its own (the fast
consumer's leases mark a batch going onto the device, the metrics record each finished batch, the
worker replaces a wedged process). The defaults here do nothing, or fail the request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.delivery import settle

__all__ = ["LaunchObserver", "WedgedHandler", "ignore_batch", "ignore_launch", "settle_wedged"]

#: Called when a request's hard time limit passes while its batch is on the device.
WedgedHandler = Callable[[WorkItem, BaseException], None]
#: Called with a batch's items on the device thread just before the batch goes onto the device.
LaunchObserver = Callable[[Sequence[WorkItem]], None]


def ignore_launch(items: Sequence[WorkItem]) -> None:
    """No one hears of batches going onto the device."""


def ignore_batch(model: str, device: str, rows: int, compute_s: float,
                 waits_s: Sequence[float]) -> None:
    """No one hears of finished batches."""


def settle_wedged(item: WorkItem, exc: BaseException) -> None:
    """Default for a wedged device when no worker handles it: fail the request."""
    settle(item.future, exc=exc)
