"""The built-in models every worker can host: ``identity`` and ``mlp``."""

from __future__ import annotations

import torch

from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec

__all__ = ["Identity", "MLP"]


class Identity(Model):
    """Returns every input unchanged: any names, shapes and datatypes (BYTES included)."""

    name = "identity"
    inputs = None

    def forward(self, batch: Batch) -> Batch:
        return dict(batch)


class MLP(Model):
    """A small fixed-seed MLP: ``input`` FP32 [n, 16] → ``output`` FP32 [n, 4]; NaN and
    infinite inputs are refused.

    Same weights in every process (seed 0), so results can be checked against a direct call.
    """

    name = "mlp"
    in_features = 16
    hidden = 64
    out_features = 4
    inputs = {"input": InputSpec(("FP32",), (in_features,), allow_nonfinite=False)}
    outputs = {"output": OutputSpec("FP32", (out_features,))}

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(self.in_features, self.hidden), torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, self.hidden), torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, self.out_features),
        )
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        self.net.eval()

    def load(self, device: torch.device) -> None:
        self.net.to(device)

    def forward(self, batch: Batch) -> Batch:
        return {"output": self.net(batch["input"])}
