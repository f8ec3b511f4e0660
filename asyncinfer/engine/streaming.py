"""A decoupled model's batch on the device, step by step (:meth:`Model.stream`).

Each request of the batch holds one row. After each step its outputs come to the host and each
row's share goes to that row's request, as part 1, 2, … (``WorkItem.on_part``); a row the step
marks ``done`` finishes: its request completes with its parts joined (:meth:`Model.join_parts`; a
row done without a part completes with no outputs: a request answered with no response).
Before each next step every live row is checked: a request revoked, past its ``expires``, or
already answered (a time limit settled it) is cancelled (``StreamRows.cancelled``) and, unless
already answered, answered at once (REVOKED, expired); the model stops computing it at that step.
The generator is closed once no row is live. A generator that ends with rows still live finishes
them as if they were ``done``.

In-flight batching (``Model.inflight_batching``; the runner passes ``joining``): before each step,
after the checks, requests waiting for the model join the batch (``StreamRows.join``: new rows
after the last, their parts numbered from 1 like any row's), as many as ``joining`` gives for the
rows left free; the loop ends once no row is live and none joined. A joined row's ``queue_ms`` and
``compute_ms`` count from when it joined.

A stream of suspects (requests that saw one worker death: policy/deaths.py) has the device to
itself for its first step only, the step that was on the device at the death; after it the device
is shared again and, with in-flight batching, waiting requests join it. A request that saw two
deaths (``alone``) keeps the device for its whole stream.

A step that raises leaves the batch to the runner, which runs each request again alone (its
parts are numbered from 1 again: whoever writes them skips those already written).

:func:`launch_stream` is the runner's device stage for such a batch (engine/runner.py hands it
over): the device gate, the hooks, the batch's times, and the requests that join it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import numpy as np
import torch

from asyncinfer.engine.batcher import Batcher, WorkItem
from asyncinfer.engine.completion import Completed, drop_revoked, output_tensor, settle
from asyncinfer.engine.device import Device
from asyncinfer.engine.failures import BatchObserver
from asyncinfer.engine.gate import DeviceGate
from asyncinfer.engine.hooks import DeviceHooks
from asyncinfer.engine.job import Job, forward_only, off_device
from asyncinfer.errors import ModelError, RequestExpired, RequestRevoked
from asyncinfer.models.base import Batch, Model, StreamRows, StreamStep

__all__ = ["Joining", "StreamHost", "launch_stream", "run_stream"]

log = logging.getLogger(__name__)


#: In-flight batching: given the live rows' count, the requests that join the batch now and their
#: inputs (preprocessed, on the device, one row each; marked on the device), or None: none.
Joining = Callable[[int], tuple[Sequence[WorkItem], Batch] | None]


class StreamHost(Protocol):
    """What :func:`launch_stream` uses of the runner (engine/runner.py) that runs the batch."""

    model: Model
    device: Device
    batcher: Batcher
    max_batch_size: int
    is_revoked: Callable[[str], bool]
    on_batch: BatchObserver
    batch_s: float | None
    _gate: DeviceGate
    _hooks: Callable[[], DeviceHooks]
    _inflight: bool
    _closing: bool

    def _concat(self, items: Sequence[WorkItem]) -> Batch: ...

    def _isolate(self, items: Sequence[WorkItem], exc: Exception) -> None: ...


def launch_stream(runner: StreamHost, job: Job, stream: Any) -> None:
    """A decoupled model's batch: its steps, one after another, on the device thread; each
    request is answered when its row finishes (or is cancelled). With in-flight batching,
    the requests that arrive meanwhile join it between steps (:func:`_joining`)."""
    alone = any(item.isolated for item in job.items)
    # suspects only (each saw one death, none must run alone): the step that was on the device
    # at the death is the suspect one; after the first step passes the device is shared again
    suspects = alone and not any(item.alone for item in job.items) and not job.isolated
    waits_s = [job.started - item.received_at for item in job.items]
    joining = (_joining(runner, job, stream, waits_s)
               if runner._inflight and (suspects or not alone) and not job.isolated else None)
    with runner._gate.enter(alone) as share:
        if suspects:
            joining = _after_first_step(joining, share)
        for item in job.items:
            item.on_device = True
        runner._hooks().on_launch(job.items)
        job.launched = time.perf_counter()
        try:
            with torch.inference_mode():
                with runner.device.on_stream(stream):
                    on_device = {name: runner.device.to_device(v) for name, v in job.data.items()}
                run_stream(runner.model, runner.device, job.items, on_device, stream,
                           is_revoked=runner.is_revoked, closing=lambda: runner._closing,
                           started=job.started, settling=runner._hooks().settling,
                           joining=joining)
        except Exception:
            job.items.extend(job.unprepared)  # the batch runs again alone, these too
            raise
        finally:
            off_device(job.items)
        job.device_s = time.perf_counter() - job.launched
        job.streamed = True
        job.data = {}
    runner.batch_s = (job.device_s if runner.batch_s is None
                      else 0.8 * runner.batch_s + 0.2 * job.device_s)
    runner.on_batch(runner.model.name, runner.device.label, len(job.items),
                    time.perf_counter() - job.started, waits_s,
                    (job.launched - job.started, job.device_s, 0.0))
    if job.unprepared and job.unprepared_error is not None:
        runner._isolate(job.unprepared, job.unprepared_error)


def _after_first_step(joining: Joining | None, share: Callable[[], None]) -> Joining:
    """A stream of suspects: nothing joins before its first step ran (the device is its own);
    then the device is shared (``share()``) and, with in-flight batching, requests join."""
    steps_before = 0

    def join(live_rows: int) -> tuple[Sequence[WorkItem], Batch] | None:
        nonlocal steps_before
        steps_before += 1
        if steps_before == 1:
            return None
        if steps_before == 2:
            share()
        return joining(live_rows) if joining is not None else None

    return join


def _joining(runner: StreamHost, job: Job, stream: Any, waits_s: list[float]) -> Joining:
    """In-flight batching: between two steps of ``job``'s stream, the requests waiting for
    the model that may join it (same signature, in the batcher's order, up to
    ``max_batch_size`` live rows: :meth:`Batcher.take_joining`), prepared as a batch is
    (collated, preprocessed, on the device), marked on the device (the leases' marks)."""
    signature = job.items[0].signature
    prepared = forward_only(job)

    def join(live_rows: int) -> tuple[list[WorkItem], Batch] | None:
        room = runner.max_batch_size - live_rows
        if runner._closing or room < 1:
            return None
        items = drop_revoked(runner.batcher.take_joining(signature, room), runner.is_revoked)
        if not items:
            return None
        try:
            batch = runner._concat(items)
            if not prepared:
                batch = runner.model.preprocess(batch)
            with runner.device.on_stream(stream):
                on_device = {name: runner.device.to_device(v) for name, v in batch.items()}
        except Exception as exc:  # noqa: BLE001 - a model may raise anything: run them alone
            job.unprepared.extend(items)
            job.unprepared_error = exc
            return None
        now = time.perf_counter()
        for item in items:
            item.on_device = True
            waits_s.append(now - item.received_at)
        runner._hooks().on_launch(items)
        job.items.extend(items)
        return items, on_device

    return join


class _Rows:
    """Each row's request, its parts so far (output name → the row's pieces) and when it joined."""

    def __init__(self, items: Sequence[WorkItem], started: float) -> None:
        self.items = list(items)
        self.state = StreamRows(len(items))
        self.parts: list[dict[str, list[Any]]] = [{} for _ in items]
        self.counts = [0] * len(items)
        self.started = [started] * len(items)

    def join(self, items: Sequence[WorkItem], inputs: Batch) -> None:
        """Add a row for each of ``items`` (``inputs``: theirs, one row each, in order)."""
        added = self.state.join(inputs)
        if len(added) != len(items):
            raise ModelError(f"{len(items)} requests joined with inputs of {len(added)} rows")
        now = time.perf_counter()
        self.items.extend(items)
        self.parts.extend({} for _ in items)
        self.counts.extend(0 for _ in items)
        self.started.extend(now for _ in items)


def run_stream(model: Model, device: Device, items: Sequence[WorkItem], batch: Batch,
               stream: Any, *, is_revoked: Callable[[str], bool],
               closing: Callable[[], bool], started: float,
               settling: Callable[[], AbstractContextManager[Any]] = nullcontext,
               joining: Joining | None = None) -> int:
    """Run ``model``'s steps over ``batch`` (on the device already; one row per item of
    ``items``) on ``stream``, handing out parts and completing rows as they finish; returns
    how many steps ran. ``closing()``: the worker shuts down (live rows fail, saying so);
    ``started``: when the batch was formed (the requests' ``compute_ms`` count from it);
    ``settling()``: what each step's answers are given inside (a result writer gathers them:
    one write, after the step's parts); ``joining``: in-flight batching (see the module's text)."""
    rows = _Rows(items, started)
    steps = 0
    generator = iter(model.stream(batch, rows.state))
    try:
        while True:
            _cancel_unwanted(model, rows, is_revoked, closing)
            if joining is not None and not closing():
                joined = joining(len(rows.state.live()))
                if joined is not None:
                    rows.join(*joined)
            if not rows.state.live():
                break
            with device.on_stream(stream):  # the step's work and its copy on one stream
                try:
                    step = next(generator)
                except StopIteration:
                    break
                host = {name: device.to_host(v) for name, v in step.outputs.items()}
                event = device.record_event(stream)
            steps += 1
            if event is not None:
                event.synchronize()
            with settling():
                _hand_out(model, rows, step, model.postprocess(host))
                for r in step.done:
                    _finish(model, rows, r)
        with settling():
            for r in rows.state.live():  # the generator ended: what it did not finish is done
                _finish(model, rows, r)
    finally:
        close = getattr(generator, "close", None)
        if close is not None:
            close()
    return steps


def _cancel_unwanted(model: Model, rows: _Rows, is_revoked: Callable[[str], bool],
                     closing: Callable[[], bool]) -> None:
    """Cancel each live row whose request is no longer wanted, answering it unless answered."""
    now = time.perf_counter()
    shutting = closing()
    for r in rows.state.live():
        item = rows.items[r]
        future, request_id = item.future, item.request.id
        after = f"after {rows.counts[r]} part(s)"
        if future.done():
            pass
        elif shutting:
            settle(future, exc=ModelError(f"request {request_id}: worker shut down while model "
                                          f"'{model.name}' streamed it ({after})"))
        elif is_revoked(request_id):
            settle(future, exc=RequestRevoked(f"request {request_id}: revoked while model "
                                              f"'{model.name}' streamed it ({after})"))
        elif item.deadline is not None and now >= item.deadline:
            settle(future, exc=RequestExpired(f"request {request_id}: expired while model "
                                              f"'{model.name}' streamed it ({after})"))
        else:
            continue
        rows.state.cancelled.add(r)


def _hand_out(model: Model, rows: _Rows, step: StreamStep, outputs: Batch) -> None:
    """Give each live row of ``step`` its own row of ``outputs`` as its next part."""
    wanted = len(step.rows)
    for name, value in outputs.items():
        got = len(value) if isinstance(value, np.ndarray) else (
            int(value.shape[0]) if value.dim() else -1)
        if got != wanted:
            raise ModelError(f"model '{model.name}': a step's output '{name}' has {got} rows "
                             f"for the {wanted} rows it names")
    for j, r in enumerate(step.rows):
        if not 0 <= r < rows.state.size:
            raise ModelError(f"model '{model.name}': a step names row {r} of a batch of "
                             f"{rows.state.size}")
        item = rows.items[r]
        if not rows.state.is_live(r):
            continue
        if item.future.done():  # answered during the step (a time limit): no more parts
            rows.state.cancelled.add(r)
            continue
        pieces = {name: _row(value, j) for name, value in outputs.items()}
        for name, piece in pieces.items():
            rows.parts[r].setdefault(name, []).append(piece)
        rows.counts[r] += 1
        if item.on_part is None:
            continue
        try:
            item.on_part(rows.counts[r], [output_tensor(name, piece, item.request.binary_output)
                                          for name, piece in pieces.items()])
        except Exception as exc:  # noqa: BLE001 - a part that cannot be handed fails its row only
            err = ModelError(f"request {item.request.id}: part {rows.counts[r]} of model "
                             f"'{model.name}' could not be handed over ({type(exc).__name__}: "
                             f"{exc})")
            err.__cause__ = exc
            settle(item.future, exc=err)
            rows.state.cancelled.add(r)


def _row(value: Any, j: int) -> Any:
    """Row ``j`` of ``value`` as a value of one row, its own copy (the model may reuse its
    buffers at the next step)."""
    piece = value[j:j + 1]
    return piece.clone() if isinstance(piece, torch.Tensor) else np.array(piece, copy=True)


def _finish(model: Model, rows: _Rows, r: int) -> None:
    """Row ``r`` is done: its request completes with its parts joined. A row done without a part
    is a request answered with no response, as a decoupled Triton model may end one (Triton
    sends only its empty final flag): it completes with no outputs."""
    if not rows.state.is_live(r):
        return
    rows.state.finished.add(r)
    item = rows.items[r]
    if item.future.done():
        return
    request_id = item.request.id
    parts = rows.parts[r]
    try:
        outputs = [output_tensor(name, model.join_parts(name, pieces), item.request.binary_output)
                   for name, pieces in parts.items()]
    except Exception as exc:  # noqa: BLE001 - a model's join may raise anything: this row only
        err = ModelError(f"request {request_id}: model '{model.name}' could not join its "
                         f"{rows.counts[r]} parts ({type(exc).__name__}: {exc})")
        err.__cause__ = exc
        settle(item.future, exc=err)
        return
    finished, started = time.perf_counter(), rows.started[r]
    settle(item.future, Completed(outputs=outputs, batch_size=rows.state.size,
                                  queue_ms=(started - item.received_at) * 1000.0,
                                  compute_ms=(finished - started) * 1000.0))
