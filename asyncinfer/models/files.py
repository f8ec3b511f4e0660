"""Models loaded from files: TorchScript (``NAME.pt``) and ``torch.export`` programs (``NAME.pt2``).

Inputs are passed to the program positionally, in the order the request lists them; a single
tensor result is the output ``output``, a tuple or list gives ``output_0``, ``output_1``, …
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncinfer.models.base import Batch, Model

__all__ = ["FileModel", "FILE_SUFFIXES"]

FILE_SUFFIXES = (".pt", ".pt2")


class FileModel(Model):
    """A TorchScript or exported program read from ``path`` when the worker loads it."""

    inputs = None

    def __init__(self, name: str, path: Path) -> None:
        self.name = name
        self.path = path
        self.program: Any = None

    def load(self, device: torch.device) -> None:
        if self.path.suffix == ".pt2":
            self.program = torch.export.load(str(self.path)).module().to(device)
        else:
            self.program = torch.jit.load(str(self.path), map_location=device)
            self.program.eval()

    def forward(self, batch: Batch) -> Batch:
        result = self.program(*batch.values())
        if isinstance(result, (tuple, list)):
            return {f"output_{i}": r for i, r in enumerate(result)}
        if isinstance(result, dict):
            return dict(result)
        return {"output": result}
