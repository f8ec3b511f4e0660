"""How long to wait before trying again after failures in a row: 0.1 s doubling to 5 s.

Every loop that must outlive Redis failing — the consumer, the result writer, the watchers, the
leases, the client's result watcher, kombu's channel — waits the same way, so one class says how.
"""

from __future__ import annotations

import time

__all__ = ["Backoff"]


class Backoff:
    """Seconds to wait after each failure in a row, from ``first_s`` doubling to ``most_s``;
    a success (:meth:`reset`) starts again from ``first_s``."""

    def __init__(self, first_s: float = 0.1, most_s: float = 5.0) -> None:
        self.first_s, self.most_s = first_s, most_s
        #: What the next failure waits.
        self.next_s = first_s
        #: Until when (monotonic) the last failure's wait lasts.
        self.until = 0.0

    def failed(self) -> float:
        """One more failure in a row: how long to wait now (the next wait doubles)."""
        wait_s = self.next_s
        self.until = time.monotonic() + wait_s
        self.next_s = min(wait_s * 2, self.most_s)
        return wait_s

    def reset(self) -> None:
        """A success: the next failure waits ``first_s`` again."""
        self.next_s, self.until = self.first_s, 0.0

    @property
    def waiting(self) -> bool:
        """Whether the last failure's wait is still running."""
        return time.monotonic() < self.until
