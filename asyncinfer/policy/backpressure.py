"""Backpressure on the worker's side, one policy: how much a consumer takes and holds.

At most ``max_in_flight`` requests taken and unanswered (concurrency × prefetch multiplier), and
within that what the device starts soon: what its models get through in ``hold_s`` seconds at full
batches (by each runner's measured ``batch_s``), never less than ``hold_batches`` device batches per
instance. A worker that took 128 requests while its slow device starts 32 at a time hoarded: idle
workers beside it had nothing, batches shrank, and its death stranded all 128; a fast device (a
batch in milliseconds) needs more than two batches in hand, or it waits for each take.

A consumer that holds all it may takes again once ``refill_fraction`` of that bound is free, not at
each answer: while a backlog waits, one take brings several requests. What a take costs Redis is
mostly its own (a script call's fixed part: ~165,000 instructions, against ~100,000 a message), so
at one row per device batch a take per answer was over half of Redis' work per request. It costs no
request its place: it applies only while a worker of one model holds nothing below its queue's top
priority level, when a request still in Redis can go before nothing held (a level runs in order),
and the device does not wait for the take (the worker still holds three quarters of its bound at
the defaults). While anything of a lower level is held, or a worker serves several models (one
model's request must not wait for room behind another's backlog), it takes at each answer, and a
higher-priority request cuts in within a batch or two (worker/requests/holdings.py). Bodies are
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
    refill_fraction: float = 0.0

    def held_at_most(self, runners: Sequence[Any]) -> int:
        """How many requests to hold now, for the devices of ``runners``."""
        return held_at_most(self.max_in_flight, self.hold_batches, self.hold_s, runners)

    def least_take(self, bound: int) -> int:
        """The least room a consumer holding at most ``bound`` waits for before it takes:
        ``refill_fraction`` of it, at least 1."""
        return max(1, int(bound * self.refill_fraction))
