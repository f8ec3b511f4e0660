"""Warm-up at worker start: one batch of each size the model will see, before it serves.

The first batch of a shape is slow on an accelerator (cuBLAS/cuDNN choose their kernels per shape,
the caching allocator grows) and the first call is slow everywhere (lazy initialisation); without a
warm-up the first user requests pay for it — Triton's ``model_warmup``, TorchServe's recurring
complaint. A model that declares its inputs (``Model.inputs``) is run on a batch of zeros (text
``"warm up"`` for BYTES) of each size: its ``preferred_batch_sizes``, else the powers of two up to
``max_batch_size`` and that size itself (a decoupled model: the first step of its
:meth:`Model.stream`); not a model with an input of any shape (a TorchScript file's), of which no
example can be built. The ``warmup`` model option (default on) turns it off.
A warm-up that raises is logged and the worker serves anyway.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.device import Device
from asyncinfer.models.base import Batch, Model, StreamRows
from asyncinfer.models.program_signature import AnyShape
from asyncinfer.wire.protocol import decode_request

__all__ = ["warmup_sizes", "example_batch", "warm_up"]

log = logging.getLogger(__name__)


def warmup_sizes(options: ModelOptions, batchable: bool = True) -> list[int]:
    """The batch sizes a warm-up runs, smallest first."""
    if not batchable:
        return [1]
    if options.preferred_batch_sizes:
        return sorted(set(options.preferred_batch_sizes) | {options.max_batch_size})
    powers = {2 ** k for k in range(int(math.log2(options.max_batch_size)) + 1)}
    return sorted(powers | {options.max_batch_size})


def example_batch(model: Model, rows: int) -> Batch | None:
    """A batch of ``rows`` rows of the model's declared inputs, each -1 of a row shape as 1 (None:
    it declares none, or an input of any shape: a TorchScript file's, which says no shape)."""
    if not model.inputs or any(isinstance(s, AnyShape) for s in model.inputs.values()):
        return None
    inputs: list[dict[str, Any]] = []
    for name, spec in model.inputs.items():
        shape = [*([rows] if model.batch_dimension else []),
                 *(1 if d == -1 else d for d in spec.row_shape)]
        count = math.prod(shape)
        datatype = spec.datatypes[0]
        element: Any = {"BYTES": "warm up", "BOOL": False}.get(datatype, 0)
        data = [element] * count
        inputs.append({"name": name, "datatype": datatype, "shape": shape, "data": data})
    request = decode_request("warm-up", {"model": model.name, "inputs": inputs})
    return {t.name: t.value for t in request.inputs}


def warm_up(model: Model, device: Device, options: ModelOptions) -> dict[int, float]:
    """Run one batch of each of :func:`warmup_sizes` through the three stages on ``device``;
    return milliseconds per size (empty when the model cannot be warmed up or it raised)."""
    times: dict[int, float] = {}
    if not options.warmup or example_batch(model, 1) is None:
        return times
    stream = device.new_stream()
    try:
        for rows in warmup_sizes(options, model.batchable and model.batch_dimension):
            batch = example_batch(model, rows)
            assert batch is not None  # the model declares inputs
            began = time.perf_counter()
            with torch.inference_mode():
                data = model.preprocess(batch)
                with device.on_stream(stream):
                    on_device = {n: device.to_device(v) for n, v in data.items()}
                    outputs = (_first_step(model, on_device, rows) if model.decoupled
                               else model.forward(on_device))
                    host = {n: device.to_host(v) for n, v in outputs.items()}
                    event = device.record_event(stream)
                if event is not None:
                    event.synchronize()
                model.postprocess(host)
            times[rows] = (time.perf_counter() - began) * 1000.0
    except Exception as exc:  # noqa: BLE001 - a model may raise anything; serving goes on
        log.warning("model %s: warm-up raised %s: %s; serving without it", model.name,
                    type(exc).__name__, exc)
        return {}
    log.info("model %s warmed up at batch sizes %s in %.0f ms", model.name,
             ", ".join(map(str, times)), sum(times.values()))
    return times


def _first_step(model: Model, batch: Batch, rows: int) -> Batch:
    """The outputs of a decoupled model's first step over ``batch`` (its generator closed
    after it)."""
    steps = iter(model.stream(batch, StreamRows(rows)))
    try:
        step = next(steps, None)
        return dict(step.outputs) if step is not None else {}
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
