"""The ``graph_batch_sizes`` model option: one CUDA / NPU graph of the forward per batch size,
captured at load, and each batch padded to the nearest captured size (vLLM's and vllm-ascend's
way).

A graph launches a whole forward's kernels with one call. Where the host cannot launch kernels as
fast as the device runs them (small batches of a model made of many small kernels, an NPU whose
operators each cost a launch of tens of microseconds) that is the difference between a busy device
and an idle one. A graph holds fixed shapes and fixed addresses, so:

- At load, each instance of the model (each device thread) gets its own set, one graph per size:
  two threads replaying one graph would share its input and output buffers. Per size, largest first
  (the smaller graphs reuse the memory pool of the first): the model's example batch of that many
  rows (engine/warmup.py) through its preprocess, copied to the device as the static inputs; one
  eager forward on a side stream (the warm-up a capture needs: lazy initialisation, kernel choice);
  then ``torch.cuda.graph`` / ``torch.npu.graph`` captures the forward of the static inputs, with
  ``capture_error_mode="thread_local"`` (another model's threads may be serving meanwhile).
- A batch of ``r`` rows replays the smallest captured size ``s >= r``, on its instance's stream:
  its rows are copied into the first ``r`` rows of the static inputs (pinned, non-blocking), the
  ``s - r`` padding rows are zeroed (no earlier request's rows run again), the graph is replayed
  and the outputs are cut to their first ``r`` rows before they are copied to the host: the
  padding rows never leave the device.
- A batch runs eager when it has more rows than the largest size (it is not split: it fits
  ``max_batch_size``, and one eager forward is what the device would have run without graphs),
  when its inputs differ in datatype or row shape from the captured ones (a request in another
  accepted datatype), and when a failed batch's requests run one by one.

Which models: a forward whose inputs have a fixed row shape and a numeric datatype, declared
(``Model.inputs``; ``Model.forward_inputs`` for a model with its own preprocess), and whose outputs
are tensors with one row per input row. Others are refused at load with the rule — on every
device, so a CPU box finds the mistake before an accelerator does: MiniLM (token IDs of any length;
padding them to captured lengths too would be a second bucketing, not worth its memory here) and
``identity`` (any input). On CPU the option is ignored with one log line (there are no graphs to
capture), so one configuration serves CPU and accelerator workers. A capture that fails on the
device (an operator a graph cannot hold — on NPU only aclnn operators are captured — or a host
synchronisation inside the forward) is logged and the model runs eager, as ``compile`` does.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.engine.device import Device
from asyncinfer.engine.warmup import example_batch
from asyncinfer.models.base import Batch, InputSpec, Model
from asyncinfer.models.program_signature import AnyShape

__all__ = ["NotGraphable", "CapturedGraph", "GraphSet", "check_graphable", "capture_graphs",
           "graph_size"]

log = logging.getLogger(__name__)

#: The graph class of each device type's module (``torch.cuda``, ``torch.npu``); both modules
#: have a ``graph`` context manager taking the same arguments.
_GRAPH_CLASSES = {"cuda": "CUDAGraph", "npu": "NPUGraph"}


class NotGraphable(ValueError):
    """A model that ``graph_batch_sizes`` cannot be applied to (the message names the rule)."""


@dataclass
class CapturedGraph:
    """One graph: the batch size it was captured at and its static input and output tensors."""

    size: int
    graph: Any
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]

    def fits(self, data: Batch) -> bool:
        """Whether ``data`` has the captured inputs' names, datatypes and row shapes."""
        return data.keys() == self.inputs.keys() and all(
            isinstance(value, torch.Tensor) and value.dtype == static.dtype
            and value.shape[1:] == static.shape[1:]
            for value, static in ((data[n], s) for n, s in self.inputs.items()))


def graph_size(rows: int, sizes: list[int]) -> int | None:
    """The smallest of the sorted ``sizes`` that holds ``rows`` rows; None: none does."""
    at = bisect.bisect_left(sizes, rows)
    return sizes[at] if at < len(sizes) else None


class GraphSet:
    """One instance's graphs, one per batch size; used by that instance's device thread only."""

    def __init__(self, graphs: list[CapturedGraph], device: Device) -> None:
        self.device = device
        self._by_size = {g.size: g for g in graphs}
        self.sizes = sorted(self._by_size)

    def run(self, data: Batch) -> Batch | None:
        """Replay the graph for ``data``'s rows on the current stream and return the outputs cut
        to those rows (on the device); None when the batch must run eager."""
        if not data:
            return None
        rows = len(next(iter(data.values())))
        size = graph_size(rows, self.sizes)
        if size is None:
            return None
        captured = self._by_size[size]
        if not captured.fits(data):
            return None
        for name, static in captured.inputs.items():
            self.device.copy_into(static[:rows], data[name])
            if rows < size:
                static[rows:].zero_()
        captured.graph.replay()
        return {name: out[:rows] for name, out in captured.outputs.items()}


