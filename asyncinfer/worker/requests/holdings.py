"""What a fast consumer holds: every message it took and has not yet answered, in one account.

A message is held from the take that recorded it until the write that stores its result and
acknowledges it. While held it is one of:

- ``reserved``: taken, not yet handed to the device (being decoded, or waiting in the batcher);
- ``active``: handed to the model's runner;
- ``scheduled``: a retry waiting for its ``eta``, outside the in-flight bound (as Celery's worker
  holds ETA tasks).

``in_flight`` (what the bound ``max_in_flight`` counts, and the metrics' gauge) is the number held
and not scheduled. Everything held goes back to its queue at shutdown or when the device wedges.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncinfer.constants import PRIORITY_SEP
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.wire.envelope import priority_in
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["Holding", "Holdings", "RESERVED", "ACTIVE", "SCHEDULED"]

RESERVED, ACTIVE, SCHEDULED = "reserved", "active", "scheduled"


@dataclass
class Holding:
    """One held message and where it stands."""

    delivery: TakenMessage
    state: str = RESERVED
    #: ``time.time()`` when it was handed to the device (Celery's ``time_start``).
    started_at: float | None = None
    #: Whether a batch with it went onto the device (its model ran, or runs, on it).
    launched: bool = False
    #: Whether a request of the best priority may go before it (:func:`_below_best`, read once).
    below_best: bool = False


def _below_best(d: TakenMessage) -> bool:
    """Whether a request of the best priority may go before ``d`` in the batcher: ``d`` came from
    a list below its queue's top one (a lower level, a sequence's list) or has a priority > 0."""
    return PRIORITY_SEP in d.list_key or priority_in(d.envelope.get("properties")) > 0


class Holdings:
    """The one in-flight account of a consumer, safe to use from any thread."""

    def __init__(self, max_in_flight: int | Callable[[], int],
                 on_scheduled: Callable[[int], None] | None = None,
                 least_take: Callable[[int], int] | None = None) -> None:
        #: The bound: a number, or asked each time (it follows the device's pace).
        self._bound = max_in_flight if callable(max_in_flight) else (lambda: max_in_flight)
        #: The least room a take waits for under a bound (policy/backpressure.py): 1 unless told,
        #: and 1 while anything below a queue's top priority level is held (:meth:`reserve`).
        self._least_take = least_take or (lambda bound: 1)
        #: How many held messages a request of the best priority may go before (:func:`_below_best`).
        self._held_below_best = 0
        #: Told ``+1`` when a held message kombu delivered starts waiting for its eta, ``-1`` when
        #: it no longer does (kombu's prefetch window grows and shrinks with them, as Celery's
        #: does for its ETA tasks).
        self._on_scheduled = on_scheduled
        self._held: dict[int, Holding] = {}
        #: TakenMessage tags by request ID, for what goes onto the device (the leases' marks).
        self._tags: dict[str, str] = {}
        #: What is held, by request ID (one request may be held twice: a duplicate delivery), so
        #: that a batch's launch marks its requests without a look at everything held.
        self._by_request: dict[str, list[Holding]] = {}
        self._in_flight = 0
        #: Room reserved by takes under way (:meth:`reserve`): several intakes, one bound.
        self._reserved = 0
        self._cond = threading.Condition()

    @property
    def max_in_flight(self) -> int:
        return self._bound()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def add(self, *deliveries: TakenMessage) -> None:
        """Hold ``deliveries`` (taken); each counts towards the bound."""
        with self._cond:
            for d in deliveries:
                if id(d) not in self._held:
                    holding = self._held[id(d)] = Holding(d, below_best=_below_best(d))
                    self._by_request.setdefault(d.request_id, []).append(holding)
                    self._in_flight += 1
                    if holding.below_best:
                        self._held_below_best += 1
                    if d.tag and d.request_id and d.message is None:  # the lists' bookkeeping
                        self._tags[d.request_id] = d.tag

    def start(self, d: TakenMessage) -> None:
        """``d`` is handed to the device."""
        with self._cond:
            holding = self._held.get(id(d))
            if holding is not None:
                holding.state, holding.started_at = ACTIVE, time.time()

    def launched(self, request_ids: set[str]) -> None:
        """The requests ``request_ids`` go onto the device in a batch."""
        by_request = self._by_request
        with self._cond:
            for request_id in request_ids:
                for holding in by_request.get(request_id, ()):
                    holding.launched = True

    def settle(self, but: set[str], timeout_s: float) -> int:
        """Wait up to ``timeout_s`` until every request that went onto the device, but those of
        ``but``, is answered and acknowledged; how many still are not. Before a batch that runs
        alone (a request in it saw a worker die) launches: should it kill the worker again, no
        request that ran before it runs once more for want of its stored answer."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                left = sum(1 for h in self._held.values()  # a retry waiting for its eta: not
                           if h.launched and h.state != SCHEDULED  # until it runs again
                           and h.delivery.request_id not in but)
                if not left or time.monotonic() >= deadline:
                    return left
                self._cond.wait(max(0.0, deadline - time.monotonic()))

    def schedule(self, d: TakenMessage) -> None:
        """``d`` waits for its ``eta``: still held, no longer counted."""
        self._move(d, SCHEDULED, -1)

    def resume(self, d: TakenMessage) -> None:
        """``d``'s ``eta`` came: counted again."""
        self._move(d, RESERVED, +1)

    def _move(self, d: TakenMessage, state: str, count: int) -> None:
        with self._cond:
            holding = self._held.get(id(d))
            if holding is None or (holding.state == SCHEDULED) == (state == SCHEDULED):
                return
            holding.state = state
            holding.launched = False  # a retry: it goes onto the device again, or waits to
            self._in_flight += count
            self._cond.notify_all()
        if self._on_scheduled is not None and d.message is not None:
            self._on_scheduled(-count)

    def release(self, deliveries: list[TakenMessage]) -> None:
        """``deliveries`` are answered and acknowledged: no longer held."""
        scheduled = 0
        with self._cond:
            for d in deliveries:
                holding = self._held.pop(id(d), None)
                if holding is not None:
                    self._unindex(holding)
                    if holding.below_best:
                        self._held_below_best -= 1
                if holding is not None and holding.state != SCHEDULED:
                    self._in_flight -= 1
                elif holding is not None and d.message is not None:
                    scheduled += 1
                if holding is not None and self._tags.get(d.request_id) == d.tag:
                    del self._tags[d.request_id]
            self._cond.notify_all()
        if scheduled and self._on_scheduled is not None:
            self._on_scheduled(-scheduled)

    def _unindex(self, holding: Holding) -> None:
        request_id = holding.delivery.request_id
        same = self._by_request.get(request_id)
        if same is None:
            return
        same[:] = [h for h in same if h is not holding]
        if not same:
            del self._by_request[request_id]

    def room(self, stopping: Callable[[], bool], poll_s: float = 0.5) -> int:
        """Wait until fewer than ``max_in_flight`` are in flight or reserved (or ``stopping()``);
        the room."""
        with self._cond:
            while self._in_flight + self._reserved >= (bound := self._bound()) and not stopping():
                self._cond.wait(poll_s)
            return bound - self._in_flight - self._reserved

    def reserve(self, stopping: Callable[[], bool], poll_s: float = 0.5, *, shares: int = 1) -> int:
        """:meth:`room` (at most a ``shares``-th of the bound), once it is at least the least take,
        reserved for one take: no other take counts on it until :meth:`unreserve` gives it back
        (after what the take brought is held). The worker's intakes (one per shard, ``shares`` of
        them) share the bound this way, each take's round trip its own: a shard's master that is
        slow or frozen holds up no other shard's take.

        The least take is ``least_take(bound)`` while everything held is of the best priority (0, on
        its queue's top list), and 1 (a take at each answer) while anything else is held: a request
        waiting with a better priority than something held may go before it, and is taken at the
        next answer. A request of the best priority goes before nothing held (the batcher runs a
        priority in arrival order), so a take may wait for more room at no request's cost (the
        consumer's ``least_take`` is 1 for a worker of several models: one model's request may not
        wait for another's backlog)."""
        with self._cond:
            while (self._in_flight + self._reserved
                   > (bound := self._bound()) - self._least(bound)) and not stopping():
                self._cond.wait(poll_s)
            room = max(0, min(bound - self._in_flight - self._reserved, -(-bound // shares)))
            self._reserved += room
            return room

    def _least(self, bound: int) -> int:
        return 1 if self._held_below_best else self._least_take(bound)

    def unreserve(self, count: int) -> None:
        """Give back ``count`` reserved by :meth:`reserve`."""
        if count:
            with self._cond:
                self._reserved -= count
                self._cond.notify_all()

    def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for nothing to be in flight; how many still are."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self._in_flight

    def holds(self, d: TakenMessage) -> bool:
        """Whether ``d`` is held (taken, not yet answered nor given up)."""
        return id(d) in self._held

    def held(self) -> list[Holding]:
        """A snapshot of what is held."""
        with self._cond:
            return list(self._held.values())

    def tags(self, shard: int = 0) -> list[str]:
        """The delivery tags of everything held from the Redis lists of ``shard`` (what its
        leases renew)."""
        with self._cond:
            return [h.delivery.tag for h in self._held.values()
                    if h.delivery.tag and h.delivery.message is None and h.delivery.shard == shard]

    def tags_of(self, items: Sequence[WorkItem]) -> list[tuple[str, str, WorkItem]]:
        """(delivery tag, request ID, item) of each of ``items`` whose request is held under a tag."""
        tags = self._tags
        return [(tags[i.request.id], i.request.id, i) for i in items if i.request.id in tags]

    def find(self, request_id: str) -> TakenMessage | None:
        """The held message of ``request_id``, if any."""
        with self._cond:
            same = self._by_request.get(request_id)
            return same[0].delivery if same else None
