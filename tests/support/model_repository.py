"""A Triton model repository built from small modules, as a user's would be: a TorchScript model, a
``torch.export`` model and an ONNX model (two versions), each with its ``config.pbtxt``."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

__all__ = ["Scale", "build_repository", "CONFIGS", "FACTORS", "scaled"]


class Scale(torch.nn.Module):
    """``x`` [n, 4] → ``x * factor``: known values, and the factor tells which version ran."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def scaled(rows: list[list[float]], factor: float) -> list[list[float]]:
    """What :class:`Scale` answers for ``rows``."""
    return [[v * factor for v in row] for row in rows]


#: Each model's config.pbtxt (Triton's text format).
CONFIGS = {
    "scripted": '''
name: "scripted"
platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
''',
    "exported": '''
name: "exported"
platform: "torch_export"
max_batch_size: 16
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { }
''',
    "onnx": '''
name: "onnx"
platform: "onnxruntime_onnx"
max_batch_size: 32
version_policy: { all { } }
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { preferred_batch_size: [ 16 ] max_queue_delay_microseconds: 1000 }
''',
}
#: The factor of each model's version: answers tell which version ran.
FACTORS = {("scripted", "1"): 2.0, ("exported", "1"): 3.0, ("onnx", "1"): 5.0, ("onnx", "2"): 7.0}


def build_repository(root: Path) -> Path:
    """Write the repository under ``root`` (created); returns it."""
    root.mkdir(parents=True, exist_ok=True)
    example = (torch.ones(2, 4),)
    batch = torch.export.Dim("batch", min=1, max=1024)
    for (name, version), factor in FACTORS.items():
        folder = root / name / version
        folder.mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(CONFIGS[name])
        module = Scale(factor).eval()
        if name == "scripted":
            torch.jit.save(torch.jit.script(module), str(folder / "model.pt"))
        elif name == "exported":
            program = torch.export.export(module, example, dynamic_shapes={"x": {0: batch}})
            torch.export.save(program, str(folder / "model.pt2"))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the legacy exporter says it is one
                torch.onnx.export(module, example, str(folder / "model.onnx"), input_names=["x"],
                                  output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}},
                                  dynamo=False)
    return root
