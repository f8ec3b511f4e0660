"""Streaming models only the tests register (ASYNCINFER_MODEL_FACTORIES): ``slow-echo``, the
built-in echo-stream at a slower, known pace, so that a test can act while a request streams;
``square``, the python backend's ``square_int32`` (``n`` responses for ``n``, none for 0)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec, StreamRows, StreamStep
from asyncinfer.models.echo_stream import EchoStream

__all__ = ["SlowEcho", "SLOW_ECHO_FACTORY", "Square", "SQUARE_FACTORY"]


class SlowEcho(EchoStream):
    """echo-stream at 0.02 s a step."""

    name = "slow-echo"
    step_s = 0.02


#: Its ``ASYNCINFER_MODEL_FACTORIES`` entry.
SLOW_ECHO_FACTORY = "slow-echo=tests.support.stream_models:SlowEcho"


class Square(Model):
    """Triton's python backend example ``square_int32``: INT32 ``IN`` [1] → ``IN`` responses, each
    INT32 ``OUT`` [1] = ``IN``; ``IN`` = 0 ends the request with no response at all."""

    name = "square"
    decoupled = True
    inputs = {"IN": InputSpec(("INT32",), ())}
    outputs = {"OUT": OutputSpec("INT32", ())}

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        given = batch["IN"]
        counts = [int(v) for v in (given.tolist() if hasattr(given, "tolist") else given)]
        made = [0] * len(counts)
        while rows.live():
            produced = [r for r in rows.live() if made[r] < counts[r]]
            for r in produced:
                made[r] += 1
            yield StreamStep(rows=produced,
                             outputs={"OUT": np.array([counts[r] for r in produced], np.int32)},
                             done=[r for r in rows.live() if made[r] >= counts[r]])


#: Its ``ASYNCINFER_MODEL_FACTORIES`` entry.
SQUARE_FACTORY = "square=tests.support.stream_models:Square"
