"""The launch gate: a batch goes onto the device only with requests whose leases are still this
worker's.

A worker cut off from Redis (a partition, a frozen Redis, a host whose network fails) cannot renew
its leases; a lease lapses ``lease_s`` after its last renewal, and the fleet's sweep hands what it
held to another worker (broker/leases.py). What was on its device then runs on where it is (at
least once), but what waited behind it must not start here once it may have started there: that
would run it twice, for a partition no longer than a batch.

So before each batch launches, the gate looks at when each of its requests was last known to be
leased here (taken, or renewed since): up to half a lease ago, the lease holds with room to spare
and the batch goes. Older (two renewals in a row missed), the gate renews the leases itself, on
the device thread, and the device waits until Redis answers: the requests leased to another worker
now are given up here unrun (they run once, there), and the rest launch. A request the lease
thread's renewal found leased to another (``TakenMessage.lost``) while it waited in a batch formed
already is given up here too (those still in a batcher were taken out of it then). While Redis cannot be
reached nothing launches, which is right: what would launch has gone, or is about to go, to
another worker; a Redis back with its data finds the leases renewed; one restarted without them
has them leased again (leases.py), and the batch runs. A stop in the meantime launches nothing.

Requests that Celery's consumer delivered (kombu's leases, ``ASYNCINFER_CONSUMER=celery``) and
those taken without leases (``ASYNCINFER_LEASE_S=0``) pass as they are.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis

from asyncinfer.broker.leases import Leases
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.worker.requests.holdings import Holdings
from asyncinfer.worker.requests.taken import TakenMessage

__all__ = ["LeaseGate"]

log = logging.getLogger(__name__)


class LeaseGate:
    """Admits a batch's requests to the device (see the module). ``leases``: each shard's leases
    (index: the shard; None where nothing is leased); ``stopping``: set when the worker stops."""

    #: How often the gate tries Redis again while it cannot renew (seconds).
    retry_s = 0.5

    def __init__(self, holdings: Holdings, leases: Sequence[Leases | None],
                 stopping: threading.Event) -> None:
        self.holdings = holdings
        self.leases = leases
        self.stopping = stopping
        #: Counts for the note and the tests: requests given up at the gate, and the batches
        #: that waited there for Redis.
        self.given_up = 0
        self.waited = 0

    def admit(self, items: Sequence[WorkItem]) -> list[WorkItem]:
        """Those of ``items`` that may go onto the device now; blocks while their leases are in
        doubt (see the module)."""
        held = [(item, self.holdings.find(item.request.id)) for item in items]
        doubted = {d.shard for _, d in held if d is not None and self._in_doubt(d)}
        if not doubted and not any(d is not None and d.lost for _, d in held):
            return list(items)
        lost = {d.tag for _, d in held if d is not None and d.lost}
        for shard in sorted(doubted):
            renewed = self._renew(shard)
            if renewed is None:  # stopping: nothing launches
                return []
            lost |= renewed
        dropped = [d for _, d in held if d is not None and d.tag in lost]
        if dropped:
            self.holdings.release(dropped)
            self.given_up += len(dropped)
            log.warning("gave up %d of them that had not started here (they run where they went)",
                        len(dropped))
        return [item for item, d in held if d is None or d.tag not in lost]

    def _in_doubt(self, d: TakenMessage) -> bool:
        """Whether ``d``'s lease may have lapsed: last known held here over half a lease ago."""
        leases = self.leases[d.shard] if d.shard < len(self.leases) else None
        if leases is None or not d.tag or d.message is not None:
            return False
        known_at = max(d.received_at, leases.renewed_at)
        return time.perf_counter() - known_at > leases.lease_s / 2

    def _renew(self, shard: int) -> set[str] | None:
        """Renew the leases of ``shard`` (waiting for Redis as long as it takes); the tags leased
        to another worker now. None when the worker stops first."""
        leases = self.leases[shard]
        assert leases is not None
        said = False
        while not self.stopping.is_set():
            try:
                return set(leases.renew())
            except (redis.RedisError, OSError) as exc:
                if not said:
                    self.waited += 1
                    log.warning("the device waits: the leases of what it would run next could "
                                "not be renewed for %.0f s (%s); it runs them once Redis says they "
                                "are still this worker's", time.perf_counter() - leases.renewed_at,
                                exc)
                    said = True
                self.stopping.wait(self.retry_s)
        return None
