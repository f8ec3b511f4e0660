"""Test models whose output declares class labels (the gateway's classification extension):
registered through ASYNCINFER_MODEL_FACTORIES by tests/integration/test_gateway_classification.py."""

from __future__ import annotations

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec

__all__ = ["Scores", "WholeScores", "LABELS"]

#: The labels of ``probs``: class 2 has an empty one (answered without a label, as Triton
#: answers a blank line of its label file).
LABELS = ("apple", "pickle", "", "kiwi")


class Scores(Model):
    """``scores`` FP32 [n, 4] → ``probs``: the same values, four classes with labels."""

    name = "scores"
    options = ModelOptions(warmup=False)
    inputs = {"scores": InputSpec(("FP32",), (4,))}
    outputs = {"probs": OutputSpec("FP32", (4,), labels=LABELS)}

    def forward(self, batch: Batch) -> Batch:
        return {"probs": batch["scores"]}


class WholeScores(Scores):
    """``scores`` FP32 [1, 2, 4] → ``probs``, a model that does not batch (its config's
    ``max_batch_size`` is 0): its classes are taken over the whole output tensor (eight
    elements), as Triton takes them for such a model."""

    name = "scores-whole"
    batchable = False
    inputs = {"scores": InputSpec(("FP32",), (2, 4))}
    outputs = {"probs": OutputSpec("FP32", (2, 4), labels=LABELS)}
