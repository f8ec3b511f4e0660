"""What every consumer of a device worker's ``infer.*`` queues is made of, whatever its transport:
the one pipeline (worker/pipeline.py) and its output side — the in-flight account, task events,
the settlement, the result writer and the outcomes — and the device's hooks into them.

Two transports feed it: the Redis lists' take script (fast_consumer.py, the default on a Redis
broker) and kombu, through Celery's own consumer (:meth:`PipelineConsumer.received`;
kombu_intake.py when kombu alone feeds it: RabbitMQ, or ``ASYNCINFER_CONSUMER=celery``). They
differ only in how a message is taken, leased, acknowledged and given back; each message carries
which (:class:`~asyncinfer.worker.requests.taken.TakenMessage`'s ``message``), so one pipeline can
be fed by both: a fast consumer's worker whose Celery consumer receives ``asyncinfer.infer`` on a
stage queue.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import redis
from celery import Celery

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.hangs import Hung
from asyncinfer.engine.hooks import DeviceHooks, LaunchGate, LaunchObserver, admit_all, ignore_launch
from asyncinfer.policy.hangs import Hang
from asyncinfer.policy.policy import Policy
from asyncinfer.policy.time_limits import Wedge
from asyncinfer.wire.messages import envelope_text
from asyncinfer.worker.celery_errors import as_celery
from asyncinfer.worker.events import TaskEvents
from asyncinfer.worker.lifecycle import Settlement
from asyncinfer.worker.output.outcome import Outcome
from asyncinfer.worker.output.outcomes import Outcomes
from asyncinfer.worker.output.shard_writers import ShardWriters
from asyncinfer.worker.output.trace_spans import WorkerSpans
from asyncinfer.worker.pipeline import Pipeline
from asyncinfer.worker.requests.holdings import Holdings
from asyncinfer.worker.requests.taken import TakenMessage
from asyncinfer.worker.runtime import WorkerRuntime

if TYPE_CHECKING:
    from asyncinfer.tracing.spans import Tracing

__all__ = ["PipelineConsumer", "STOP_GRACE_S"]

log = logging.getLogger(__name__)

#: What a clean stop waits for the requests in flight before it gives the rest back: under the 15 s
#: after which ``asyncinfer up``'s supervisor kills a child that has not exited (a kill while a
#: batch is on the device would count a death against its requests).
STOP_GRACE_S = 10.0


class PipelineConsumer:
    """The pipeline of ``runtime``'s requests on worker ``hostname``, and its output side.

    ``results``: the writers' Redis, one per shard its requests are taken from (the broker's;
    with a broker that is not Redis, the results'); ``shared``: whether the results live there
    too (None: when the result backend's URL is the broker's).
    """

    def __init__(self, app: Celery, runtime: WorkerRuntime, *, hostname: str, policy: Policy,
                 send_events: bool, results: Sequence[redis.Redis], shared: bool | None = None,
                 tracing: Tracing | None = None) -> None:
        self.app = app
        self.runtime = runtime
        self.hostname = hostname
        #: Retries and budget, time limits, the in-flight bound, the payload limit.
        self.policy = policy
        #: Everything taken and not yet answered: the one in-flight account.
        self.holdings = Holdings(lambda: policy.backpressure.held_at_most(runtime.runners()),
                                 on_scheduled=self._on_scheduled,
                                 least_take=self._least_take)
        #: ``qos()``: the prefetch window of the Celery consumer that hands over kombu's messages
        #: (a new one after each reconnection); None until one does.
        self.kombu_qos: Callable[[], Any] | None = None
        #: Celery task events (Flower), when the worker sends them (-E, ASYNCINFER_SEND_EVENTS).
        self.events = TaskEvents(app, hostname, enabled=send_events)
        self.settlement = Settlement(hostname, runtime.device.label, policy, events=self.events,
                                     metrics=runtime.metrics)
        self.writer = ShardWriters(app, results, worker=hostname,
                                   before_write=lambda batch: self.outcomes.before_write(batch),
                                   on_written=self._written,
                                   shared=shared,
                                   spans=WorkerSpans(tracing, hostname) if tracing else None)
        self.outcomes = Outcomes(self.writer, self.settlement, self.holdings, runtime.response)
        self._stopping = threading.Event()
        #: Set once it stops taking (its intakes' threads read it).
        self.stopped_event = self._stopping
        #: What happens to each request taken, from the take to the write.
        self.pipeline = Pipeline(app, runtime, policy, hostname=hostname, holdings=self.holdings,
                                 outcomes=self.outcomes, writer=self.writer, events=self.events,
                                 stopping=self._stopping.is_set, traced=tracing is not None)

    def _written(self, batch: list[Outcome]) -> None:
        """(The writer's, after each write.) ``batch`` is stored and acknowledged; a sequence
        request whose result was left out, as the fleet had already failed it, takes back the
        state it left (engine/sequences.py)."""
        self.outcomes.written(batch)
        for outcome in batch:
            if outcome.superseded:
                void_sequence_state(self.runtime, outcome.delivery)

    def received(self, messages: list[Any]) -> None:
        """(Celery's consumer, with the messages of this pipeline kombu delivered in one turn of
        its event loop: worker/celery_consumer.py.) Start them together, as the fast
        consumer starts what one take popped; those that come while this consumer stops are left
        unacknowledged, for the broker to give back."""
        if self._stopping.is_set() or not messages:
            return
        received_at = time.perf_counter()
        deliveries = []
        for message in messages:
            queue = str((message.delivery_info or {}).get("routing_key") or "")
            try:
                raw = envelope_text(message)
            except Exception as exc:  # noqa: BLE001 - no envelope can be written: fails as malformed
                raw = f"message of {queue}: {type(exc).__name__}: {exc}"
            deliveries.append(TakenMessage(raw=raw.encode(), queue=queue, message=message,
                                           received_at=received_at, deaths=taken_deaths(message),
                                           body_cut_bytes=body_cut_bytes(message)))
        self.pipeline.received(deliveries)

    def _least_take(self, bound: int) -> int:
        """The least room a take waits for: the policy's for a worker of one model; 1 (a take at
        each answer) for a worker of several, whose models' requests share one bound and no
        order (holdings.py)."""
        if len(self.runtime.runners()) != 1:
            return 1
        return self.policy.backpressure.least_take(bound)

    def _on_scheduled(self, n: int) -> None:
        """``n`` more (or fewer) of kombu's held messages wait for their eta: the prefetch window
        widens (narrows) by as many, as Celery's consumer does for its ETA tasks."""
        qos = self.kombu_qos() if self.kombu_qos is not None else None
        if qos is None:
            return
        if n > 0:
            qos.increment_eventually(n)
        elif n < 0:
            qos.decrement_eventually(-n)

    #: Longest a batch that runs alone waits for the answers of what ran before it (seconds).
    SETTLE_S = 10.0

    def _on_launch(self, items: Sequence[WorkItem]) -> None:
        """A batch goes onto the device: a death from now on counts against its requests. One
        that runs alone (a request in it saw a death) first waits until what ran before it is
        answered (up to ``SETTLE_S``), and for Redis to have its marks."""
        ids = {i.request.id for i in items}
        alone = any(i.isolated for i in items)
        if alone:
            left = self.holdings.settle(ids, self.SETTLE_S)
            if left:
                log.warning("a batch that runs alone launches with %d requests that ran before "
                            "it not yet answered (their answers are late)", left)
        self.holdings.launched(ids)
        self._mark_on_device(items, alone)

    def _mark_on_device(self, items: Sequence[WorkItem], wait: bool) -> None:
        """Mark ``items`` as on the device in their leases (each transport its own way); wait
        for Redis to have the marks when ``wait``."""

    def use_device(self, give_back: Callable[[], None],
                   on_launch: LaunchObserver = ignore_launch,
                   give_back_but: Callable[[set[str]], None] | None = None,
                   note_hang: Callable[[Hung], None] = lambda hung: None,
                   on_stalled: Callable[[Hung], None] = lambda stall: None,
                   admit: LaunchGate = admit_all) -> None:
        """Hook this consumer to the device: a wedged device's request fails and ``give_back()``
        hands back what is held; a batch's results are written at once; ``on_launch`` sees each
        batch go onto the device; a hung device (policy/hangs.py) is noted (``note_hang``) and
        what is held but the requests on the device goes back (``give_back_but(keep)``; default:
        everything, ``give_back()``); ``on_stalled`` hears of a batch far slower than the model's
        batches (engine/hangs.py); ``admit`` says which of a batch's requests may still run here
        (worker/requests/lease_gate.py)."""
        but = give_back_but or (lambda keep: give_back())
        self.runtime.use(DeviceHooks(on_wedged=Wedge(self._fail_wedged, give_back),
                                     settling=self.writer.gathering, on_launch=on_launch,
                                     admit=admit,
                                     on_hung=Hang(note_hang, but), on_stalled=on_stalled))

    def kombu_connection_lost(self) -> None:
        """(Celery's consumer, its connection to the broker lost, before it connects again.)
        Nothing here: on Redis what kombu delivered stays leased to this worker and can be
        acknowledged on the next connection (kombu_intake.py gives it up on RabbitMQ)."""

    @property
    def stopped(self) -> bool:
        """Whether it was told to stop (or gave everything back)."""
        return self._stopping.is_set()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Take no more, let what is in flight finish within ``grace_s``, give the rest back:
        each transport its own way."""
        raise NotImplementedError

    @property
    def max_in_flight(self) -> int:
        return self.holdings.max_in_flight

    @property
    def in_flight(self) -> int:
        return self.holdings.in_flight

    def _fail_wedged(self, item: WorkItem, exc: BaseException) -> None:
        """A wedged device's request fails (policy/time_limits.py's :class:`Wedge`)."""
        d = self.holdings.find(item.request.id)
        if d is not None and not item.future.done():
            self.outcomes.fail(d, as_celery(exc), None, retry=False)
            self.holdings.release([d])

    def _drain(self, grace_s: float) -> None:
        """(A stop, taking no more.) Wait up to ``grace_s`` for what is in flight, then send the
        first attempts' count, write what is finished and stop the events."""
        left = self.holdings.drain(grace_s)
        self.pipeline.first_attempts.send(due_only=False)
        self.writer.close()
        self.events.close()
        if left:
            log.warning("%d requests still in flight at shutdown go back to their queues", left)

    def _let_go(self) -> None:
        """(At a stop, the output closed.) What is still held goes back to its queue: it is no
        longer this worker's, so nothing settles it here — the runtime's shutdown fails what it
        never ran, which would otherwise be logged, counted and announced as a FAILURE of a
        request that runs elsewhere."""
        self.holdings.release([h.delivery for h in self.holdings.held()])


