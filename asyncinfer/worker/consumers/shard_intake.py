"""How a device worker takes requests from one Redis — one server, or one shard of a cluster —
and keeps their bookkeeping there: its take, its leases, its sequence registrations, its watch on
the lists, the give-back. A worker whose broker URL spreads requests over a cluster's shards
(``rediscluster://…?shards=N``) has one intake per shard, all feeding its one pipeline; any other
has one (fast_consumer.py).

Each intake runs its own thread: take what fits the worker's room, wait on its lists when they
are empty. The room is the worker's (one in-flight bound for all its intakes): a take reserves
what it may take (Holdings.reserve) until what it took is held, so intakes never take more
together than the bound allows, and a shard whose master is slow or frozen holds up no other
shard's take; whichever intake finds work when room frees takes it, so a shard no other worker
serves is never left behind a busy one (a strict "home shard first" would starve it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

import redis

from asyncinfer.backoff import Backoff
from asyncinfer.broker.connections import redis_client
from asyncinfer.broker.leases import Leases, holder_of_this_process
from asyncinfer.broker.restore import restore
from asyncinfer.broker.take import Taker
from asyncinfer.broker.wake import Waker
from asyncinfer.config.settings import Settings
from asyncinfer.constants import priority_lists
from asyncinfer.supervision.vital import vital_thread
from asyncinfer.wire.messages import restored_message
from asyncinfer.worker.requests.sequence_pins import SequencePins
from asyncinfer.worker.requests.taken import TakenMessage

if TYPE_CHECKING:
    from asyncinfer.policy.policy import Policy
    from asyncinfer.worker.output.shard_writers import ShardWriters
    from asyncinfer.worker.pipeline import Pipeline
    from asyncinfer.worker.requests.holdings import Holdings
    from asyncinfer.worker.runtime import WorkerRuntime

__all__ = ["ShardIntake", "Fed"]

log = logging.getLogger(__name__)


class Fed(Protocol):
    """What an intake feeds (fast_consumer.py's consumer)."""

    hostname: str
    policy: Policy
    runtime: WorkerRuntime
    holdings: Holdings
    pipeline: Pipeline
    writer: ShardWriters
    #: Set once the consumer stops taking.
    stopped_event: threading.Event

    def stalled(self) -> bool:
        """Whether a stalled batch is on the device (no take until it comes off)."""


class ShardIntake:
    """Takes ``consumer``'s queues from the Redis of ``url`` (shard ``shard`` of the worker's
    intakes) into its pipeline, until the consumer stops."""

    def __init__(self, consumer: Fed, url: str, shard: int, settings: Settings,
                 queues: Sequence[str], shards: int = 1) -> None:
        self.consumer = consumer
        self.url = url
        self.shard = shard
        #: The worker's intakes: a take reserves at most this share of its room.
        self.shards = shards
        self._settings = settings
        policy, hostname = consumer.policy, consumer.hostname
        self.queues = list(queues)
        # The take's own connection: a pool check-out per command costs a poll() and redis-py's
        # argument checks.
        self.client = self._client()
        self.taker = Taker(self.client)
        #: Queues to take from instead, once the thread is between two takes (:meth:`retarget`),
        #: and the event set when it does.
        self._next_queues: list[str] | None = None
        self.retargeted = threading.Event()
        holdings = consumer.holdings
        #: What this intake takes is leased to the worker, renewed while it lives (None: no leases).
        self.leases = None if not settings.lease_s else Leases(
            self._client(), redis_client(url, settings, health_check_interval=30),
            node=hostname, lease_s=settings.lease_s, deaths_ttl_s=settings.result_expires_s,
            count_deaths=policy.deaths.max_deaths > 0, held=lambda: holdings.tags(shard),
            on_lost=lambda tags: consumer.pipeline.forget(tags),
            on_forgotten=self._lease_again)
        #: Sequence batching: the worker's registrations here and the sweep of dead workers'
        #: lists (sequence_pins.py); its sweeps take on a connection of their own.
        self.pins = SequencePins(
            self._client(), consumer.runtime,
            holder=self.leases.holder if self.leases is not None else holder_of_this_process(
                hostname), lease_s=settings.lease_s or 10.0,
            taker=Taker(self._client()),
            lease=self.leases.terms if self.leases is not None else None,
            refuse=lambda taken, error_of: consumer.pipeline.refuse(taken, error_of, shard))
        #: What it takes from: the worker's own lists of sequences (stateful models), then each
        #: queue's list and its priority lists, in kombu's order.
        self._lists = self.pins.lists_for(self.queues) + priority_lists(self.queues)
        #: Watches its lists (None while it takes from no queue).
        self.waker: Waker | None = self._new_waker()
        self._thread = vital_thread(self._run, f"asyncinfer-consumer-{shard}")

    def _client(self) -> redis.Redis:
        return redis_client(self.url, self._settings, health_check_interval=30,
                            single_connection_client=True)

    def _new_waker(self) -> Waker | None:
        if not self._lists:
            return None
        # The watchers block on their own connections (one each), never on the take's.
        # Blocking commands need a socket timeout beyond their own (redis-py's default is 5 s).
        blocking = {"health_check_interval": 30, "socket_timeout": Waker.block_s + 5}
        url, settings = self.url, self._settings
        return Waker(redis_client(url, settings, **blocking),
                     redis_client(url, settings, single_connection_client=True, **blocking),
                     self._lists, stopping=self.consumer.stopped_event.is_set)

    def start_leases(self) -> None:
        """What a dead predecessor on this host held here comes back first; the worker's
        sequences register here before it serves (a sequence may start at once)."""
        if self.leases is not None:
            self.leases.start()
        self.pins.start()

    def start(self) -> None:
        if self.waker is not None:
            self.waker.start()
        self._thread.start()

    def halt(self) -> None:
        """Take no more (the consumer stops, or gives everything back): what the last take took
        is held, and goes back with the rest."""
        self.close_waker()
        self._thread.join(timeout=5)

    def stop(self) -> None:
        """(After the give-back.) Its registrations and leases end."""
        self.pins.stop()
        if self.leases is not None:
            self.leases.stop()

    def close_waker(self) -> None:
        if self.waker is not None:
            self.waker.close()

    # -- bookkeeping of what it took ------------------------------------------------------------

    def restore(self, held: Sequence[TakenMessage], died: Collection[str]) -> int:
        """Put ``held`` (taken here) back on their lists, marked ``redelivered``, in one script
        call; a death counted against those whose request IDs are in ``died``. How many went
        back."""
        leases = self.leases
        count = leases is not None and leases.count_deaths
        return restore(self.client, [(d.tag, d.list_key, restored_message(d),
                                      d.request_id if count and d.request_id in died else "")
                                     for d in held],
                       holder=leases.holder if leases is not None else "",
                       deaths_ttl_s=int(leases.deaths_ttl_s if leases is not None else 1))

    def _lease_again(self, tags: list[str]) -> None:
        """Redis forgot what ``tags`` held here (leases.py): lease again those not answered, so
        that they run here and go back to their queue if this worker dies; give up any another
        holder took meanwhile."""
        assert self.leases is not None
        pipeline = self.consumer.pipeline
        again = pipeline.forgotten(tags)
        adopted = set(self.leases.adopt(again))
        taken = [tag for tag, _list, _entry in again if tag not in adopted]
        if taken:
            pipeline.forget(taken)

    # -- which queues (model control) -----------------------------------------------------------

    def retarget(self, queues: list[str]) -> None:
        """Take from ``queues`` once the thread is between two takes (:attr:`retargeted` is set
        then)."""
        self.retargeted.clear()
        self._next_queues = queues
        waker = self.waker
        if waker is not None:
            waker.interrupt()

    def _interrupted(self) -> bool:
        return self.consumer.stopped_event.is_set() or self._next_queues is not None

    def _apply_queues(self) -> None:
        """(The thread, between two takes.) Take from the queues :meth:`retarget` gave: a new
        waker watches their lists (the old one's watches lapse by themselves)."""
        queues, self._next_queues = self._next_queues or [], None
        if queues != self.queues:
            self.close_waker()
            self.queues = queues
            self._lists = self.pins.lists_for(queues) + priority_lists(queues)
            self.pins.renew()
            self.waker = self._new_waker()
            if self.waker is not None:
                self.waker.start()
        self.retargeted.set()

    # -- the take -------------------------------------------------------------------------------

    def _run(self) -> None:
        consumer = self.consumer
        stopping = consumer.stopped_event
        holdings, policy = consumer.holdings, consumer.policy
        writer = consumer.writer.of(self.shard)
        backoff = Backoff()
        while not stopping.is_set():
            try:
                if self._next_queues is not None:
                    self._apply_queues()
                if consumer.stalled():
                    stopping.wait(0.1)
                    continue
                waker = self.waker
                if waker is None:  # it takes from no queue (every model unloaded)
                    stopping.wait(1.0)
                    continue
                # the room is the worker's: this take's share reserved until what it took is held
                room = holdings.reserve(self._interrupted, shares=self.shards)
                try:
                    if room <= 0 or self._next_queues is not None:
                        continue
                    # Take atomically with the bookkeeping; once a take leaves the lists empty,
                    # wait for the watchers (which never pop) and take again.
                    waker.clear()
                    started = (writer.started_for_take(consumer.hostname)
                               if policy.track_started else None)
                    taken = self.taker.take(self._lists, room, started,
                                            self.leases.terms if self.leases is not None else None,
                                            watcher=waker.token, watched=waker.passable(),
                                            max_body_bytes=policy.max_payload_bytes or 0)
                    if taken:
                        consumer.pipeline.took(taken, self.shard)
                finally:
                    holdings.unreserve(room)
                if self.taker.passed:
                    waker.watch_passed(self.taker.passed)
                backoff.reset()
                if len(taken) < room:
                    consumer.pipeline.first_attempts.send(due_only=True)  # idle: at least every 1 s
                    waker.arm()
                    waker.wait(1.0)
            except redis.RedisError as exc:
                # Lost connection, a timeout, OOM, READONLY (a demoted master), ...: nothing was
                # taken that is not recorded; wait and take again.
                wait_s = backoff.failed()
                log.warning("consumer: Redis failed (%s: %s); again in %.1f s", type(exc).__name__,
                            exc, wait_s)
                stopping.wait(wait_s)
            except Exception:  # noqa: BLE001 - the consumer must survive whatever comes in
                wait_s = backoff.failed()
                log.exception("consumer error; going on in %.1f s", wait_s)
                stopping.wait(wait_s)


#: Waits (a stop's) for a thread between two takes, in steps of this long (seconds).
RETARGET_POLL_S = 0.1


def wait_retargeted(intakes: Sequence[ShardIntake], stopped: Callable[[], bool],
                    timeout_s: float) -> bool:
    """Wait until every one of ``intakes`` took up its new queues (False: not within
    ``timeout_s``, or ``stopped()``)."""
    deadline = time.monotonic() + timeout_s
    for intake in intakes:
        while not intake.retargeted.wait(RETARGET_POLL_S):
            if stopped() or time.monotonic() > deadline:
                return False
    return True
