"""Finding a device that hangs: a batch on the device far longer than the model's batches take.

A kernel that blocks without an error (a deadlocked collective, a driver that stopped answering,
a model that waits for ever on one input) raises nothing and returns nothing: without a time
limit, its request stays STARTED for ever and its worker stays alive, renewing the leases of
everything it holds. The watch notices it at the defaults: a batch that has been on the device
for longer than :meth:`HangWatch.limit_s` — ``hang_after_s`` when set, else ``factor`` times
the slowest batch this runner finished (its warm-up counts too), and never less than
``floor_s`` — is a hang, reported once to the owner (``on_hung``, engine/hooks.py), which
treats it as a death of that batch (policy/hangs.py).

Well before that, a batch that runs alone (a request in it saw a worker die: a suspect) and has
been on the device for longer than :meth:`HangWatch.stall_limit_s` — ``stall_factor`` times the
slowest batch, at least ``stall_floor_s``, at most the hang limit — stalls the device: the owner
is told once per batch (``on_stalled``) and hands what waits behind it to other workers; the batch
itself runs on. (Any other batch keeps what waits behind it: a slow batch of good requests is no
reason to move the work.)

The watch reads the clock twice a second on a thread of its own; it costs the device thread one
list append per batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from asyncinfer.engine.batcher import WorkItem

__all__ = ["HANG_FACTOR", "HANG_FLOOR_S", "STALL_FACTOR", "STALL_FLOOR_S", "HangWatch", "Hung",
           "HungHandler"]

log = logging.getLogger(__name__)

#: The least time a batch may take before it counts as a hang, whatever came before it.
HANG_FLOOR_S = 30.0
#: A batch counts as a hang after this many times the slowest batch the runner finished.
HANG_FACTOR = 10.0
#: A batch stalls the device after this many times the slowest batch, and at least this long.
STALL_FACTOR = 3.0
STALL_FLOOR_S = 2.0


class Hung:
    """A batch found hanging: its requests, how long it had been on the device, the limit it
    passed, and every request on the runner's device then (the hung batch's and any other
    instance's)."""

    def __init__(self, model: str, items: Sequence[WorkItem], on_device_s: float, limit_s: float,
                 on_device: Sequence[WorkItem]) -> None:
        self.model = model
        self.items = list(items)
        self.on_device_s = on_device_s
        self.limit_s = limit_s
        self.on_device = list(on_device)

    def describe(self) -> str:
        """One line: what hung, for how long, against which limit."""
        return (f"model '{self.model}': a batch of {len(self.items)} request(s) made no progress "
                f"on the device for {self.on_device_s:.0f} s (the hang limit: {self.limit_s:.0f} s)")


#: Told of a hang, once per runner (engine/hooks.py).
HungHandler = Callable[[Hung], None]


