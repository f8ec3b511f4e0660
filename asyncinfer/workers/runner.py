"""A model instance on the device: a device thread that runs batches on its own stream.

Task threads call :meth:`ModelRunner.submit` and wait on the returned future. The device thread
concatenates the rows of a batch, runs the forward on the instance's stream, records an event and
hands the batch to a completion thread, which blocks on the event (never spinning) and gives each
request back exactly its own rows. When a batch raises, each of its requests runs alone, so one
bad request does not fail the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncinfer.errors import InvalidRequest, ModelError, RequestRevoked
from asyncinfer.models.base import Batch, Model
from asyncinfer.protocol import Request, Tensor, datatype_of
from asyncinfer.workers.batcher import Batcher, WorkItem
from asyncinfer.workers.device import Device

__all__ = ["Completed", "ModelRunner"]

log = logging.getLogger(__name__)


@dataclass
class Completed:
    """What a request gets back from the device."""

    outputs: list[Tensor]
    batch_size: int
    queue_ms: float
    compute_ms: float


class ModelRunner:
    """One model on one device: a batcher feeding ``instances`` device threads."""

    def __init__(self, model: Model, device: Device, *, max_batch_size: int,
                 max_delay_ms: float, instances: int = 1,
                 is_revoked: Callable[[str], bool] | None = None) -> None:
        self.model = model
        self.is_revoked = is_revoked or (lambda request_id: False)
        self.device = device
        self.max_batch_size = max_batch_size if model.batchable else 1
        self.batcher = Batcher(self.max_batch_size, max_delay_ms if model.batchable else 0.0)
        self._done: queue.Queue[Any] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._device_loop, name=f"device-{model.name}-{i}", daemon=True)
            for i in range(instances)
        ]
        self._completer = threading.Thread(
            target=self._completion_loop, name=f"complete-{model.name}", daemon=True)

    def start(self) -> ModelRunner:
        """Load the model onto the device and start its threads."""
        self.device.bind_thread()
        self.model.load(self.device.torch_device)
        for t in self._threads:
            t.start()
        self._completer.start()
        return self

    def submit(self, request: Request, received_at: float | None = None) -> Future[Completed]:
        """Validate ``request`` against the model and queue it for the device.

        ``received_at`` (a ``time.perf_counter()`` reading) starts the request's ``queue_ms``;
        default now.
        """
        self.model.validate(request)
        rows = _rows_of(request)
        if rows > self.max_batch_size:
            raise InvalidRequest(
                f"request {request.id}: {rows} rows exceed max_batch_size {self.max_batch_size} "
                f"of model '{self.model.name}'")
        signature = tuple((t.name, t.datatype, t.shape[1:]) for t in request.inputs)
        item = WorkItem(request=request, rows=rows, signature=signature)
        if received_at is not None:
            item.received_at = received_at
        self.batcher.put(item)
        return item.future

    def close(self) -> None:
        """Stop the threads; requests still queued fail with an error saying so."""
        for item in self.batcher.close():
            item.future.set_exception(ModelError(
                f"request {item.request.id}: worker shut down before model '{self.model.name}' ran it"))
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5)
        self._done.put(None)
        if self._completer.is_alive():
            self._completer.join(timeout=5)

    # -- device side ---------------------------------------------------------------------------

    def _device_loop(self) -> None:
        self.device.bind_thread()
        stream = self.device.new_stream()
        while (batch := self.batcher.next_batch()) is not None:
            items = self._drop_revoked(batch)
            if not items:
                continue
            started = time.perf_counter()
            try:
                host_out, event = self._launch(items, stream)
            except Exception as exc:  # noqa: BLE001 - a model may raise anything
                self._isolate(items, stream, exc)
                continue
            self._done.put((items, host_out, event, started))

    def _drop_revoked(self, items: list[WorkItem]) -> list[WorkItem]:
        live = []
        for item in items:
            if self.is_revoked(item.request.id):
                item.future.set_exception(RequestRevoked(
                    f"request {item.request.id}: revoked before it reached the device"))
            else:
                live.append(item)
        return live

    def _launch(self, items: Sequence[WorkItem], stream: Any) -> tuple[Batch, Any]:
        batch = _concat(items)
        with self.device.on_stream(stream), torch.inference_mode():
            on_device = {name: self.device.to_device(v) for name, v in batch.items()}
            outputs = self.model.forward(on_device)
            host_out = {name: self.device.to_host(v) for name, v in outputs.items()}
            event = self.device.record_event(stream)
        return host_out, event

    def _isolate(self, items: Sequence[WorkItem], stream: Any, exc: Exception) -> None:
        if len(items) == 1:
            self._fail(items[0], exc)
            return
        log.warning("model %s: batch of %d requests raised %s; running each alone",
                    self.model.name, len(items), exc)
        for item in items:
            started = time.perf_counter()
            try:
                host_out, event = self._launch([item], stream)
                if event is not None:
                    event.synchronize()
                self._complete([item], host_out, started)
            except Exception as item_exc:  # noqa: BLE001
                self._fail(item, item_exc)

    def _fail(self, item: WorkItem, exc: Exception) -> None:
        if isinstance(exc, InvalidRequest):
            item.future.set_exception(exc)
            return
        err = ModelError(f"request {item.request.id}: model '{self.model.name}' raised "
                         f"{type(exc).__name__}: {exc}")
        err.__cause__ = exc
        item.future.set_exception(err)

    # -- completion side -----------------------------------------------------------------------

    def _completion_loop(self) -> None:
        self.device.bind_thread()
        while (job := self._done.get()) is not None:
            items, host_out, event, started = job
            try:
                if event is not None:
                    event.synchronize()
                self._complete(items, host_out, started)
            except Exception as exc:  # noqa: BLE001
                for item in items:
                    if not item.future.done():
                        self._fail(item, exc)

    def _complete(self, items: Sequence[WorkItem], host_out: Batch, started: float) -> None:
        finished = time.perf_counter()
        rows = [item.rows for item in items]
        total = sum(rows)
        for name, value in host_out.items():
            got = len(value) if isinstance(value, np.ndarray) else int(value.shape[0]) if value.dim() else -1
            if got != total:
                raise ModelError(f"model '{self.model.name}': output '{name}' has {got} rows "
                                 f"for a batch of {total}")
        pieces = {name: _split(value, rows) for name, value in host_out.items()}
        compute_ms = (finished - started) * 1000.0
        for i, item in enumerate(items):
            outputs = [_output(name, parts[i], item.request.binary_output)
                       for name, parts in pieces.items()]
            item.future.set_result(Completed(
                outputs=outputs, batch_size=total,
                queue_ms=(started - item.received_at) * 1000.0, compute_ms=compute_ms))


def _rows_of(request: Request) -> int:
    rows = {t.shape[0] for t in request.inputs}
    if len(rows) != 1:
        sizes = ", ".join(f"'{t.name}': {t.shape[0]}" for t in request.inputs)
        raise InvalidRequest(
            f"request {request.id}: inputs disagree on the batch dimension ({sizes})")
    return rows.pop()


def _concat(items: Sequence[WorkItem]) -> Batch:
    first = items[0].request.inputs
    if len(items) == 1:
        return {t.name: t.value for t in first}
    batch: Batch = {}
    for i, t in enumerate(first):
        values = [item.request.inputs[i].value for item in items]
        batch[t.name] = (np.concatenate(values) if isinstance(t.value, np.ndarray)
                         else torch.cat(values))
    return batch


def _split(value: Any, rows: list[int]) -> list[Any]:
    if len(rows) == 1:
        return [value]
    if isinstance(value, np.ndarray):
        return np.split(value, np.cumsum(rows)[:-1])
    return list(torch.split(value, rows))


def _output(name: str, value: Any, binary: bool) -> Tensor:
    if isinstance(value, np.ndarray) and value.dtype != object:
        value = torch.from_numpy(value)
    datatype = "BYTES" if isinstance(value, np.ndarray) else datatype_of(value)
    return Tensor(name=name, datatype=datatype, shape=tuple(value.shape), value=value, binary=binary)
