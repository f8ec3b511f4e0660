"""The bench's workloads: which model, what one request carries, what model options apply."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncinfer.wire.payloads import to_input_payload

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


#: The mixed-length sentences: how many, and the share of long ones (issue's mix: 70 % of 6-14
#: words, 30 % of 60-120, shuffled).
MIXED_SENTENCES, MIXED_LONG_SHARE = 512, 0.3


@functools.lru_cache(maxsize=1)
def _mixed_sentences() -> tuple[str, ...]:
    """512 sentences of mixed length, the same every run: words drawn from the short sentences'
    vocabulary, 70 % of 6-14 words, 30 % of 60-120, in shuffled order."""
    rng = np.random.default_rng(20261203)
    words = " ".join(_SENTENCES).replace(".", "").split()
    long_count = int(MIXED_SENTENCES * MIXED_LONG_SHARE)
    lengths = [int(rng.integers(60, 121)) for _ in range(long_count)] + [
        int(rng.integers(6, 15)) for _ in range(MIXED_SENTENCES - long_count)]
    rng.shuffle(lengths)
    return tuple(" ".join(rng.choice(words, n)) + "." for n in lengths)


def mixed_sentence(i: int) -> str:
    """Sentence ``i`` (cycling) of the mixed-length set."""
    sentences = _mixed_sentences()
    return sentences[i % len(sentences)]


@dataclass(frozen=True)
class Workload:
    """One model under load; ``payload(i)`` is request ``i``'s v2 ``inputs`` (one row)."""

    name: str
    model: str
    kind: str
    factories: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def distinct_payloads(self) -> int:
        """How many different requests a load cycles through (every load, peers' too, sends the
        same ones): the whole mixed-length set, else 64."""
        return MIXED_SENTENCES if self.kind == "mixed-sentence" else 64

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
        elif self.kind == "mixed-sentence":
            value = np.array([mixed_sentence(i)], dtype=object)
        else:
            raise ValueError(f"unknown workload kind {self.kind!r}")
        name = "text" if self.kind in ("sentence", "mixed-sentence") else "input"
        return {"inputs": [to_input_payload(name, value)]}


_SYNTHETIC = "pipeline3=asyncinfer.ops.benchmark.synthetic:Balanced3Stage"

WORKLOADS = {
    "identity": Workload("identity", "identity", "vector8"),
    "mlp": Workload("mlp", "mlp", "vector16"),
    "minilm": Workload("minilm", "minilm", "sentence"),
    # sentences of mixed length: batched by length (the default for a model that declares a row's
    # cost), and in arrival order, as every plain batcher does
    "minilm-mixed": Workload("minilm-mixed", "minilm", "mixed-sentence"),
    "minilm-mixed-fifo": Workload("minilm-mixed-fifo", "minilm", "mixed-sentence",
                                  options={"group_by_cost": False}),
    "pipeline3-async": Workload("pipeline3-async", "pipeline3", "vector4", _SYNTHETIC,
                                {"pipelined": True}),
    "pipeline3-sync": Workload("pipeline3-sync", "pipeline3", "vector4", _SYNTHETIC,
                               {"pipelined": False}),
    # accelerator-shaped: the device's time is known, so the share of its limit is exact
    **{name: Workload(name, name, "vector4",
                      f"{name}=asyncinfer.ops.benchmark.synthetic:{name.replace('-', '_')}")
       for name in ("sim-slow", "sim-fast", "sim-prep")},
}
