"""Models without a batch dimension (Triton's ``max_batch_size: 0``, ``Model.batch_dimension``
False), registered by the tests that use them (ASYNCINFER_MODEL_FACTORIES)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from asyncinfer.models import Batch, InputSpec, Model, OutputSpec, StreamRows, StreamStep

__all__ = ["Repeat", "Planes", "UNBATCHED_FACTORIES"]

#: What a test worker adds to the test factories to host them.
UNBATCHED_FACTORIES = ("repeat=tests.support.unbatched_models:Repeat,"
                       "planes=tests.support.unbatched_models:Planes")


class Repeat(Model):
    """Triton's ``repeat_int32``: ``IN`` INT32 [n], ``DELAY`` UINT32 [n], ``WAIT`` UINT32 [1]:
    one response per element of ``IN`` — ``OUT`` INT32 [1] (the element) and ``IDX`` UINT32 [1]
    (its index); zero elements, zero responses."""

    name = "repeat"
    batch_dimension = False
    decoupled = True
    inputs = {"IN": InputSpec(("INT32",), (-1,)), "DELAY": InputSpec(("UINT32",), (-1,)),
              "WAIT": InputSpec(("UINT32",), (1,))}
    outputs = {"OUT": OutputSpec("INT32", (1,)), "IDX": OutputSpec("UINT32", (1,))}

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        values = _np(batch["IN"]).reshape(-1)
        if len(_np(batch["DELAY"]).reshape(-1)) != len(values):
            raise ValueError(f"IN has {len(values)} elements, DELAY "
                             f"{len(_np(batch['DELAY']).reshape(-1))}: they must agree")
        for i, value in enumerate(values):
            last = i == len(values) - 1
            yield StreamStep([0], {"OUT": np.array([value], np.int32),
                                   "IDX": np.array([i], np.uint32)}, done=[0] if last else [])
        if not len(values):
            yield StreamStep([], {}, done=[0])


class Planes(Model):
    """An image model written for no batch dimension: ``data`` FP32 [3, h, w] → ``sums`` FP32
    [3] (each plane's sum) and ``shape`` INT64 [3] (what forward saw)."""

    name = "planes"
    batch_dimension = False
    inputs = {"data": InputSpec(("FP32",), (3, -1, -1))}
    outputs = {"sums": OutputSpec("FP32", (3,)), "shape": OutputSpec("INT64", (3,))}

    def forward(self, batch: Batch) -> Batch:
        data = batch["data"]
        return {"sums": data.sum(dim=(1, 2)),
                "shape": torch.tensor(list(data.shape), dtype=torch.int64)}


def _np(value: object) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
