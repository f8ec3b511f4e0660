"""The bench's model as a peer serves it: built from the project's registry, one batch per call.

Imported in the peers venv (torch, numpy, and asyncinfer on ``PYTHONPATH``): the peers run the
same preprocess → forward → postprocess as asyncinfer's worker, on the same batch sizes, with the
same number of model instances and threads per instance.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncinfer.engine.threads import apply_intra_op_threads
from asyncinfer.models.base import Model
from asyncinfer.models.registry import Registry
from asyncinfer.ops.benchmark.v2_loadgen import model_options, request_rows
from asyncinfer.ops.benchmark.workloads import WORKLOADS

__all__ = ["ServedModel", "model_options"]


class ServedModel:
    """One loaded model of a workload; ``__call__`` runs one batch of rows."""

    def __init__(self, workload_name: str) -> None:
        if workload_name not in WORKLOADS:
            raise SystemExit(f"unknown workload {workload_name!r}; known: {sorted(WORKLOADS)}")
        workload = WORKLOADS[workload_name]
        registry = Registry.from_config([workload.factories] if workload.factories else [])
        self.model: Model = registry.create(workload.model)
        #: Model instances, as asyncinfer's worker runs them (Triton's instance count, Ray's
        #: replicas), each with the same share of torch's threads as the worker gives one.
        self.instances = self.model.options.instances
        apply_intra_op_threads(0, self.instances, on_cpu=True)
        self.model.load(torch.device("cpu"))
        self.name = workload.model
        self.max_batch_size = self.model.options.max_batch_size
        self.max_delay_ms = self.model.options.max_delay_ms
        self.input_name, self.datatype, rows = request_rows(workload_name, 1)
        self.row_shape = tuple(rows[0].shape[1:])
        self.output_name, self.output_row_shape = "", ()
        out = self(rows[0])  # warm up, and learn the output's name and row shape
        self.output_row_shape = tuple(out.shape[1:])

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """Rows [n, ...] of the one input (object array of bytes for BYTES) → the one output."""
        value: Any = rows.reshape(-1) if self.datatype == "BYTES" else torch.from_numpy(
            np.ascontiguousarray(rows, dtype=np.float32))
        with torch.inference_mode():
            outputs = self.model.postprocess(self.model.forward(
                self.model.preprocess({self.input_name: value})))
        ((self.output_name, out),) = outputs.items()
        return out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
