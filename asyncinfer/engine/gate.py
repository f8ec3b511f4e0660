"""The device shared by a model's instances, except with a batch that must run alone.

A request that was on the device when its worker died may be what killed it. It runs next in a
device batch of its own, and with the device to itself: were another instance's batch on the
device when it kills again, that batch's requests would count a death they did not cause. A
stream of suspects (engine/streaming.py) holds it alone for its first step only, then shares it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["DeviceGate"]


class DeviceGate:
    """Batches enter together; a batch ``alone`` waits for the device to empty and holds it
    alone. Batches that come while one waits to be alone wait behind it (it is never starved)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._alone_inside = False
        self._alone_waiting = 0

    @contextmanager
    def enter(self, alone: bool = False) -> Iterator[Callable[[], None]]:
        """Hold the device (alone, or with other batches) while inside; gives ``share()``, which
        lets a batch that entered alone share the device from then on (others may enter)."""
        held_alone = alone

        def share() -> None:
            nonlocal held_alone
            with self._cond:
                if held_alone:
                    held_alone = self._alone_inside = False
                    self._cond.notify_all()

        with self._cond:
            if alone:
                self._alone_waiting += 1
                try:
                    while self._inside or self._alone_inside:
                        self._cond.wait()
                finally:
                    self._alone_waiting -= 1
                self._alone_inside = True
            else:
                while self._alone_inside or self._alone_waiting:
                    self._cond.wait()
            self._inside += 1
        try:
            yield share
        finally:
            with self._cond:
                self._inside -= 1
                if held_alone:
                    self._alone_inside = False
                self._cond.notify_all()
