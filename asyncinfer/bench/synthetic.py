"""A synthetic model with three balanced stages, for the pipeline (async vs sync) comparison.

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

__all__ = ["Balanced3Stage"]


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
