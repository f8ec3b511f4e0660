"""ONNX models through onnxruntime (the optional extra ``asyncinfer[onnx]``): Triton's
``onnxruntime_onnx`` platform, a ``NAME.onnx`` file of the model folder or ``model.onnx`` in a
repository's version folder.

Inputs and outputs are the graph's, by name: a request names the graph's inputs (any order); the
answer holds every graph output. The signature comes from the graph (its symbolic dimensions are
-1; the first is the batch's rows) unless a ``config.pbtxt`` declares one, which must then agree
with the graph as Triton requires. The execution provider follows the worker's device: CUDA on an
NVIDIA GPU, CANN on an Ascend NPU, else the CPU; a device whose provider this onnxruntime build
lacks is refused at load, naming the build to install.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec

__all__ = ["OnnxModel", "ONNX_DATATYPES", "onnx_available", "providers_for"]

#: onnxruntime's tensor types → v2 datatypes.
ONNX_DATATYPES = {
    "tensor(float)": "FP32", "tensor(float16)": "FP16", "tensor(bfloat16)": "BF16",
    "tensor(double)": "FP64", "tensor(int64)": "INT64", "tensor(int32)": "INT32",
    "tensor(int16)": "INT16", "tensor(int8)": "INT8", "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32", "tensor(uint64)": "UINT64",
    "tensor(bool)": "BOOL", "tensor(string)": "BYTES",
}
#: The execution provider of each accelerator type, and the onnxruntime build that has it.
_PROVIDERS = {"cuda": ("CUDAExecutionProvider", "onnxruntime-gpu"),
              "npu": ("CANNExecutionProvider", "onnxruntime-cann")}


def onnx_available() -> bool:
    """Whether onnxruntime is installed (looked up, not imported)."""
    return importlib.util.find_spec("onnxruntime") is not None


def providers_for(device: Any, available: list[str]) -> list[Any]:
    """onnxruntime's providers for ``device`` (a torch device, or what has its ``type`` and
    ``index``): the accelerator's first, the CPU's as fallback for the operators it lacks.

    Raises:
        ValueError: the device's provider is not in ``available`` (this build lacks it).
    """
    wanted = _PROVIDERS.get(device.type)
    if wanted is None:
        return ["CPUExecutionProvider"]
    provider, build = wanted
    if provider not in available:
        raise ValueError(f"device {device.type}:{device.index or 0} needs onnxruntime's "
                         f"{provider}, which this onnxruntime build lacks (it has "
                         f"{', '.join(available)}); install {build} in place of onnxruntime")
    return [(provider, {"device_id": device.index or 0}), "CPUExecutionProvider"]


class OnnxModel(Model):
    """An ONNX graph read from ``path`` into an onnxruntime session when the worker loads it."""

    platform = "onnxruntime_onnx"

    def __init__(self, name: str, path: Path, inputs: Mapping[str, InputSpec] | None = None,
                 outputs: Mapping[str, OutputSpec] | None = None,
                 batch_dimension: bool = True) -> None:
        self.name = name
        self.path = path
        self.session: Any = None
        self.inputs = dict(inputs) if inputs is not None else None
        self.outputs = dict(outputs) if outputs is not None else None
        self.batch_dimension = batch_dimension
        self._output_names: list[str] = []

    def load(self, device: torch.device) -> None:
        """Open the graph in an onnxruntime session on ``device``'s provider.

        Raises:
            ValueError: onnxruntime is not installed, the file is not an ONNX graph, or the
                graph disagrees with the declared signature; the message names the model, the
                file and the rule in one line.
        """
        what = f"model '{self.name}': {self.path}"
        if not onnx_available():
            raise ValueError(f"{what}: ONNX models need onnxruntime: pip install 'asyncinfer[onnx]'")
        import onnxruntime

        try:
            providers = providers_for(device, onnxruntime.get_available_providers())
            options = onnxruntime.SessionOptions()
            options.log_severity_level = 3  # errors only: its warnings are not the user's
            self.session = onnxruntime.InferenceSession(str(self.path), options,
                                                        providers=providers)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - onnxruntime's own error types, named in one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(f"{what} cannot be loaded by onnxruntime: {first}") from None
        graph_inputs = {i.name: _spec_of(i, self.batch_dimension) for i in self.session.get_inputs()}
        graph_outputs = {o.name: _output_of(o, self.batch_dimension)
                         for o in self.session.get_outputs()}
        if self.inputs is None:
            self.inputs = graph_inputs
        else:
            _agree(what, "input", self.inputs, graph_inputs)
        if self.outputs is None:
            self.outputs = graph_outputs
        else:
            _agree(what, "output", self.outputs, graph_outputs)
        self._output_names = list(graph_outputs)

    def forward(self, batch: Batch) -> Batch:
        feeds = {name: _host_array(value) for name, value in batch.items()}
        results = self.session.run(self._output_names, feeds)
        return {name: _tensor_of(value) for name, value in zip(self._output_names, results,
                                                                   strict=True)}


def _host_array(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def _tensor_of(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype != object:
        return torch.from_numpy(np.ascontiguousarray(value))
    return value  # strings: an object array, as BYTES travel


def _dims(shape: list[Any], batch_dimension: bool) -> tuple[int, ...]:
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)
    return dims[1:] if batch_dimension else dims


def _spec_of(arg: Any, batch_dimension: bool) -> InputSpec:
    return InputSpec((_datatype(arg),), _dims(list(arg.shape), batch_dimension))


def _output_of(arg: Any, batch_dimension: bool) -> OutputSpec:
    return OutputSpec(_datatype(arg), _dims(list(arg.shape), batch_dimension))


def _datatype(arg: Any) -> str:
    datatype = ONNX_DATATYPES.get(arg.type)
    if datatype is None:
        raise ValueError(f"'{arg.name}' is of type {arg.type}, which has no v2 datatype")
    return datatype


def _agree(what: str, kind: str, declared: Mapping[str, Any], graph: Mapping[str, Any]) -> None:
    """Raise ValueError unless every declared tensor is the graph's, of its datatype, with dims
    that fit the graph's (a graph's -1 takes any size), as Triton checks a config against an
    ONNX model; outputs may be a subset."""
    for name, spec in declared.items():
        found = graph.get(name)
        if found is None:
            raise ValueError(f"{what}: config.pbtxt's {kind} '{name}' is not a {kind} of the "
                             f"graph ({kind}s: {', '.join(repr(n) for n in graph)})")
        want = spec.datatypes[0] if isinstance(spec, InputSpec) else spec.datatype
        has = found.datatypes[0] if isinstance(found, InputSpec) else found.datatype
        if want != has:
            raise ValueError(f"{what}: config.pbtxt's {kind} '{name}' is {want}, the graph's "
                             f"is {has}")
        dims, graph_dims = spec.row_shape, found.row_shape
        if len(dims) != len(graph_dims) or any(g not in (-1, d) for d, g in zip(dims, graph_dims,
                                                                              strict=True)):
            raise ValueError(f"{what}: config.pbtxt's {kind} '{name}' has dims {list(dims)}, "
                             f"the graph's are {list(graph_dims)} (without the batch dimension)")
    if kind == "input":
        missing = [n for n in graph if n not in declared]
        if missing:
            raise ValueError(f"{what}: the graph's input(s) {', '.join(repr(m) for m in missing)} "
                             f"are not in config.pbtxt")