def taken_deaths(message: Any) -> int:
    """The worker deaths the atomic take read for kombu's ``message`` (broker/atomic_take.py)."""
    deaths_of = getattr(message.channel, "deaths_of", None)
    return int(deaths_of(message.delivery_tag)) if deaths_of is not None else 0


def body_cut_bytes(message: Any) -> int:
    """The bytes of kombu's ``message``'s body that the atomic take left out, over the largest
    body a worker takes (0: none; read once)."""
    cut_of = getattr(message.channel, "body_cut_of", None)
    return int(cut_of(message.delivery_tag)) if cut_of is not None else 0


def void_sequence_state(runtime: WorkerRuntime, d: TakenMessage) -> str:
    """Take back the state that request ``d`` (a sequence's, run here although the fleet had
    already failed it with SequenceStateLost) left in its model's sequence book: 'reverted',
    'lost' or '' (SequenceBook.void)."""
    model = d.model or d.queue
    why = (f"the state of its sequence of model '{model}' is lost: request {d.request_id} of it "
           f"ran after it had been failed as lost (its worker was frozen or cut off past its "
           f"lease); start the sequence again (sequence_start)")
    for runner in runtime.runners():
        if runner.sequences is not None and runner.model.name == model:
            done = runner.sequences.void(d.request_id, why)
            if done:
                log.warning("request %s of model %s ran after it was failed as lost: its "
                            "sequence's state is %s", d.request_id, model,
                            "as before it" if done == "reverted" else "dropped (lost)")
                return done
    return ""