class HangWatch:
    """The batches of one runner on its device, and the hang limit they are held to."""

    def __init__(self, model: str, on_hung: Callable[[], HungHandler], *,
                 on_stalled: Callable[[], HungHandler] | None = None,
                 after_s: float | None = None, floor_s: float = HANG_FLOOR_S,
                 factor: float = HANG_FACTOR, stall_floor_s: float = STALL_FLOOR_S,
                 stall_factor: float = STALL_FACTOR, check_s: float = 0.5,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.model = model
        self._on_hung = on_hung
        self._on_stalled = on_stalled
        self.stall_floor_s = stall_floor_s
        self.stall_factor = stall_factor
        #: The batch that stalled last (told once per batch).
        self._stalled: Sequence[WorkItem] | None = None
        #: The limit when set (> 0); else it is derived from the batches seen.
        self.after_s = after_s if after_s and after_s > 0 else None
        self.floor_s = floor_s
        self.factor = factor
        self.check_s = check_s
        self.clock = clock
        #: The slowest batch finished on the device, seconds (None: none yet).
        self.slowest_s: float | None = None
        #: Whether a hang was reported (once).
        self.reported = False
        self._lock = threading.Lock()
        self._on_device: list[tuple[float, Sequence[WorkItem]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def limit_s(self) -> float:
        """How long a batch may stay on the device before it counts as a hang."""
        if self.after_s is not None:
            return self.after_s
        return max(self.floor_s, self.factor * (self.slowest_s or 0.0))

    def stall_limit_s(self) -> float:
        """How long a batch may stay on the device before what waits behind it goes elsewhere."""
        return min(self.limit_s(), max(self.stall_floor_s,
                                       self.stall_factor * (self.slowest_s or 0.0)))

    def observe(self, device_s: float) -> None:
        """A batch finished on the device in ``device_s`` seconds."""
        if self.slowest_s is None or device_s > self.slowest_s:
            self.slowest_s = device_s

    def launched(self, items: Sequence[WorkItem], at: float) -> None:
        """(The device thread.) ``items`` went onto the device at ``at`` (the watch's clock)."""
        with self._lock:
            self._on_device.append((at, items))

    def on_device(self) -> list[tuple[float, Sequence[WorkItem]]]:
        """The batches on the device now, with when each launched (those that left forgotten)."""
        with self._lock:
            self._on_device = [(at, items) for at, items in self._on_device
                               if any(item.on_device for item in items)]
            return list(self._on_device)

    def overdue(self, limit_s: float | None = None,
                alone: bool = False) -> tuple[float, Sequence[WorkItem]] | None:
        """The longest-running batch on the device (``alone``: of those that run alone) that
        passed ``limit_s`` (default :meth:`limit_s`), with its seconds there; None when none did."""
        limit = self.limit_s() if limit_s is None else limit_s
        now = self.clock()
        batches = [(at, items) for at, items in self.on_device()
                   if not alone or any(getattr(item, "isolated", False) for item in items)]
        if not batches:
            return None
        at, items = min(batches, key=lambda batch: batch[0])
        return (now - at, items) if now - at > limit else None

    def stuck(self, limit_s: float) -> Hung | None:
        """The batches on the device for longer than ``limit_s`` now, as one :class:`Hung`
        (None: none): what a stopping worker does not hand back as if it had not run."""
        now = self.clock()
        batches = self.on_device()
        over = [(now - at, items) for at, items in batches if now - at > limit_s]
        if not over:
            return None
        every = [item for _, batch in batches for item in batch]
        return Hung(self.model, [item for _, items in over for item in items],
                    max(seconds for seconds, _ in over), limit_s, every)

    def stalled(self) -> Hung | None:
        """Tell of a batch that runs alone and passed the stall limit (once per batch); the stall
        told, if any."""
        if self._on_stalled is None:
            return None
        limit = self.stall_limit_s()
        found = self.overdue(limit, alone=True)
        if found is None or found[1] is self._stalled:
            return None
        seconds, items = found
        self._stalled = items
        stall = Hung(self.model, items, seconds, limit,
                     [item for _, batch in self.on_device() for item in batch])
        log.warning("%s: what waits behind it goes to other workers",
                    stall.describe().replace("the hang limit", "the stall limit"))
        self._on_stalled()(stall)
        return stall

    def check(self) -> Hung | None:
        """Report a hang if a batch passed the limit (once); the hang reported, if any."""
        self.stalled()
        if self.reported:
            return None
        limit = self.limit_s()
        found = self.overdue(limit)
        if found is None:
            return None
        seconds, items = found
        self.reported = True
        every = [item for _, batch in self.on_device() for item in batch]
        hung = Hung(self.model, items, seconds, limit, every)
        log.critical("%s", hung.describe())
        self._on_hung()(hung)
        return hung

    def start(self) -> HangWatch:
        self._thread = threading.Thread(target=self._run, name=f"hangs-{self.model}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.check_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive whatever its owner raises
                log.exception("model %s: the hang watch failed", self.model)
