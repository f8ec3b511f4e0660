"""Backpressure on the worker's side, one policy: how much a consumer takes and holds.

At most ``max_in_flight`` requests taken and unanswered (concurrency × prefetch multiplier), and
within that what the device starts soon: what its models get through in ``hold_s`` seconds at full
batches (by each runner's measured ``batch_s``), never less than ``hold_batches`` device batches per
instance. A worker that took 128 requests while its slow device starts 32 at a time hoarded: idle
workers beside it had nothing, batches shrank, and its death stranded all 128; a fast device (a
batch in milliseconds) needs more than two batches in hand, or it waits for each take. Bodies are
at most ``max_payload_bytes``. The producers' side (``max_queue_size``, ``submit_timeout_s``) is
the client's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Backpressure", "held_at_most"]


def held_at_most(max_in_flight: int, hold_batches: int, hold_s: float, runners: Sequence[Any]) -> int:
    """How many requests a consumer holds at most, within ``max_in_flight``: what the devices of
    ``runners`` (loaded models) get through in ``hold_s`` seconds at full batches (by each
    runner's ``batch_s``, once a batch ran), and never less than ``hold_batches`` device batches
    per instance; ``max_in_flight`` alone when ``hold_batches`` is 0 or no model is loaded yet."""
    floor = sum(hold_batches * r.max_batch_size * r.options.instances for r in runners)
    if not floor:
        return max_in_flight
    by_time = sum(r.max_batch_size * r.options.instances * hold_s / r.batch_s
                  for r in runners if r.batch_s)
    return max(1, min(max_in_flight, max(floor, int(by_time))))


@dataclass(frozen=True)
class Backpressure:
    """The worker's bounds (see the module documentation)."""

    max_in_flight: int
    hold_batches: int = 2
    hold_s: float = 0.25
    max_payload_bytes: int | None = None

    def held_at_most(self, runners: Sequence[Any]) -> int:
        """How many requests to hold now, for the devices of ``runners``."""
        return held_at_most(self.max_in_flight, self.hold_batches, self.hold_s, runners)
