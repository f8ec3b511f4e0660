"""What the model control tests load: a model whose weights are large enough to see in the
worker's resident memory, and the worker's resident size itself."""

from __future__ import annotations

import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Batch, InputSpec, Model

#: The weights of :class:`Big` (bytes).
BIG_BYTES = 200 * 1024 * 1024


class Big(Model):
    """``input`` FP32 [n, 1] → ``output`` = input + 1, holding ~200 MB of weights (every page
    written, so they are resident)."""

    name = "big"
    options = ModelOptions(warmup=False)
    inputs = {"input": InputSpec(("FP32",), (1,))}

    def __init__(self) -> None:
        self.weights: torch.Tensor | None = None

    def load(self, device: torch.device) -> None:
        self.weights = torch.ones(BIG_BYTES // 4, dtype=torch.float32, device=device)

    def forward(self, batch: Batch) -> Batch:
        assert self.weights is not None
        return {"output": batch["input"] + self.weights[0]}


def rss_bytes(pid: int) -> int:
    """The resident size of process ``pid`` (``VmRSS`` of /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"process {pid} has no VmRSS")


def make_affine_v2() -> Model:
    """Version 2 of the tests' ``affine`` (``x`` FP64 [n, 3] → ``y`` = 3x + 2)."""
    from tests.support.models import make_affine

    model = make_affine()
    forward = model.forward
    model.forward = lambda batch: {"y": forward(batch)["y"] + 1}  # type: ignore[method-assign]
    return model


def make_gated_v2() -> Model:
    """Version 2 of the tests' ``gated``: its own gate and executions (``<prefix>-v2:…``)."""
    from tests.support.models import Gated

    model = Gated()
    model.prefix += "-v2"
    return model
