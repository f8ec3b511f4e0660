"""The bench's workloads: which model, what one request carries, what model options apply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncinfer.wire.protocol import to_input_payload

__all__ = ["Workload", "WORKLOADS"]

_SENTENCES = [
    "A man is playing a guitar on the stage.",
    "The quick brown fox jumps over the lazy dog.",
    "Batching requests that arrive close together keeps the accelerator busy.",
    "It rained all day.",
    "Embeddings map sentences with similar meaning to nearby vectors.",
    "The library opens at nine on weekdays and at ten on Saturdays.",
    "Celery workers consume tasks from Redis queues.",
    "She sells sea shells by the sea shore.",
]


@dataclass(frozen=True)
class Workload:
    """One model under load; ``payload(i)`` is request ``i``'s v2 ``inputs`` (one row)."""

    name: str
    model: str
    kind: str
    factories: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def payload(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(i)
        if self.kind == "vector8":
            value: Any = rng.random((1, 8), np.float32)
        elif self.kind == "vector16":
            value = rng.random((1, 16), np.float32)
        elif self.kind == "vector4":
            value = rng.random((1, 4), np.float32)
        elif self.kind == "sentence":
            value = np.array([_SENTENCES[i % len(_SENTENCES)]], dtype=object)
        else:
            raise ValueError(f"unknown workload kind {self.kind!r}")
        name = "text" if self.kind == "sentence" else "input"
        return {"inputs": [to_input_payload(name, value)]}


_SYNTHETIC = "pipeline3=asyncinfer.bench.synthetic:Balanced3Stage"

WORKLOADS = {
    "identity": Workload("identity", "identity", "vector8"),
    "mlp": Workload("mlp", "mlp", "vector16"),
    "minilm": Workload("minilm", "minilm", "sentence"),
    "pipeline3-async": Workload("pipeline3-async", "pipeline3", "vector4", _SYNTHETIC,
                                {"pipelined": True}),
    "pipeline3-sync": Workload("pipeline3-sync", "pipeline3", "vector4", _SYNTHETIC,
                               {"pipelined": False}),
    # accelerator-shaped: the device's time is known, so the share of its limit is exact
    **{name: Workload(name, name, "vector4",
                      f"{name}=asyncinfer.bench.synthetic:{name.replace('-', '_')}")
       for name in ("sim-slow", "sim-fast", "sim-prep")},
}
