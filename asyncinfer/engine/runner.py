"""A model on the device: batches go through preprocess, device and postprocess stages.

Callers :meth:`~ModelRunner.submit` requests and get futures. Batches formed by the batcher flow
through three stages, each in its own thread so that successive batches overlap: a CPU stage
(joins the rows, :meth:`Model.preprocess`), a device stage per model instance (pinned,
non-blocking copy to the device, forward on the instance's own stream, copy back, record an event)
and a completion stage (blocks on the event — never spins — runs :meth:`Model.postprocess`, gives
each request exactly its own rows). With ``graph_batch_sizes`` each instance replays its own
captured graphs instead of the eager forward (engine/graphs.py). With ``pipelined=False`` one
thread runs the three stages of a batch one after another. When a batch raises, each of its
requests runs alone (eager), so one bad request does not fail the others. A decoupled model's
batch runs its steps on the device thread instead of one forward (engine/streaming.py), each
step's parts handed to their requests as they come; with in-flight batching
(``Model.inflight_batching``) the requests that arrive meanwhile join it between two steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.batcher import Batcher, WorkItem
from asyncinfer.engine.compile import compile_model
from asyncinfer.engine.completion import Completed, deliver, drop_revoked, rows_of, settle
from asyncinfer.engine.device import Device
from asyncinfer.engine.failures import BatchObserver, Transient, is_transient, model_failure
from asyncinfer.engine.gate import DeviceGate
from asyncinfer.engine.graphs import GraphSet, capture_graphs
from asyncinfer.engine.hangs import HangWatch
from asyncinfer.engine.hooks import DeviceHooks, ignore_batch
from asyncinfer.engine.job import Job, forward_only, off_device
from asyncinfer.engine.limits import LimitWatch
from asyncinfer.engine.sequences import SequenceBook, request_sequence
from asyncinfer.engine.streaming import launch_stream
from asyncinfer.engine.timer import TimeLimits, Timer
from asyncinfer.engine.warmup import warm_up
from asyncinfer.errors import InvalidRequest, ModelError
from asyncinfer.models.base import Batch, Model
from asyncinfer.supervision.vital import vital_thread
from asyncinfer.wire.protocol import FORWARD_STAGE, Request

__all__ = ["ModelRunner"]

log = logging.getLogger(__name__)

#: Batches between stages at most (the slots below are the real bound).
_STAGE_DEPTH = 4


class ModelRunner:
    """One model on one device: a batcher feeding the stage threads."""

    def __init__(self, model: Model, device: Device, options: ModelOptions | None = None, *,
                 is_revoked: Callable[[str], bool] | None = None, timer: Timer | None = None,
                 is_transient: Transient = is_transient, on_batch: BatchObserver | None = None,
                 hooks: DeviceHooks | Callable[[], DeviceHooks] | None = None,
                 record_batches: bool = False, hang_after_s: float | None = None) -> None:
        self.model = model
        #: Each request's result carries its batch's record (tracing: engine/completion.py).
        self.record_batches = record_batches
        self.device = device
        opts = options or model.options
        if not model.batchable or not model.batch_dimension:  # batches of one request: a graph,
            # if asked for, of that size only
            opts = opts.merged({"max_batch_size": 1, "max_delay_ms": 0.0, "preferred_batch_sizes": (),
                                "graph_batch_sizes": (1,) if opts.graph_batch_sizes else ()})
        self.options = opts
        self.max_batch_size = opts.max_batch_size
        self.is_revoked = is_revoked or (lambda request_id: False)
        self.timer = timer
        #: Which model exceptions are worth retrying; who hears of each finished batch.
        self.is_transient = is_transient
        self.on_batch: BatchObserver = on_batch or ignore_batch
        #: Whom the runner tells of a batch going onto the device, of settling a batch's requests,
        #: of a wedged device (engine/hooks.py): fixed, or asked each time (the worker's runtime
        #: hands over to whoever serves its requests).
        fixed = hooks if isinstance(hooks, DeviceHooks) else DeviceHooks()
        self._hooks: Callable[[], DeviceHooks] = hooks if callable(hooks) else (lambda: fixed)
        #: The requests' time limits, on the timer.
        self.limits = LimitWatch(model.name, timer, lambda: self._hooks().on_wedged,
                                 decoupled=model.decoupled)
        #: Batches on the device, held to the hang limit (engine/hangs.py; ``hang_after_s``, else
        #: derived from the batches it finished).
        self.hangs = HangWatch(model.name, lambda: self._hooks().on_hung,
                               on_stalled=lambda: self._hooks().on_stalled, after_s=hang_after_s)
        #: Whether the model answers in steps (Model.stream): one row per request...
        self._decoupled = model.decoupled
        #: ...and whether requests join its running batch between steps (in-flight batching).
        self._inflight = model.decoupled and model.inflight_batching
        self.batcher = Batcher(opts.max_batch_size, opts.max_delay_ms, opts.preferred_batch_sizes,
                               group_by_cost=opts.group_by_cost,
                               max_cost_ratio=opts.cost_ratio(device.is_accelerator),
                               max_priority_passes=opts.max_priority_passes)
        #: A stateful model's sequences (engine/sequences.py); None: stateless.
        self.sequences = SequenceBook.of(model, self.batcher.put)
        #: Seconds the device takes with a batch, from its launch to its results on the host (a
        #: moving average; None until one ran): how fast this model gets through what a worker
        #: holds. Not from the batch's forming: a batch formed while another is on the device
        #: waits for it, and a pace with that wait in it would count each batch twice.
        self.batch_s: float | None = None
        #: A batch that must run alone has the device to itself (no other instance's batch).
        self._gate = DeviceGate()
        # A batch holds a slot from the moment it is formed until its results are on the host
        # (postprocess runs after).
        # One slot per instance plus one lets the next batch be preprocessed while the device
        # works, and no more: batches keep forming from what arrives while the device is busy.
        self._slots = threading.Semaphore(opts.instances + 1)
        self._closing = False
        self._to_device: queue.Queue[Job | None] = queue.Queue(_STAGE_DEPTH)
        self._to_complete: queue.Queue[Job | None] = queue.Queue(_STAGE_DEPTH)
        #: Each instance's captured graphs (``graph_batch_sizes``), captured at :meth:`start`;
        #: empty: every batch runs eager.
        self.graphs: list[GraphSet] = []
        name = model.name
        # A stage gets its own thread only when it has work to overlap: a model's own
        # preprocess, its own postprocess or an accelerator's event to wait on. Otherwise the
        # device thread does it inline and saves two thread hand-offs per batch — unless
        # another batch is already waiting: then handing the results (splitting them, the
        # requests' callbacks: ~0.08 ms a request) to the post thread starts the next batch
        # that much sooner (sim-slow, 256 in flight: 564 → 601 rows/s against a limit of 611).
        # In-flight batching prepares the requests that join a stream on the device thread: a
        # prep thread would take them out of the batcher first, for a batch of their own.
        self._prep_thread = (opts.pipelined and _overrides(model, "preprocess")
                             and not self._inflight)
        self._post_always = _overrides(model, "postprocess") or device.is_accelerator
        if opts.pipelined:
            self._threads = [vital_thread(self._device_loop, f"device-{name}-{i}", i)
                             for i in range(opts.instances)]
            if self._prep_thread:
                self._threads.append(vital_thread(self._prep_loop, f"prep-{name}"))
            self._threads.append(vital_thread(self._complete_loop, f"post-{name}"))
        else:
            self._threads = [vital_thread(self._serial_loop, f"serial-{name}-{i}", i)
                             for i in range(opts.instances)]

    def start(self) -> ModelRunner:
        """Load the model onto the device and start its threads."""
        self.device.bind_thread()
        self.model.load(self.device.torch_device)
        compile_model(self.model, self.device.torch_device, self.options)
        if self.sequences is None:  # a stateful model: no warm-up, no graphs (it needs controls)
            began = time.perf_counter()
            warm_up(self.model, self.device, self.options)
            self.hangs.observe(time.perf_counter() - began)  # what a batch may take, at least
        if self._decoupled and self.options.graph_batch_sizes:
            log.warning("model %s: graph_batch_sizes ignored: it streams (decoupled), its steps "
                        "run eager", self.model.name)
        elif not self._decoupled and self.sequences is None:
            self.graphs = capture_graphs(self.model, self.device, self.options)
        for t in self._threads:
            t.start()
        self.hangs.start()
        return self

    def submit(self, request: Request, received_at: float | None = None,
               expires_in_s: float | None = None,
               time_limits: TimeLimits | None = None, alone: bool = False, suspect: bool = False,
               priority: int = 0, trace: Any = None,
               on_part: Callable[[int, list[Any]], None] | None = None) -> Future[Completed]:
        """Validate ``request`` against the model and queue it for the device.

        ``received_at`` (a ``time.perf_counter()`` reading) starts the request's ``queue_ms``;
        default now. A request still waiting ``expires_in_s`` after that never runs: its future
        raises :class:`RequestExpired`. ``time_limits`` (counted from ``received_at``) make it
        fail with :class:`SoftTimeLimit` / :class:`HardTimeLimit` (see
        :mod:`asyncinfer.policy.time_limits`). An ``alone`` request runs in a batch of its own, a
        ``suspect`` one in a batch of suspects; either with the device to itself.
        ``priority`` (Celery's, 0-9; 0 first) decides which waiting requests batch first.
        ``on_part(index, outputs)``: a decoupled model's parts of the request, as they come
        (index 1-based; outputs its v2 tensors); such a request holds exactly one row.
        ``trace``: the host's trace tag of the request, handed back in its batch's record.
        """
        forward_only = request.parameters.get("stage") == FORWARD_STAGE
        if forward_only:  # a prepared request carries the preprocess's tensors, checked as such
            self.model.validate_forward(request)
        else:
            self.model.validate(request)
        # a model without a batch dimension (Triton's max_batch_size 0) takes each request
        # whole, alone: one "row" however its inputs' first dimensions differ
        rows = rows_of(request) if self.model.batch_dimension else 1
        sequence = request_sequence(self.sequences, self.model.name, request, rows)
        if self._decoupled and rows != 1:
            raise InvalidRequest(
                f"request {request.id}: model '{self.model.name}' streams its answers (decoupled): "
                f"a request holds exactly one row, not {rows}")
        if rows > self.max_batch_size:
            raise InvalidRequest(
                f"request {request.id}: {rows} rows exceed max_batch_size {self.max_batch_size} "
                f"of model '{self.model.name}'")
        item = WorkItem(request=request, rows=rows,
                        signature=(forward_only, self.model.signature(request)), alone=alone,
                        suspect=suspect and not alone,
                        priority=priority, trace=trace,
                        cost=self.model.row_cost(request) if self.options.group_by_cost else None,
                        on_part=on_part)
        if received_at is not None:
            item.received_at = received_at
        if expires_in_s is not None:
            item.deadline = item.received_at + expires_in_s
        if time_limits:
            self.limits.watch(item, time_limits)
        if sequence is not None and self.sequences is not None:
            self.sequences.submit(item, sequence)  # the batcher's once the one before it is done
        else:
            self.batcher.put(item)
        return item.future

    def close(self) -> None:
        """Stop the threads; requests still queued fail with an error saying so."""
        self._closing = True
        self.hangs.close()
        for item in self.batcher.close():
            self._shut_out(item)
        for item in self.sequences.close() if self.sequences is not None else ():
            self._shut_out(item)
        sentinels = 0
        while True:  # batches prepared but not yet on the device fail now too
            try:
                job = self._to_device.get_nowait()
            except queue.Empty:
                break
            if job is None:
                sentinels += 1
                continue
            for item in job.items:
                self._shut_out(item)
            self._slots.release()
        for _ in range(sentinels):
            self._to_device.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)

    # -- stages ----------------------------------------------------------------------------------

    def _next_job(self) -> Job | None:
        while (batch := self.batcher.next_batch()) is not None:
            items = drop_revoked(batch, self.is_revoked)
            if items:
                return Job(items=items, started=time.perf_counter())
        return None

    def _shut_out(self, item: WorkItem) -> None:
        settle(item.future, exc=ModelError(
            f"request {item.request.id}: worker shut down before model '{self.model.name}' ran it"))

    def _prep_loop(self) -> None:
        while True:
            self._slots.acquire()
            job = self._next_job()
            if job is None:
                break
            if self._run_stage(job, self._prepare):
                self._to_device.put(job)
            else:
                self._slots.release()
        for _ in range(self.options.instances):
            self._to_device.put(None)

    def _next_prepared(self) -> Job | None:
        """The next batch for the device: from the prep thread, or formed and prepared here."""
        if self._prep_thread:
            return self._to_device.get()
        while True:
            self._slots.acquire()
            job = self._next_job()
            if job is None:
                self._slots.release()
                return None
            if self._run_stage(job, self._prepare):
                return job
            self._slots.release()

    def _device_loop(self, instance: int) -> None:
        self.device.bind_thread()
        stream = self.device.new_stream()
        graphs = self.graphs[instance] if self.graphs else None
        while (job := self._next_prepared()) is not None:
            if self._closing:  # prepared but never on the device
                for item in job.items:
                    self._shut_out(item)
                self._slots.release()
            elif not drop_revoked(job.items, self.is_revoked):  # revoked while it was being prepared
                self._slots.release()
            elif (job := self._admitted(job)) is None:  # none of it is this worker's to run now
                self._slots.release()
            elif not self._run_stage(job, lambda j: self._launch(j, stream, graphs)):
                self._slots.release()
            elif self._post_always or len(self.batcher) or not self._to_device.empty():
                self._to_complete.put(job)
            else:  # nothing waits for the device: finishing here saves two hand-offs
                self._run_stage(job, self._finish)
                self._slots.release()
        self._to_complete.put(None)

    def _complete_loop(self) -> None:
        self.device.bind_thread()
        remaining = self.options.instances
        while remaining:
            job = self._to_complete.get()
            if job is None:
                remaining -= 1
                continue
            # The slot is free once the results are on the host: the next batch forms and is
            # prepared while this one is postprocessed.
            self._run_stage(job, lambda j: self._finish(j, on_host=self._slots.release))

    def _serial_loop(self, instance: int) -> None:
        self.device.bind_thread()
        stream = self.device.new_stream()
        graphs = self.graphs[instance] if self.graphs else None
        while (job := self._next_job()) is not None:
            self._run_stage(job, lambda j: self._whole(j, stream, graphs))

    def _run_stage(self, job: Job, stage: Callable[[Job], None]) -> bool:
        """Run one stage; on error, run the batch's requests one by one. True to go on."""
        try:
            stage(job)
            return True
        except Exception as exc:  # noqa: BLE001 - a model may raise anything
            off_device(job.items)
            self._isolate(job.items, exc)
            return False

    # -- the work of each stage ------------------------------------------------------------------

    def _prepare(self, job: Job) -> None:
        batch = self._concat(job.items)
        job.data = batch if forward_only(job) else self.model.preprocess(batch)
        if self.sequences is not None:  # controls and states, for the forward
            job.data.update(self.sequences.inputs_for(job.items))

    def _launch(self, job: Job, stream: Any, graphs: GraphSet | None = None) -> None:
        if self._decoupled:
            launch_stream(self, job, stream)
            return
        alone = any(item.isolated for item in job.items)
        with self._gate.enter(alone):
            for item in job.items:
                item.on_device = True
            self._hooks().on_launch(job.items)
            job.launched = time.perf_counter()
            self.hangs.launched(job.items, job.launched)
            with self.device.on_stream(stream), torch.inference_mode():
                outputs = graphs.run(job.data) if graphs is not None else None
                if outputs is None:  # eager: no graphs, or none for this batch
                    on_device = {name: self.device.to_device(v) for name, v in job.data.items()}
                    outputs = self.model.forward(on_device)
                if self.sequences is not None:  # each sequence's state, kept for its next
                    outputs = self.sequences.keep(job.items, outputs, self.device.to_host)
                job.data = {name: self.device.to_host(v) for name, v in outputs.items()}
                job.event = self.device.record_event(stream)
            if job.event is None:  # no event to wait on (CPU): the device is done with it
                job.device_s = time.perf_counter() - job.launched
                off_device(job.items)
            elif alone:  # alone until the device is done with it
                job.event.synchronize()

    def _finish(self, job: Job, on_host: Callable[[], None] | None = None) -> None:
        try:
            if job.event is not None:
                job.event.synchronize()
                job.device_s = time.perf_counter() - job.launched
        finally:
            off_device(job.items)
            if on_host is not None:
                on_host()
        if job.streamed:  # answered step by step already
            return
        with torch.inference_mode():
            outputs = job.data if forward_only(job) else self.model.postprocess(job.data)
        self._deliver_batch(job.items, outputs, job.started, job.device_s, job.launched)

    def _whole(self, job: Job, stream: Any, graphs: GraphSet | None = None) -> None:
        if (admitted := self._admitted(job, prepared=False)) is not None:
            self._prepare(admitted)
            self._launch(admitted, stream, graphs)
            self._finish(admitted)

    def _admitted(self, job: Job, prepared: bool = True) -> Job | None:
        """``job`` with only the requests the worker's gate admits now (hooks.py: those whose
        leases are still this worker's), ``prepared`` again without the others; None when none
        is left (or its preparation failed: its requests were answered)."""
        items = self._hooks().admit(job.items)
        if len(items) == len(job.items):
            return job
        if not items:
            return None
        again = Job(items=items, started=job.started, isolated=job.isolated)
        return again if not prepared or self._run_stage(again, self._prepare) else None

    def _isolate(self, items: Sequence[WorkItem], exc: Exception) -> None:
        if len(items) == 1:
            self._fail(items[0], exc)
            return
        log.warning("model %s: batch of %d requests raised %s; running each alone",
                    self.model.name, len(items), exc)
        stream = self.device.new_stream()
        for item in items:
            try:
                self._whole(Job(items=[item], started=time.perf_counter(), isolated=True),
                            stream)
            except Exception as item_exc:  # noqa: BLE001
                item.on_device = False
                self._fail(item, item_exc)

    def _fail(self, item: WorkItem, exc: Exception) -> None:
        if not item.future.done():
            settle(item.future, exc=model_failure(item.request.id, self.model.name, exc,
                                                  self.is_transient))

    def _concat(self, items: Sequence[WorkItem]) -> Batch:
        first = items[0].request.inputs
        if len(items) == 1:
            return {t.name: t.value for t in first}
        return {t.name: self.model.collate(t.name, [item.request.inputs[i].value for item in items])
                for i, t in enumerate(first)}

    def _deliver_batch(self, items: Sequence[WorkItem], outputs: Batch, started: float,
                       device_s: float | None, launched: float | None = None) -> None:
        if device_s is not None:
            self.batch_s = device_s if self.batch_s is None else 0.8 * self.batch_s + 0.2 * device_s
            self.hangs.observe(device_s)
        with self._hooks().settling():
            deliver(items, outputs, started, self.model.name, self.device.label, self.on_batch,
                    launched, device_s, self.record_batches,
                    whole=not self.model.batch_dimension)


def _overrides(model: Model, method: str) -> bool:
    """Whether ``model`` has its own ``method`` (not the base class's no-op)."""
    return getattr(type(model), method) is not getattr(Model, method)
