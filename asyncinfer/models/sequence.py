"""A stateful model's side of sequence batching: what it declares (Triton's ``sequence_batching``)
and the control inputs the runner gives its forward.

A model that sets :attr:`Model.sequence_batching <asyncinfer.models.base.Model.sequence_batching>`
is *stateful*: every request it serves belongs to a sequence (v2 parameter ``sequence_id``) and
holds one row; the requests of a sequence run in order on the worker that took its first one
(engine/sequences.py), one at a time, batched with other sequences' requests (Triton's Oldest
strategy). Its forward gets, besides its inputs, the control inputs it names — START, END,
READY, CORRID, as Triton's ``control_input`` names them — as tensors of one value per row
(``[n, 1]``), and, with :attr:`SequenceBatching.state`, each sequence's state (Triton's implicit
state): the runner keeps each sequence's state output and gives it back as the state input of the
sequence's next request (zeros at its START), until the sequence ends or is idle past
:attr:`SequenceBatching.idle_timeout_s`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncinfer.wire.sequence import SequenceFlags
from asyncinfer.wire.tensors import TORCH_DTYPES

__all__ = ["SequenceBatching", "SequenceState", "CONTROL_DATATYPES", "CORRID_DATATYPES",
           "DEFAULT_IDLE_TIMEOUT_S"]

#: Datatypes of the START, END and READY controls (Triton's int32_false_true, fp32_false_true,
#: bool_false_true): 0 / 1 in them.
CONTROL_DATATYPES = ("INT32", "FP32", "BOOL")
#: Datatypes of the CORRID control: an integer (the request's sequence ID must be one), or BYTES
#: (Triton's TYPE_STRING: an integer ID is given as its decimal text).
CORRID_DATATYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")
#: How long a sequence may be idle before its state is released (seconds), unless the model says.
DEFAULT_IDLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SequenceState:
    """Triton's implicit state: the forward's input ``input`` holds each row's sequence state
    (``[n, *row_shape]`` of ``datatype``; zeros on the row that starts its sequence), and its
    output ``output`` (same shape) the new state, which the runner keeps for the sequence's next
    request and takes out of the answer."""

    input: str
    output: str
    row_shape: tuple[int, ...] = (1,)
    datatype: str = "FP32"

    def __post_init__(self) -> None:
        if not self.input or not self.output:
            raise ValueError("SequenceState needs the names of its input and its output")
        if self.datatype not in TORCH_DTYPES:
            raise ValueError(f"SequenceState datatype must be one of {', '.join(TORCH_DTYPES)}, "
                             f"got {self.datatype!r}")
        if any(d < 1 for d in self.row_shape):
            raise ValueError(f"SequenceState row_shape must be fixed sizes >= 1, got "
                             f"{self.row_shape!r}")

    def initial(self) -> torch.Tensor:
        """The state of a sequence at its START: zeros of one row."""
        return torch.zeros((1, *self.row_shape), dtype=TORCH_DTYPES[self.datatype])


@dataclass(frozen=True)
class SequenceBatching:
    """What a stateful model declares (Triton's ``sequence_batching``): the names of the control
    inputs its forward takes (``""``: not given), their datatypes, its implicit state, and how
    long a sequence may be idle (``idle_timeout_s``: Triton's ``max_sequence_idle_microseconds``)
    before its state is released and its next request refused. The strategy is Triton's Oldest."""

    start: str = ""
    end: str = ""
    ready: str = ""
    corrid: str = ""
    control_datatype: str = "INT32"
    corrid_datatype: str = "UINT64"
    state: SequenceState | None = None
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.control_datatype not in CONTROL_DATATYPES:
            raise ValueError(f"SequenceBatching control_datatype must be one of "
                             f"{', '.join(CONTROL_DATATYPES)}, got {self.control_datatype!r}")
        if self.corrid_datatype not in CORRID_DATATYPES:
            raise ValueError(f"SequenceBatching corrid_datatype must be one of "
                             f"{', '.join(CORRID_DATATYPES)}, got {self.corrid_datatype!r}")
        if not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s >= 1):
            raise ValueError(f"SequenceBatching idle_timeout_s must be a number of seconds >= 1, "
                             f"got {self.idle_timeout_s!r}")
        names = [n for n in (self.start, self.end, self.ready, self.corrid) if n]
        if self.state is not None:
            names.append(self.state.input)
        if len(names) != len(set(names)):
            raise ValueError(f"SequenceBatching names one input twice: {names}")

    @property
    def given_inputs(self) -> tuple[str, ...]:
        """The forward's inputs the runner gives (controls and state input), not the caller."""
        names = [n for n in (self.start, self.end, self.ready, self.corrid) if n]
        return (*names, self.state.input) if self.state is not None else tuple(names)

    def accepts_id(self, sequence: SequenceFlags) -> str | None:
        """Why this model cannot take ``sequence``'s ID (None: it can): a string ID where the
        CORRID control is an integer."""
        if self.corrid and self.corrid_datatype != "BYTES" and isinstance(sequence.id, str):
            return (f"its CORRID control is {self.corrid_datatype}, and sequence ID "
                    f"{sequence.id!r} is a string")
        return None

    def controls(self, flags: Sequence[SequenceFlags]) -> dict[str, Any]:
        """The control inputs of a batch whose rows belong to ``flags`` (in order): each ``[n, 1]``
        (READY is 1 on every row: a row is in a batch only when its request is there)."""
        n = len(flags)
        out: dict[str, Any] = {}
        dtype = TORCH_DTYPES[self.control_datatype]
        for name, values in ((self.start, [f.start for f in flags]),
                             (self.end, [f.end for f in flags]), (self.ready, [True] * n)):
            if name:
                out[name] = torch.tensor(values, dtype=torch.bool).to(dtype).reshape(n, 1)
        if self.corrid:
            if self.corrid_datatype == "BYTES":
                out[self.corrid] = np.array([str(f.id).encode() for f in flags],
                                            dtype=object).reshape(n, 1)
            else:
                out[self.corrid] = torch.tensor([int(f.id) for f in flags], dtype=torch.int64).to(
                    TORCH_DTYPES[self.corrid_datatype]).reshape(n, 1)
        return out

    def config(self) -> dict[str, Any]:
        """Triton's ``sequence_batching`` of the model configuration (and of the catalogue):
        ``oldest``, ``max_sequence_idle_microseconds``, ``control_input`` and ``state``."""
        kinds = (("START", self.start), ("END", self.end), ("READY", self.ready))
        controls: list[dict[str, Any]] = []
        for kind, name in kinds:
            if name:
                field = {"INT32": "int32_false_true", "FP32": "fp32_false_true",
                         "BOOL": "bool_false_true"}[self.control_datatype]
                values: list[Any] = [False, True] if self.control_datatype == "BOOL" else [0, 1]
                controls.append({"name": name, "control": [
                    {"kind": f"CONTROL_SEQUENCE_{kind}", field: values}]})
        if self.corrid:
            corrid_type = "TYPE_STRING" if self.corrid_datatype == "BYTES" else \
                f"TYPE_{self.corrid_datatype}"
            controls.append({"name": self.corrid, "control": [
                {"kind": "CONTROL_SEQUENCE_CORRID", "data_type": corrid_type}]})
        config: dict[str, Any] = {
            "oldest": {"max_candidate_sequences": 0, "preferred_batch_size": [],
                       "max_queue_delay_microseconds": 0},
            "max_sequence_idle_microseconds": int(self.idle_timeout_s * 1_000_000),
            "control_input": controls}
        if self.state is not None:
            config["state"] = [{"input_name": self.state.input, "output_name": self.state.output,
                                "data_type": f"TYPE_{self.state.datatype}",
                                "dims": list(self.state.row_shape)}]
        return config
