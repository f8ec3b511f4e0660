"""A batch's way back: each request gets exactly its own rows of the outputs, as a :class:`Completed`
(its future completed with them: :func:`deliver`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncinfer.engine.batcher import WorkItem
from asyncinfer.engine.failures import BatchObserver
from asyncinfer.errors import InvalidRequest, ModelError, RequestExpired, RequestRevoked
from asyncinfer.models.base import Batch
from asyncinfer.wire.protocol import Request, Tensor
from asyncinfer.wire.tensors import datatype_of

__all__ = ["BatchRecord", "Completed", "deliver", "drop_revoked", "output_tensor", "rows_of", "settle",
           "split_rows"]


@dataclass(eq=False)
class BatchRecord:
    """One device batch as its host's tracing records it (made only when the runner is asked to:
    ``record_batches``): its model, device, rows and times (``time.perf_counter()`` readings),
    and each request's trace tag (:attr:`WorkItem.trace <asyncinfer.engine.batcher.WorkItem>`,
    opaque here), in the batch's order."""

    model: str
    device: str
    rows: int
    #: When it was formed, went onto the device (None: not known), and was delivered.
    started: float
    launched: float | None
    device_s: float | None
    finished: float
    request_ids: list[str]
    traces: list[Any]
    #: Set by whoever records it, once (a batch's requests may be written in two parts).
    recorded: bool = False


@dataclass
class Completed:
    """What a request gets back from the device."""

    outputs: list[Tensor]
    batch_size: int
    queue_ms: float
    compute_ms: float
    #: Its batch, for tracing (None unless the runner records batches).
    batch: BatchRecord | None = None


def deliver(items: Sequence[WorkItem], outputs: Batch, started: float, model: str, device: str,
            on_batch: BatchObserver, launched: float | None = None,
            device_s: float | None = None, record: bool = False, whole: bool = False) -> None:
    """Give each request of a finished batch exactly its own rows of ``outputs`` (those already
    answered, by a revoke or a time limit, are skipped); ModelError if an output's rows do not add
    up to the batch. ``launched`` (a ``perf_counter`` reading) and ``device_s``: when the batch
    went onto the device and how long it took there (None: not known; its whole time counts as
    the device's). ``record``: each request's :class:`Completed` carries its batch's
    :class:`BatchRecord` (tracing). ``whole``: the batch is one request of a model without a
    batch dimension (Triton's ``max_batch_size: 0``), which gets the outputs as they are."""
    finished = time.perf_counter()
    rows = [item.rows for item in items]
    total = sum(rows)
    for name, value in outputs.items() if not whole else ():
        got = len(value) if isinstance(value, np.ndarray) else (
            int(value.shape[0]) if value.dim() else -1)
        if got != total:
            raise ModelError(f"model '{model}': output '{name}' has {got} rows "
                             f"for a batch of {total}")
    pieces = {name: split_rows(value, rows) for name, value in outputs.items()}
    compute_ms = (finished - started) * 1000.0
    compute_s = finished - started
    input_s = max(0.0, launched - started) if launched else 0.0
    infer_s = min(device_s, compute_s - input_s) if device_s is not None else compute_s - input_s
    on_batch(model, device, total, compute_s, [started - item.received_at for item in items],
             (input_s, infer_s, max(0.0, compute_s - input_s - infer_s)))
    batch = (BatchRecord(model, device, total, started, launched or None, device_s, finished,
                         [item.request.id for item in items], [item.trace for item in items])
             if record else None)
    for i, item in enumerate(items):
        if item.future.done():  # revoked after its batch was formed
            continue
        result = [output_tensor(name, parts[i], item.request.binary_output)
                  for name, parts in pieces.items()]
        settle(item.future, Completed(
            outputs=result, batch_size=total,
            queue_ms=(started - item.received_at) * 1000.0, compute_ms=compute_ms, batch=batch))


def rows_of(request: Request) -> int:
    rows = {t.shape[0] for t in request.inputs}
    if len(rows) != 1:
        sizes = ", ".join(f"'{t.name}': {t.shape[0]}" for t in request.inputs)
        raise InvalidRequest(
            f"request {request.id}: inputs disagree on the batch dimension ({sizes})")
    return rows.pop()


def split_rows(value: Any, rows: list[int]) -> list[Any]:
    if len(rows) == 1:
        return [value]
    if isinstance(value, np.ndarray):
        return np.split(value, np.cumsum(rows)[:-1])
    return list(torch.split(value, rows))


def output_tensor(name: str, value: Any, binary: bool) -> Tensor:
    """Output ``name`` of a request as a v2 tensor (a numpy array of numbers as torch's; BYTES
    stays a numpy object array)."""
    if isinstance(value, np.ndarray) and value.dtype != object:
        value = torch.from_numpy(value)
    datatype = "BYTES" if isinstance(value, np.ndarray) else datatype_of(value)
    return Tensor(name=name, datatype=datatype, shape=tuple(value.shape), value=value, binary=binary)


def settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Set the outcome of ``future`` unless something (a time limit, a revoke) already did."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


def drop_revoked(items: list[WorkItem], is_revoked: Callable[[str], bool]) -> list[WorkItem]:
    """The items still to run: not answered, not revoked, not past their ``expires`` (those are
    answered now: REVOKED, expired)."""
    live = []
    now = time.perf_counter()
    for item in items:
        if item.future.done():
            continue
        if is_revoked(item.request.id):
            settle(item.future, exc=RequestRevoked(
                f"request {item.request.id}: revoked before it reached the device"))
        elif item.deadline is not None and now >= item.deadline:
            settle(item.future, exc=RequestExpired(
                f"request {item.request.id}: expired before it reached the device"))
        else:
            live.append(item)
    return live
