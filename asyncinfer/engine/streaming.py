"""A decoupled model's batch on the device, step by step (:meth:`Model.stream`).

Each request of the batch holds one row. After each step its outputs come to the host and each
row's share goes to that row's request, as part 1, 2, … (``WorkItem.on_part``); a row the step
marks ``done`` finishes: its request completes with its parts joined (:meth:`Model.join_parts`).
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

A step that raises leaves the batch to the runner, which runs each request again alone (its
parts are numbered from 1 again: whoever writes them skips those already written).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.completion import Completed, output_tensor, settle
from asyncinfer.engine.device import Device
from asyncinfer.errors import ModelError, RequestExpired, RequestRevoked
from asyncinfer.models.base import Batch, Model, StreamRows, StreamStep

__all__ = ["Joining", "run_stream"]

log = logging.getLogger(__name__)


#: In-flight batching: given the live rows' count, the requests that join the batch now and their
#: inputs (preprocessed, on the device, one row each; marked on the device), or None: none.
Joining = Callable[[int], tuple[Sequence[WorkItem], Batch] | None]


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
    """Row ``r`` is done: its request completes with its parts joined."""
    if not rows.state.is_live(r):
        return
    rows.state.finished.add(r)
    item = rows.items[r]
    if item.future.done():
        return
    request_id = item.request.id
    parts = rows.parts[r]
    if not parts:
        settle(item.future, exc=ModelError(f"request {request_id}: model '{model.name}' "
                                           f"finished its stream without a part"))
        return
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
