"""Synthetic bench models: three balanced stages (the pipeline comparison), and the
accelerator-shaped ``sim`` models (a device that takes ``a + b × rows`` with the GIL released).


Each stage takes ``ASYNCINFER_BENCH_STAGE_MS`` per batch (default 20) without holding the GIL, as
device work and native CPU work (tokenizers, image decoding) do. Pipelined, the three stages of
successive batches overlap; serially, a batch takes the sum of the three. At 20 ms a stage, a batch
of 8 every 20 ms (400 req/s) stays below what the serving path itself can carry on a 2-core host,
so the comparison measures the pipeline, not the per-request overhead (at 5 ms a stage the async
run is capped by that overhead near 700 req/s: 1.63× instead of 3×).
"""

from __future__ import annotations

import os
import time

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Batch, InputSpec, Model

__all__ = ["Balanced3Stage", "SimDevice", "sim_slow", "sim_fast", "sim_prep"]


class Balanced3Stage(Model):
    """``input`` FP32 [n, 4] → ``output`` = input + 3, one stage-time per stage per batch."""

    name = "pipeline3"
    inputs = {"input": InputSpec(("FP32",), (4,))}
    options = ModelOptions(max_batch_size=8, max_delay_ms=2.0)

    def __init__(self) -> None:
        self.stage_s = float(os.environ.get("ASYNCINFER_BENCH_STAGE_MS", "20")) / 1000.0

    def preprocess(self, batch: Batch) -> Batch:
        time.sleep(self.stage_s)
        return {"input": batch["input"] + 1}

    def forward(self, batch: Batch) -> Batch:
        time.sleep(self.stage_s)
        return {"output": batch["input"] + 1}

    def postprocess(self, outputs: Batch) -> Batch:
        time.sleep(self.stage_s)
        return {"output": outputs["output"] + 1}


class SimDevice(Model):
    """An accelerator-shaped model: ``input`` FP32 [n, 4] → ``output`` = input × 2.

    Its forward takes ``a_s + b_s × rows`` with the GIL released (``time.sleep``), as a device
    kernel does: the CPU stays free for serving, so what the bench measures beside the model is
    the serving path's own cost. With ``prep_s_per_row`` > 0 a preprocess stage holds the GIL for
    that long per row (busy Python, as a tokenizer written in Python does). Max batch 32, 5 ms.
    """

    inputs = {"input": InputSpec(("FP32",), (4,))}
    options = ModelOptions(max_batch_size=32, max_delay_ms=5.0)

    def __init__(self, name: str, a_s: float, b_s: float, prep_s_per_row: float = 0.0) -> None:
        self.name = name
        self.a_s, self.b_s, self.prep_s_per_row = a_s, b_s, prep_s_per_row

    def limit_rows_per_s(self) -> float:
        """Rows/s of the device alone at the largest batch: the bench's in-process limit."""
        rows = self.options.max_batch_size
        return rows / (self.a_s + self.b_s * rows + self.prep_s_per_row * rows)

    def preprocess(self, batch: Batch) -> Batch:
        if self.prep_s_per_row > 0:
            until = time.perf_counter() + self.prep_s_per_row * len(batch["input"])
            while time.perf_counter() < until:  # holds the GIL, as Python CPU work does
                pass
        return batch

    def forward(self, batch: Batch) -> Batch:
        time.sleep(self.a_s + self.b_s * len(batch["input"]))
        return {"output": batch["input"] * 2}


def sim_slow() -> Model:
    """A slow device: 20 ms + 1 ms per row (615 rows/s at batch 32)."""
    return SimDevice("sim-slow", 0.020, 0.001)


def sim_fast() -> Model:
    """A fast device: 4 ms + 0.1 ms per row (4,444 rows/s at batch 32): the serving path is the
    bottleneck on a small host."""
    return SimDevice("sim-fast", 0.004, 0.0001)


def sim_prep() -> Model:
    """The fast device behind a CPU preprocess of 0.2 ms per row that holds the GIL."""
    return SimDevice("sim-prep", 0.004, 0.0001, prep_s_per_row=0.0002)
