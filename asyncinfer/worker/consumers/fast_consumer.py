"""The device worker's consumer of ``infer.*`` queues on Redis: how messages are taken, leased,
acknowledged and given back. What happens to each request between the take and the write is the
pipeline's (worker/pipeline.py).

Celery's own per-task path (a BRPOP, a Request object, a pool hand-off, two result writes and an
ack pipeline per message) costs milliseconds of worker CPU per request on a small host — time
taken from the model. This consumer keeps the same messages, results, states and redelivery
bookkeeping, but works in batches:

- one script takes what is waiting (up to the free in-flight room) and records it as
  unacknowledged and leased to this worker in the same atomic step (take.py, leases.py); an idle
  consumer waits without popping, and a push wakes one idle consumer of the fleet (wake.py), so a
  request is never in the worker's memory unrecorded;
- the pipeline decodes and validates right here, and valid requests go straight to the model's
  batcher (no thread per request);
- the :class:`ResultWriter` stores results and acknowledges them in one round trip per batch;
- a clean stop, or a wedged device, gives back at once what is still held.

Used by ``asyncinfer worker`` on a Redis broker (the default consumer); on RabbitMQ and with
``ASYNCINFER_CONSUMER=celery`` Celery's consumer feeds the same pipeline (kombu_intake.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import redis
from celery import Celery

from asyncinfer.backoff import Backoff
from asyncinfer.broker.clock_skew import CLOCK_FOLLOWER
from asyncinfer.broker.connections import redis_client
from asyncinfer.broker.leases import Leases, holder_of_this_process
from asyncinfer.broker.restore import restore
from asyncinfer.broker.take import Taker
from asyncinfer.broker.wake import Waker
from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.constants import priority_lists
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.hangs import Hung
from asyncinfer.engine.hooks import ignore_launch
from asyncinfer.policy.policy import Policy
from asyncinfer.supervision.vital import vital_thread
from asyncinfer.wire.messages import restored_message
from asyncinfer.worker.consumers.consumer import STOP_GRACE_S, PipelineConsumer
from asyncinfer.worker.requests.holdings import SCHEDULED
from asyncinfer.worker.requests.sequence_pins import SequencePins
from asyncinfer.worker.requests.taken import TakenMessage
from asyncinfer.worker.runtime import WorkerRuntime

if TYPE_CHECKING:
    from asyncinfer.tracing.spans import Tracing

__all__ = ["FastConsumer"]

log = logging.getLogger(__name__)


class FastConsumer(PipelineConsumer):
    """Consumes ``queues`` for ``runtime`` until :meth:`stop`; at most ``max_in_flight`` at once."""

    def __init__(self, app: Celery, runtime: WorkerRuntime, queues: Sequence[str], *,
                 hostname: str, policy: Policy, send_events: bool = False,
                 tracing: Tracing | None = None) -> None:
        settings = settings_of(app) or Settings.from_env()
        # The result writer's own connection: a pool check-out per command costs a poll() and
        # redis-py's argument checks (~8 % of the worker's CPU).
        super().__init__(app, runtime, hostname=hostname, policy=policy, send_events=send_events,
                         tracing=tracing,
                         results=redis_client(app.conf.broker_url, settings,
                                              health_check_interval=30,
                                              single_connection_client=True))
        self.queues = list(queues)
        # The consumer thread's own connection, as the writer's.
        self.client = redis_client(app.conf.broker_url, settings, health_check_interval=30,
                                   single_connection_client=True)
        self.taker = Taker(self.client)
        self._settings = settings
        #: Queues to take from instead, once the consumer thread is between two takes
        #: (:meth:`set_queues`), and the event set when it does.
        self._next_queues: list[str] | None = None
        self._retargeted = threading.Event()
        self._retarget_lock = threading.Lock()
        #: What this worker takes is leased to it, renewed while it lives (None: no leases).
        self.leases = None if not settings.lease_s else Leases(
            redis_client(app.conf.broker_url, settings, health_check_interval=30,
                         single_connection_client=True),
            redis_client(app.conf.broker_url, settings, health_check_interval=30),
            node=hostname, lease_s=settings.lease_s, deaths_ttl_s=settings.result_expires_s,
            count_deaths=policy.deaths.max_deaths > 0, held=self.holdings.tags,
            on_lost=lambda tags: self.pipeline.forget(tags),
            on_forgotten=self._lease_again)
        #: Sequence batching: this worker's registrations and the sweep of dead workers' lists
        #: (sequence_pins.py); its sweeps take on a connection of their own.
        lease_s = settings.lease_s or 10.0
        self.pins = SequencePins(
            redis_client(app.conf.broker_url, settings, health_check_interval=30,
                         single_connection_client=True), runtime,
            holder=self.leases.holder if self.leases is not None else holder_of_this_process(
                hostname), lease_s=lease_s,
            taker=Taker(redis_client(app.conf.broker_url, settings, health_check_interval=30,
                                     single_connection_client=True)),
            lease=self.leases.terms if self.leases is not None else None,
            refuse=lambda taken, error_of: self.pipeline.refuse(taken, error_of))
        #: What it takes from: its own lists of sequences (stateful models), then each queue's
        #: list and its priority lists, in kombu's order.
        self._lists = self.pins.lists_for(self.queues) + priority_lists(self.queues)
        #: Watches its lists (None while it takes from no queue).
        self.waker: Waker | None = self._new_waker()
        #: The batch that stalls the device, while it is there: takes wait (engine/hangs.py).
        self._stall: Sequence[WorkItem] = ()
        counting = self.leases is not None and self.leases.count_deaths
        self.use_device(self._give_back_all,
                        on_launch=self._on_launch if counting else ignore_launch,
                        give_back_but=self._give_back_but if counting else None,
                        note_hang=self._note_hang, on_stalled=self._on_stalled)
        if self.leases is not None:  # a request failed for its deaths names its last hang
            self.pipeline.death_note = self.leases.hang_note
        self._thread = vital_thread(self._run, "asyncinfer-consumer")

    def _new_waker(self) -> Waker | None:
        if not self._lists:
            return None
        url, settings = self.app.conf.broker_url, self._settings
        # The watchers block on their own connections (one each), never on the consumer's.
        # Blocking commands need a socket timeout beyond their own (redis-py's default is 5 s).
        blocking = {"health_check_interval": 30, "socket_timeout": Waker.block_s + 5}
        return Waker(redis_client(url, settings, **blocking),
                     redis_client(url, settings, single_connection_client=True, **blocking),
                     self._lists, stopping=self._stopping.is_set)

    def start(self) -> FastConsumer:
        # every expires and eta is judged on the broker's clock (wire/clock.py), from the first take
        CLOCK_FOLLOWER.follow(redis_client(self.app.conf.broker_url, self._settings,
                                           health_check_interval=30), wait=True)
        if self.leases is not None:  # what a dead predecessor on this host held comes back first
            self.leases.start()
        self.pins.start()  # registered before it serves: a sequence may start here at once
        if self.waker is not None:
            self.waker.start()
        self._thread.start()
        log.info("fast consumer on %s", ", ".join(self.queues))
        return self

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Take no more messages; wait up to ``grace_s`` for those in flight to finish."""
        self._stopping.set()
        self._close_waker()
        self._thread.join(timeout=5)
        self._drain(grace_s)
        stuck = self._stuck_on_device(grace_s)
        if self.holdings.held():  # those in flight, and retries waiting for their eta
            self._restore([h.delivery for h in self.holdings.held()], died=stuck)
        self._let_go()
        self.pins.stop()
        if self.leases is not None:
            self.leases.stop()

    def _lease_again(self, tags: list[str]) -> None:
        """Redis forgot what ``tags`` held here (leases.py): lease again those not answered, so
        that they run here and go back to their queue if this worker dies; give up any another
        holder took meanwhile."""
        assert self.leases is not None
        again = self.pipeline.forgotten(tags)
        adopted = set(self.leases.adopt(again))
        taken = [tag for tag, _list, _entry in again if tag not in adopted]
        if taken:
            self.pipeline.forget(taken)

    def _restore_held(self) -> None:
        """Put every message still held back on its queue at once, as kombu restores an
        unacknowledged message (marked ``redelivered``), instead of leaving it for the visibility
        timeout. One script call: each message is either back on its queue or still unacked."""
        self._restore([h.delivery for h in self.holdings.held()])

    def _restore(self, deliveries: Sequence[TakenMessage], died: Collection[str] = ()) -> None:
        """Put ``deliveries`` back on their queues, marked ``redelivered``, in one script call
        (those kombu delivered are left to the broker); a death is counted against those whose
        request IDs are in ``died`` in the same call, as the sweep counts one for a
        request on a dead worker's device."""
        # kombu's (an asyncinfer.infer Celery's consumer received) go back through the broker
        held = [d for d in deliveries if d.tag and d.message is None]
        if not held:
            return
        count = self.leases is not None and self.leases.count_deaths
        try:
            back = restore(self.client, [(d.tag, d.list_key, restored_message(d),
                                          d.request_id if count and d.request_id in died else "")
                                         for d in held],
                           holder=self.leases.holder if self.leases is not None else "",
                           deaths_ttl_s=int(self.leases.deaths_ttl_s if self.leases is not None
                                            else 1))
            log.warning("sent %d held requests back to their queues", back)
            if back < len(held):
                log.warning("%d held requests were not sent back: their leases lapsed here and "
                            "they went back already (another worker may run them now)",
                            len(held) - back)
        except Exception:  # noqa: BLE001 - they stay unacknowledged: redelivered after the timeout
            log.exception("could not send %d held requests back; they are redelivered after the "
                          "visibility timeout", len(held))

    def _mark_on_device(self, items: Sequence[WorkItem], wait: bool) -> None:
        assert self.leases is not None
        self.leases.on_device(self.holdings.tags_of(items), wait=wait)

    def _give_back_but(self, keep: set[str]) -> None:
        """The device hung and the process leaves (policy/hangs.py): take no more, write what is
        finished, send every held request back to its queue at once but those in ``keep`` (on the
        device: still leased and marked, so the sweep counts a death against each once this
        process is gone)."""
        self._stopping.set()
        self._close_waker()
        self._thread.join(timeout=5)
        self.writer.close()
        self._restore([h.delivery for h in self.holdings.held()
                       if h.delivery.request_id not in keep])

    def _stuck_on_device(self, grace_s: float) -> set[str]:
        """(A stop, after its grace.) The requests of batches still on the device that count as
        hung, as if the hang watch had found them: on the device longer than the grace and than
        three times the model's slowest batch (at most its hang limit). They go back to their
        queues with the rest, but not as if they had not run: a death is counted against each
        (as the sweep counts one for a worker that died with them on its device), so a request
        that hangs every device is isolated, not passed from worker to worker. Empty when deaths
        are not counted."""
        if self.leases is None or not self.leases.count_deaths:
            return set()
        stuck: set[str] = set()
        for runner in self.runtime.runners():
            watch = runner.hangs
            hung = watch.stuck(min(watch.limit_s(), max(grace_s, 3 * (watch.slowest_s or 0.0))))
            if hung is None:
                continue
            log.warning("%s when this worker stopped; a death is counted against its request(s) "
                        "(it goes back to its queue now, with the rest)", hung.describe())
            self._note_hang(hung)
            stuck |= {item.request.id for item in hung.items}
        return stuck

    def _on_stalled(self, stall: Hung) -> None:
        """A batch that runs alone (a suspect: a request in it saw a worker die) stalls the device
        (engine/hangs.py): take nothing until it comes off, and send what of its model waits here
        for the device back to its queue, for other workers (the batch itself runs on)."""
        self._stall = stall.items
        back = self.give_back(stall.model)
        if back:
            log.warning("sent back %d requests of model %s that waited behind the stalled batch",
                        back, stall.model)

    def _stalled(self) -> bool:
        """Whether a stalled batch is still on the device (no take until it comes off)."""
        items = self._stall
        if items and any(item.on_device for item in items):
            return True
        self._stall = ()
        return False

    def _note_hang(self, hung: Hung) -> None:
        """Note the hang against the hung batch's requests (named when one fails for good)."""
        if self.leases is not None:
            self.leases.note_hang([item.request.id for item in hung.items],
                                  f"{hung.describe()}, on worker {self.hostname}")

    def _give_back_all(self) -> None:
        """The device is wedged and the process leaves: take no more, write what is finished,
        send every held request back to its queue at once."""
        self._stopping.set()
        self._close_waker()
        self._thread.join(timeout=5)  # what its last take took is held, and sent back below
        self.writer.close()
        self._restore_held()

    # -- which queues (model control: worker/model_control.py) ---------------------------------

    def set_queues(self, queues: Sequence[str], timeout_s: float = 30.0) -> bool:
        """Take from ``queues`` from now on (a model loaded, or unloaded); returns once the
        consumer thread took them up, between two takes (False: not within ``timeout_s``, or it
        stops). From then on it takes nothing from a queue left out."""
        with self._retarget_lock:
            self._retargeted.clear()
            self._next_queues = list(dict.fromkeys(queues))
            waker = self.waker
            if waker is not None:
                waker.interrupt()
            deadline = time.monotonic() + timeout_s
            while not self._retargeted.wait(0.1):
                if self._stopping.is_set() or time.monotonic() > deadline:
                    return False
            return True

    def _interrupted(self) -> bool:
        return self._stopping.is_set() or self._next_queues is not None

    def _apply_queues(self) -> None:
        """(The consumer thread, between two takes.) Take from the queues :meth:`set_queues` gave:
        a new waker watches their lists (the old one's watches lapse by themselves)."""
        queues, self._next_queues = self._next_queues or [], None
        if queues != self.queues:
            self._close_waker()
            self.queues = queues
            self._lists = self.pins.lists_for(queues) + priority_lists(queues)
            self.pins.renew()
            self.waker = self._new_waker()
            if self.waker is not None:
                self.waker.start()
            log.info("fast consumer on %s", ", ".join(queues) or "no queue")
        self._retargeted.set()

    def _close_waker(self) -> None:
        if self.waker is not None:
            self.waker.close()

    def give_back(self, model: str) -> int:
        """(An unload of ``model``, whose queue it no longer takes.) Send back to their queue the
        requests of ``model`` it holds that have not started on the device — retries waiting for
        their eta, requests waiting in the batcher — so that another worker serves them; those
        on the device (or prepared for it) run on here. How many went back."""
        held = [h for h in self.holdings.held() if h.delivery.model == model
                and h.delivery.tag and h.delivery.message is None]
        scheduled = [h.delivery for h in held if h.state == SCHEDULED]
        withdrawn = self.runtime.withdraw({h.delivery.request_id for h in held
                                           if h.state != SCHEDULED and h.delivery.request_id})
        back = scheduled + [h.delivery for h in held
                            if h.state != SCHEDULED and h.delivery.request_id in withdrawn]
        self.holdings.release(back)  # first: a retry whose eta comes now is not started
        self._restore(back)
        return len(back)

    def started_of(self, model: str) -> set[int]:
        """The requests of ``model`` it holds, handed to a runner or about to be (not those
        waiting for their eta): their identities, for :meth:`still_held`."""
        return {id(h.delivery) for h in self.holdings.held()
                if h.delivery.model == model and h.state != SCHEDULED}

    def still_held(self, which: set[int]) -> int:
        """How many of ``which`` (:meth:`started_of`) it still holds (not yet answered)."""
        return sum(1 for h in self.holdings.held() if id(h.delivery) in which)

    def held_of(self, model: str) -> int:
        """How many requests of ``model`` it holds (taken, not yet answered)."""
        return sum(1 for h in self.holdings.held() if h.delivery.model == model)

    # -- intake --------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            try:
                if self._next_queues is not None:
                    self._apply_queues()
                if self._stalled():
                    self._stopping.wait(0.1)
                    continue
                room = self.holdings.room(self._interrupted)
                if room <= 0 or self._next_queues is not None:
                    continue
                waker = self.waker
                if waker is None:  # it takes from no queue (every model unloaded)
                    self._stopping.wait(1.0)
                    continue
                # Take atomically with the bookkeeping; once a take leaves the queues empty, wait
                # for the watchers (which never pop) and take again.
                waker.clear()
                started = (self.writer.started_for_take(self.hostname) if self.policy.track_started
                           else None)
                taken = self.taker.take(self._lists, room, started,
                                        self.leases.terms if self.leases is not None else None,
                                        watcher=waker.token, watched=waker.passable(),
                                        max_body_bytes=self.policy.max_payload_bytes or 0)
                if self.taker.passed:
                    waker.watch_passed(self.taker.passed)
                if taken:
                    self.pipeline.took(taken)
                backoff.reset()
                if len(taken) < room:
                    self.pipeline.first_attempts.send(due_only=True)  # idle, it wakes at least every 1 s
                    waker.arm()
                    waker.wait(1.0)
            except redis.RedisError as exc:
                # Lost connection, a timeout, OOM, READONLY (a demoted master), ...: nothing was
                # taken that is not recorded; wait and take again.
                wait_s = backoff.failed()
                log.warning("consumer: Redis failed (%s: %s); again in %.1f s", type(exc).__name__,
                            exc, wait_s)
                self._stopping.wait(wait_s)
            except Exception:  # noqa: BLE001 - the consumer must survive whatever comes in
                wait_s = backoff.failed()
                log.exception("consumer error; going on in %.1f s", wait_s)
                self._stopping.wait(wait_s)
