"""Dynamic batching: gather the requests that arrived close together into one device batch.

A batch takes what is already waiting. It waits for more only while requests are still being
decoded by task threads (they announce themselves with :meth:`Batcher.arriving`), and never past
``max_delay_ms`` after its first request was queued: a lone request on an idle device does not
sit out a fixed delay, and at high load batches fill from what arrived while the device was busy.
A lost batch's rerun (its suspects, policy/deaths.py) waits for those of its requests still being
decoded up to :data:`SUSPECTS_WAIT_S` past the delay: they came back together, and a busy host
must not split it.

**Length-aware.** A batch runs padded to its longest row, so a few long sentences among short
ones make every row cost a long one. When the model says what a row costs (``Model.row_cost``:
MiniLM, its length) a batch is led by the oldest request waiting — no request waits behind
younger ones for long — and filled with the waiting requests whose cost is nearest to it, rather
than in arrival order (``group_by_cost``, on by default for such a model).

**Priorities.** A request's Celery priority (0-9; on Redis 0 is served first) decides which
waiting requests form the next batch: it is led by the oldest request of the best (lowest) level
waiting, and filled from that level first, then the next ones (cost grouping and signatures apply
within a level). Starvation is bounded by the batches that pass a request over: one left waiting
while ``max_priority_passes`` batches went with requests that arrived after it counts as level
0, so it goes ahead of every request that arrived after it, whatever their level. (A bound in
batches, not seconds: a high-priority request still cuts in front of a backlog the worker holds,
however long that backlog has waited, and passes each request of it over once.) When every
waiting request has the same level, batches form as before.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = ["WorkItem", "Batcher", "SUSPECTS_WAIT_S"]

#: How long past ``max_delay_ms`` a lost batch's rerun waits for its requests still being decoded
#: (a bound, for a host so loaded that decoding one take outlasts it: then it splits, as any batch).
SUSPECTS_WAIT_S = 5.0


@dataclass(eq=False)
class WorkItem:
    """One request waiting for the device: its rows and the future its task thread waits on."""

    request: Any
    rows: int
    signature: Hashable
    future: Future[Any] = field(default_factory=Future)
    enqueued_at: float = field(default_factory=time.perf_counter)
    #: When the worker received the request (start of ``queue_ms``); default when queued.
    received_at: float = -1.0
    #: ``time.perf_counter()`` reading after which the request must not run (its ``expires``).
    deadline: float | None = None
    #: Whether the request's batch is on the device (launched, not yet back).
    on_device: bool = False
    #: Whether it runs in a device batch of its own (workers died more than once while it was
    #: on the device: policy/deaths.py).
    alone: bool = False
    #: Whether it runs in a batch of suspects only (a worker died once while it was on the
    #: device, usually the host's fault: its batch-mates, back with it, run again together).
    suspect: bool = False
    #: What one of its rows costs the device (the model's ``row_cost``: MiniLM, its length);
    #: None: rows cost alike.
    cost: float | None = None
    #: Its Celery priority, 0-9 (on Redis, Celery's order: 0 is served first).
    priority: int = 0
    #: Batches that went, while it waited, with requests that arrived after it...
    passed: int = 0
    #: ...by its place in the order items were put (the batcher numbers them).
    arrival: int = 0
    #: A decoupled model's request: where each part goes as it is made, ``on_part(index,
    #: outputs)`` (index 1-based, outputs its v2 tensors; engine/streaming.py). None: nobody
    #: listens (its one answer, the parts joined, still completes its future).
    on_part: Callable[[int, list[Any]], None] | None = None
    #: Its host's trace tag (opaque here: the worker's message headers), handed back in its
    #: batch's record when the runner records batches (tracing); None: none.
    trace: Any = None
    #: A stateful model's request: its sequence (wire/sequence.py's ``SequenceFlags``: ID, start,
    #: end), set by the model's sequence book (engine/sequences.py); None: no sequence.
    sequence: Any = None

    def __post_init__(self) -> None:
        if self.received_at < 0:
            self.received_at = self.enqueued_at

    @property
    def isolated(self) -> bool:
        """Whether its batch has the device to itself (it saw a worker die: engine/gate.py)."""
        return self.alone or self.suspect

    def batches_with(self, other: WorkItem) -> bool:
        """Whether ``other`` may share a batch led by this item: a request that runs alone shares
        with none, a suspect only with suspects, any other only with those that saw no death."""
        return not self.alone and not other.alone and self.suspect == other.suspect


class Batcher:
    """A queue of work items that hands out batches of compatible items.

    Items are compatible when their signatures are equal (same input names, datatypes and row
    shapes); others wait, in order, for a later batch. An item marked ``alone`` forms a batch of
    its own; ``suspect`` items batch only with each other. With ``preferred_batch_sizes`` (Triton's
    knob) a batch stops waiting once it holds the largest preferred size, and a batch that holds
    no preferred size gives back whole requests down to the largest preferred size it can keep.
    """

    def __init__(self, max_batch_size: int, max_delay_ms: float,
                 preferred_batch_sizes: tuple[int, ...] = (), group_by_cost: bool = True,
                 max_cost_ratio: float = 2.0, max_priority_passes: int = 8) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        if not (math.isfinite(max_delay_ms) and max_delay_ms >= 0):
            raise ValueError(f"max_delay_ms must be a finite number >= 0, got {max_delay_ms!r}")
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000.0
        self.preferred = tuple(sorted(set(preferred_batch_sizes)))
        #: Fill a batch with the rows nearest in cost to its first, when items have a cost...
        self.group_by_cost = group_by_cost
        #: ...and only with rows within this ratio of each other's cost: a batch runs padded to its
        #: longest row, so a short row beside a long one costs a long one.
        self.max_cost_ratio = max_cost_ratio
        if not isinstance(max_priority_passes, int) or max_priority_passes < 1:
            raise ValueError(
                f"max_priority_passes must be an integer >= 1, got {max_priority_passes!r}")
        #: A request passed over by this many batches counts as the best level: the bound on how
        #: long a low level waits behind a stream of higher ones.
        self.max_priority_passes = max_priority_passes
        #: How many pending items have a priority other than 0 (none: batches in arrival order).
        self._ranked = 0
        self._arrivals = 0
        self._enough = self.preferred[-1] if self.preferred else max_batch_size
        self._pending: deque[WorkItem] = deque()
        self._arriving = 0
        #: For each batch former waiting: how many more items would end its wait (each item is at
        #: least one row), so that a put wakes them only when one can use what came.
        self._wants: list[int] = []
        self._closed = False
        self._cond = threading.Condition()

    def hold(self) -> None:
        """Announce requests being decoded: a forming batch may wait for them until :meth:`release`."""
        with self._cond:
            self._arriving += 1

    def release(self) -> None:
        """End one :meth:`hold`."""
        with self._cond:
            self._arriving -= 1
            if self._arriving == 0:  # a batch that waited for arrivals can go now
                self._cond.notify_all()

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Announce a request being decoded, so a forming batch may wait for it."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def put(self, item: WorkItem) -> None:
        """Queue an item for the device."""
        with self._cond:
            if self._closed:
                raise RuntimeError("batcher is closed")
            self._arrivals += 1
            item.arrival = self._arrivals
            self._pending.append(item)
            if item.priority:
                self._ranked += 1
            # While more are arriving, the batch former wakes once they are enough to end its
            # wait, or when the last has arrived (release()); not once per request.
            if self._wants and (self._arriving == 0 or len(self._pending) >= min(self._wants)):
                self._cond.notify_all()

    def close(self) -> list[WorkItem]:
        """Stop handing out batches; return the items that never ran."""
        with self._cond:
            self._closed = True
            left = list(self._pending)
            self._pending.clear()
            self._ranked = 0
            self._cond.notify_all()
            return left

    def __len__(self) -> int:
        return len(self._pending)

    def withdraw(self, request_ids: set[str]) -> list[WorkItem]:
        """Take the items of ``request_ids`` that still wait here out of the queue (they will not
        run here: their requests went to another worker); those already in a batch stay."""
        with self._cond:
            gone = [item for item in self._pending if item.request.id in request_ids]
            if gone:
                self._pending = deque(item for item in self._pending
                                      if item.request.id not in request_ids)
                self._ranked -= sum(1 for item in gone if item.priority)
            return gone

    def waiting_ids(self) -> set[str]:
        """The IDs of the requests waiting here for a batch (what ``inspect reserved`` shows)."""
        with self._cond:
            return {item.request.id for item in self._pending}

    def next_batch(self) -> list[WorkItem] | None:
        """Block until a batch is ready and return it; None once closed."""
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._wait(1, None)
            ranked = bool(self._ranked)
            if ranked:  # levels differ: the oldest of the best level leads
                first = self._by_level()[0]
                self._pending.remove(first)
                self._ranked -= 1 if first.priority else 0
            else:
                first = self._pending.popleft()
            batch, rows = [first], first.rows
            if first.alone:
                return batch
            # a lost batch's rerun: its requests came back together and are taken already; it
            # waits for those still being decoded, past the delay, or a busy host splits it
            deadline = first.enqueued_at + self.max_delay_s + (
                SUSPECTS_WAIT_S if first.suspect else 0.0)
            while rows < self.max_batch_size:
                rows = self._take_compatible(batch, rows)
                if rows >= self._enough or self._arriving == 0 or self._closed:
                    break
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._wait(self._enough - rows, remaining)
            if self.preferred and rows not in self.preferred:
                self._trim_to_preferred(batch, rows)
            if ranked:
                self._count_passes(batch)
            return batch

    def take_joining(self, signature: Hashable, room_rows: int) -> list[WorkItem]:
        """Without waiting: the items that join a running batch of ``signature`` (in-flight
        batching), at most ``room_rows`` rows. They are taken in the order batches are served
        (by level, then arrival), up to the first that cannot join (another signature, one that
        runs ``alone`` or is a suspect, or one that does not fit): a running batch never takes a request ahead
        of one that would be served before it, so a stream of compatible arrivals cannot starve
        the others (once one of them leads the queue, the batch takes no more and ends)."""
        with self._cond:
            if self._closed or room_rows < 1 or not self._pending:
                return []
            taken: list[WorkItem] = []
            rows = 0
            for item in self._by_level():
                if item.signature != signature or item.isolated or rows + item.rows > room_rows:
                    break
                taken.append(item)
                rows += item.rows
            if not taken:
                return []
            ids = {id(item) for item in taken}
            self._pending = deque(item for item in self._pending if id(item) not in ids)
            ranked = bool(self._ranked)
            self._ranked -= sum(1 for item in taken if item.priority)
            if ranked:
                self._count_passes(taken)
            return taken

    def _wait(self, wanted: int, timeout_s: float | None) -> None:
        """Wait (holding ``_cond``) until ``wanted`` more items may be pending, the last arrival
        is in, or ``timeout_s`` passes."""
        self._wants.append(wanted)
        try:
            self._cond.wait(timeout_s)
        finally:
            self._wants.remove(wanted)

    def _trim_to_preferred(self, batch: list[WorkItem], rows: int) -> None:
        fitting = [p for p in self.preferred if p <= rows]
        if not fitting:
            return
        target = fitting[-1]
        while rows > target and len(batch) > 1:
            item = batch.pop()
            rows -= item.rows
            self._pending.appendleft(item)
            self._ranked += 1 if item.priority else 0

    def _count_passes(self, batch: list[WorkItem]) -> None:
        """Count a pass for each waiting item older than the newest of ``batch``."""
        newest = max(item.arrival for item in batch)
        for item in self._pending:
            if item.arrival < newest:
                item.passed += 1

    def _by_level(self) -> list[WorkItem]:
        """The pending items in the order they are served: by level, in arrival order within a
        level (all of them in arrival order when they have one level)."""
        if not self._ranked:
            return list(self._pending)
        return sorted(self._pending, key=self._level)

    def _level(self, item: WorkItem) -> int:
        """``item``'s level: its priority, or 0 once ``max_priority_passes`` batches passed it."""
        return 0 if item.passed >= self.max_priority_passes else item.priority

    def _take_compatible(self, batch: list[WorkItem], rows: int) -> int:
        if self.group_by_cost and batch[0].cost is not None:
            return self._take_nearest(batch, rows)
        signature = batch[0].signature
        taken: set[int] = set()
        for item in self._by_level():
            if (item.signature == signature and rows + item.rows <= self.max_batch_size
                    and batch[0].batches_with(item)):
                batch.append(item)
                taken.add(id(item))
                rows += item.rows
                self._ranked -= 1 if item.priority else 0
        if taken:  # the rest keep their arrival order
            self._pending = deque(item for item in self._pending if id(item) not in taken)
        return rows

    def _take_nearest(self, batch: list[WorkItem], rows: int) -> int:
        """Fill ``batch`` with the compatible items nearest in cost to its first (by ratio: a row
        twice as long costs alike whether short or long), the older first among equals."""
        first = batch[0]
        target = math.log1p(max(0.0, first.cost or 0.0))
        candidates = [item for item in self._pending
                      if item.signature == first.signature and first.batches_with(item)]
        candidates.sort(key=lambda item: (self._level(item) if self._ranked else 0,
                                          abs(math.log1p(max(0.0, item.cost or 0.0)) - target)))
        costs = [max(1.0, item.cost or 1.0) for item in batch]
        low, high = min(costs), max(costs)
        taken: set[int] = set()
        for item in candidates:
            cost = max(1.0, item.cost or 1.0)
            if max(high, cost) > self.max_cost_ratio * min(low, cost):
                continue  # it would run padded far past its own cost (or pad the others)
            if rows + item.rows <= self.max_batch_size:
                batch.append(item)
                taken.add(id(item))
                rows += item.rows
                self._ranked -= 1 if item.priority else 0
                low, high = min(low, cost), max(high, cost)
                if rows >= self.max_batch_size:
                    break
        if taken:
            self._pending = deque(item for item in self._pending if id(item) not in taken)
        return rows
