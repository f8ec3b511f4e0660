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
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, TypeVar

from celery import Celery

from asyncinfer.broker.clock_skew import CLOCK_FOLLOWER
from asyncinfer.broker.connections import redis_client
from asyncinfer.broker.urls import shard_urls
from asyncinfer.config.bound import settings_of
from asyncinfer.config.settings import Settings
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.hangs import Hung
from asyncinfer.engine.hooks import admit_all, ignore_launch
from asyncinfer.policy.policy import Policy
from asyncinfer.worker.consumers.consumer import STOP_GRACE_S, PipelineConsumer
from asyncinfer.worker.consumers.shard_intake import ShardIntake, wait_retargeted
from asyncinfer.worker.output.shard_writers import by_shard
from asyncinfer.worker.requests.holdings import SCHEDULED
from asyncinfer.worker.requests.lease_gate import LeaseGate
from asyncinfer.worker.requests.taken import TakenMessage
from asyncinfer.worker.runtime import WorkerRuntime

if TYPE_CHECKING:
    from asyncinfer.tracing.spans import Tracing

__all__ = ["FastConsumer"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class FastConsumer(PipelineConsumer):
    """Consumes ``queues`` for ``runtime`` until :meth:`stop`; at most ``max_in_flight`` at once.

    From one Redis, or — a cluster URL that spreads requests over N shards — from each shard,
    through an intake per shard (shard_intake.py) feeding the one pipeline: each request's
    result, acknowledgement and leases on the shard it came from.
    """

    def __init__(self, app: Celery, runtime: WorkerRuntime, queues: Sequence[str], *,
                 hostname: str, policy: Policy, send_events: bool = False,
                 tracing: Tracing | None = None) -> None:
        settings = settings_of(app) or Settings.from_env()
        urls = shard_urls(str(app.conf.broker_url))
        # The result writers' own connections: a pool check-out per command costs a poll() and
        # redis-py's argument checks (~8 % of the worker's CPU).
        super().__init__(app, runtime, hostname=hostname, policy=policy, send_events=send_events,
                         tracing=tracing,
                         results=[redis_client(url, settings, health_check_interval=30,
                                               single_connection_client=True) for url in urls])
        self._settings = settings
        self._retarget_lock = threading.Lock()
        #: One per shard it takes from (index: the shard).
        self.intakes = [ShardIntake(self, url, shard, settings, queues, shards=len(urls))
                        for shard, url in enumerate(urls)]
        #: The batch that stalls the device, while it is there: takes wait (engine/hangs.py).
        self._stall: Sequence[WorkItem] = ()
        first = self.intakes[0].leases
        counting = first is not None and first.count_deaths
        #: A batch launches with what is still leased here (a worker cut off past its lease).
        self.gate = LeaseGate(self.holdings, [intake.leases for intake in self.intakes],
                              self._stopping)
        self.use_device(self._give_back_all,
                        on_launch=self._on_launch if counting else ignore_launch,
                        give_back_but=self._give_back_but if counting else None,
                        note_hang=self._note_hang, on_stalled=self._on_stalled,
                        admit=self.gate.admit if first is not None else admit_all)
        if first is not None:  # a request failed for its deaths names its last hang
            self.pipeline.death_note = self._hang_note

    @property
    def queues(self) -> list[str]:
        """The queues it takes from."""
        return self.intakes[0].queues

    def start(self) -> FastConsumer:
        # every expires and eta is judged on the broker's clock (wire/clock.py), from the first take
        CLOCK_FOLLOWER.follow(redis_client(self.intakes[0].url, self._settings,
                                           health_check_interval=30), wait=True)
        for intake in self.intakes:
            intake.start_leases()
        for intake in self.intakes:
            intake.start()
        log.info("fast consumer on %s%s", ", ".join(self.queues),
                 f" ({len(self.intakes)} shards)" if len(self.intakes) > 1 else "")
        return self

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Take no more messages; wait up to ``grace_s`` for those in flight to finish."""
        self._halt()
        self._drain(grace_s)
        stuck = self._stuck_on_device(grace_s)
        if self.holdings.held():  # those in flight, and retries waiting for their eta
            self._restore([h.delivery for h in self.holdings.held()], died=stuck)
        self._let_go()
        for intake in self.intakes:
            intake.stop()

    def _halt(self) -> None:
        """Take no more: every intake's thread ends (what its last take took is held)."""
        self._stopping.set()
        for intake in self.intakes:
            intake.halt()

    def _hang_note(self, d: TakenMessage) -> str:
        leases = self.intakes[d.shard].leases
        return leases.hang_note(d.request_id) if leases is not None else ""

    def _restore_held(self) -> None:
        """Put every message still held back on its queue at once, as kombu restores an
        unacknowledged message (marked ``redelivered``), instead of leaving it for the visibility
        timeout. One script call per shard: each message is either back or still unacked."""
        self._restore([h.delivery for h in self.holdings.held()])

    def _restore(self, deliveries: Sequence[TakenMessage], died: Collection[str] = ()) -> None:
        """Put ``deliveries`` back on their queues, marked ``redelivered``, in one script call
        per shard (those kombu delivered are left to the broker); a death is counted against
        those whose request IDs are in ``died`` in the same call, as the sweep counts one for a
        request on a dead worker's device."""
        # kombu's (an asyncinfer.infer Celery's consumer received) go back through the broker
        held = [d for d in deliveries if d.tag and d.message is None]
        for intake, group in zip(self.intakes, by_shard(held, len(self.intakes)), strict=True):
            if not group:
                continue
            try:
                back = intake.restore(group, died)
                log.warning("sent %d held requests back to their queues", back)
                if back < len(group):
                    log.warning("%d held requests were not sent back: their leases lapsed here "
                                "and they went back already (another worker may run them now)",
                                len(group) - back)
            except Exception:  # noqa: BLE001 - they stay unacknowledged: redelivered after the timeout
                log.exception("could not send %d held requests back; they are redelivered after "
                              "the visibility timeout", len(group))

    def _mark_on_device(self, items: Sequence[WorkItem], wait: bool) -> None:
        marks = self.holdings.tags_of(items)
        for intake, shard_marks in zip(self.intakes, self._by_shard(marks, lambda m: m[1]), strict=True):
            if shard_marks:
                assert intake.leases is not None
                intake.leases.on_device(shard_marks, wait=wait)

    def _by_shard(self, entries: Sequence[_T], request_id: Callable[[_T], str]) -> list[list[_T]]:
        """``entries`` by the shard of the held request each names (index: the shard)."""
        if len(self.intakes) == 1:
            return [list(entries)]
        groups: list[list[_T]] = [[] for _ in self.intakes]
        for entry in entries:
            d = self.holdings.find(request_id(entry))
            groups[d.shard if d is not None else 0].append(entry)
        return groups

    def _give_back_but(self, keep: set[str]) -> None:
        """The device hung and the process leaves (policy/hangs.py): take no more, write what is
        finished, send every held request back to its queue at once but those in ``keep`` (on the
        device: still leased and marked, so the sweep counts a death against each once this
        process is gone)."""
        self._halt()
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
        leases = self.intakes[0].leases
        if leases is None or not leases.count_deaths:
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

    def stalled(self) -> bool:
        """Whether a stalled batch is still on the device (no take until it comes off)."""
        items = self._stall
        if items and any(item.on_device for item in items):
            return True
        self._stall = ()
        return False

    def _note_hang(self, hung: Hung) -> None:
        """Note the hang against the hung batch's requests (named when one fails for good)."""
        line = f"{hung.describe()}, on worker {self.hostname}"
        ids = [item.request.id for item in hung.items]
        for intake, group in zip(self.intakes, self._by_shard(ids, str), strict=True):
            if group and intake.leases is not None:
                intake.leases.note_hang(group, line)

    def _give_back_all(self) -> None:
        """The device is wedged and the process leaves: take no more, write what is finished,
        send every held request back to its queue at once."""
        self._halt()  # what the last takes took is held, and sent back below
        self.writer.close()
        self._restore_held()

    # -- which queues (model control: worker/model_control.py) ---------------------------------

    def set_queues(self, queues: Sequence[str], timeout_s: float = 30.0) -> bool:
        """Take from ``queues`` from now on (a model loaded, or unloaded); returns once every
        intake took them up, between two takes (False: not within ``timeout_s``, or it stops).
        From then on it takes nothing from a queue left out."""
        with self._retarget_lock:
            for intake in self.intakes:
                intake.retarget(list(dict.fromkeys(queues)))
            return wait_retargeted(self.intakes, self._stopping.is_set, timeout_s)

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
