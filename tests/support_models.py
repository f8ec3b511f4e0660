"""Models that only the tests register (through ASYNCINFER_MODEL_FACTORIES)."""

from __future__ import annotations

import time

import torch

from asyncinfer.models.base import Batch, InputSpec, Model


class Sleep(Model):
    """``input`` FP32 [n, 1]: sleeps the batch's largest value in seconds, returns the input."""

    name = "sleep"
    inputs = {"input": InputSpec(("FP32",), (1,))}

    def forward(self, batch: Batch) -> Batch:
        time.sleep(float(batch["input"].max()) if len(batch["input"]) else 0.0)
        return {"output": batch["input"]}


class Poison(Model):
    """``input`` FP32 [n, 1] → ``output`` = input × 2; raises when any row is negative.

    A row ≥ 100 makes the batch first sleep (value − 100) seconds: a way to keep the device busy.
    """

    name = "poison"
    inputs = {"input": InputSpec(("FP32",), (1,))}

    def forward(self, batch: Batch) -> Batch:
        x = batch["input"]
        if len(x) and float(x.max()) >= 100:
            time.sleep(float(x.max()) - 100)
        if bool((x < 0).any()):
            raise RuntimeError("negative input poisons this model")
        return {"output": x * 2}


def make_affine() -> Model:
    """A user factory: ``x`` FP64 [n, 3] → ``y`` = 3x + 1."""

    class Affine(Model):
        inputs = {"x": InputSpec(("FP64",), (3,))}

        def forward(self, batch: Batch) -> Batch:
            return {"y": batch["x"] * 3 + 1}

    return Affine()


def tiny_linear_module() -> torch.nn.Module:
    """A fixed module the file-model tests save as TorchScript and torch.export programs."""
    torch.manual_seed(1)
    return torch.nn.Linear(4, 2).eval()


class Affine3(Model):
    """``input`` FP32 [n, 1] in three stages: preprocess +1, forward ×10, postprocess −1."""

    name = "affine3"
    inputs = {"input": InputSpec(("FP32",), (1,))}

    def preprocess(self, batch: Batch) -> Batch:
        return {"prepared": batch["input"] + 1}

    def forward(self, batch: Batch) -> Batch:
        if bool((batch["prepared"] > 1000).any()):
            raise RuntimeError("affine3 refuses values over 999")
        return {"scaled": batch["prepared"] * 10}

    def postprocess(self, outputs: Batch) -> Batch:
        return {"output": outputs["scaled"] - 1}
