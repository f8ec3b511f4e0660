"""Stateful models only the tests register (ASYNCINFER_MODEL_FACTORIES): ``accumulator``, a
running sum per sequence kept as the runner's implicit state, with every control input."""

from __future__ import annotations

import os

import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec
from asyncinfer.models.sequence import SequenceBatching, SequenceState

__all__ = ["Accumulator", "ACCUMULATOR_FACTORY", "RELEASED_LOG_ENV"]

#: A file the accumulator appends each released sequence ID to (one a line), when set.
RELEASED_LOG_ENV = "ASYNCINFER_TEST_RELEASED_LOG"


class Accumulator(Model):
    """INT64 INPUT [n, 1] → SUM [n, 1]: each sequence's running sum of its inputs (zero at its
    START), and START / END / READY / CORRID echoed as outputs of the same row, so that a test sees
    what the sequence batcher gave the model. Sequences idle for 2 s are released."""

    name = "accumulator"
    inputs = {"INPUT": InputSpec(("INT64",), (1,))}
    outputs = {"SUM": OutputSpec("INT64", (1,)), "FLAGS": OutputSpec("INT64", (4,))}
    options = ModelOptions(max_batch_size=8, max_delay_ms=5.0, warmup=False)
    sequence_batching = SequenceBatching(
        start="START", end="END", ready="READY", corrid="CORRID", corrid_datatype="BYTES",
        state=SequenceState("ACC", "ACC_OUT", (1,), "INT64"), idle_timeout_s=2.0)

    def forward(self, batch: Batch) -> Batch:
        total = batch["ACC"] + batch["INPUT"]
        rows = total.shape[0]
        corrid = [int(v) if v.isdigit() else -1 for v in (c.decode() for c in
                                                            batch["CORRID"].reshape(-1))]
        flags = torch.cat([batch["START"].to(torch.int64), batch["END"].to(torch.int64),
                           batch["READY"].to(torch.int64),
                           torch.tensor(corrid, dtype=torch.int64).reshape(rows, 1)], dim=1)
        return {"SUM": total, "FLAGS": flags, "ACC_OUT": total}

    def end_sequence(self, sequence_id: int | str) -> None:
        path = os.environ.get(RELEASED_LOG_ENV)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{sequence_id}\n")


#: Its ``ASYNCINFER_MODEL_FACTORIES`` entry.
ACCUMULATOR_FACTORY = "accumulator=tests.support.sequence_models:Accumulator"