def check_graphable(model: Model) -> None:
    """Raise NotGraphable unless ``model``'s forward takes declared inputs of fixed row shape and
    numeric datatype (what a graph per batch size can hold)."""
    rule = (f"model '{model.name}': graph_batch_sizes needs a forward whose inputs are declared "
            f"with a fixed row shape and a numeric datatype (one graph per batch size holds "
            f"fixed shapes)")
    if not model.inputs:
        raise NotGraphable(f"{rule}; it declares no inputs")
    own_preprocess = type(model).preprocess is not Model.preprocess
    specs: Mapping[str, InputSpec] | None = model.forward_inputs if own_preprocess else model.inputs
    if not specs:
        raise NotGraphable(f"{rule}; it has its own preprocess and declares no forward_inputs")
    for name, spec in specs.items():
        if "BYTES" in spec.datatypes:
            raise NotGraphable(f"{rule}; input '{name}' is BYTES")
        if isinstance(spec, AnyShape):
            raise NotGraphable(f"{rule}; input '{name}' declares no shape")
        if -1 in spec.row_shape:
            shape = ", ".join(["n", *("any" if d == -1 else str(d) for d in spec.row_shape)])
            raise NotGraphable(f"{rule}; input '{name}' is [{shape}]")


def capture_graphs(model: Model, device: Device, options: ModelOptions) -> list[GraphSet]:
    """Capture ``options.graph_batch_sizes`` graphs of the loaded ``model``, one set per instance;
    empty when the option is off, on CPU, or when a capture failed (the model runs eager, logged).
    Raises NotGraphable for a model the option cannot apply to."""
    sizes = sorted(set(options.graph_batch_sizes))
    if not sizes:
        return []
    check_graphable(model)
    api = _graph_api(device.spec.type) if device.is_accelerator else None
    if api is None:
        log.warning("model %s: graph_batch_sizes %s ignored on %s (graphs are captured on cuda "
                    "and npu only); running eager", model.name, sizes, device.label)
        return []
    began = time.perf_counter()
    try:
        sets = [GraphSet(_capture_set(model, device, api, sizes), device)
                for _ in range(options.instances)]
    except NotGraphable:
        raise
    except Exception as exc:  # noqa: BLE001 - a capture may fail in any backend's way; eager serves
        log.warning("model %s: graph capture on %s raised %s: %s; running eager", model.name,
                    device.label, type(exc).__name__, exc)
        return []
    log.info("model %s: captured graphs at batch sizes %s on %s for %d instance(s) in %.1f s",
             model.name, ", ".join(map(str, sizes)), device.label, options.instances,
             time.perf_counter() - began)
    return sets


def _graph_api(kind: str) -> tuple[Any, Any] | None:
    """The graph class and the capture context manager of devices of type ``kind`` (None: none)."""
    module = getattr(torch, kind, None)
    graph_class = getattr(module, _GRAPH_CLASSES.get(kind, ""), None)
    capture = getattr(module, "graph", None)
    return (graph_class, capture) if graph_class is not None and capture is not None else None


def _capture_set(model: Model, device: Device, api: tuple[Any, Any],
                 sizes: list[int]) -> list[CapturedGraph]:
    """One graph per size, largest first, the later ones in the first one's memory pool."""
    graph_class, capture = api
    side = device.new_stream()
    pool = None
    captured: list[CapturedGraph] = []
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            batch = example_batch(model, size)
            assert batch is not None  # check_graphable: the model declares inputs
            data = model.preprocess(batch)
            with device.on_stream(side):
                inputs = {name: device.to_device(value) for name, value in data.items()}
                model.forward(inputs)  # the warm-up a capture needs, on a side stream
                event = device.record_event(side)
            event.synchronize()
            graph = graph_class()
            with capture(graph, pool=pool, capture_error_mode="thread_local"):
                outputs = model.forward(inputs)
            pool = graph.pool()
            _check_outputs(model, size, outputs)
            captured.append(CapturedGraph(size, graph, inputs, outputs))
    return captured


def _check_outputs(model: Model, size: int, outputs: Any) -> None:
    """Raise NotGraphable unless the forward returned tensors with one row per input row."""
    for name, value in (outputs.items() if isinstance(outputs, dict) else [("", outputs)]):
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != size:
            what = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise NotGraphable(
                f"model '{model.name}': graph_batch_sizes needs a forward that returns a tensor "
                f"per output with one row per input row; output '{name}' of a batch of {size} "
                f"is {what}")
