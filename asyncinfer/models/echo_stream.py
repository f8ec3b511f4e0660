"""The built-in streaming model ``echo-stream``: a text generator's behaviour, deterministic.
``text_input`` BYTES (one string per request: shape [1], or [1, 1]) and optionally ``max_tokens``
INT32 (or any integer datatype; shape [1] or [1, 1], >= 1). It streams back the words of
``text_input``, one word per step as ``text_output`` BYTES [1, 1] per part: the words once, or
cyclically until ``max_tokens`` words when given. Each step takes :attr:`EchoStream.step_s`
(simulated decode time: one sleep per step for the whole batch). Rows of one batch finish at
different steps; a cancelled row is no longer computed. Requests that arrive while a batch streams
join it between two steps (in-flight batching: :attr:`Model.inflight_batching`). Its joined
answer is ``text_output`` BYTES [1]: the words joined with single spaces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.errors import InvalidRequest
from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec, StreamRows, StreamStep
from asyncinfer.wire.protocol import Request

__all__ = ["EchoStream"]

#: ``max_tokens`` in any integer datatype (a Python int arrives as INT64); INT32 is the declared one.
_INTEGERS = ("INT32", "INT64", "INT16", "INT8", "UINT32", "UINT64", "UINT16", "UINT8")


class EchoStream(Model):
    """Streams the words of its input back, one per step (see the module's text)."""

    name = "echo-stream"
    decoupled = True
    inflight_batching = True
    platform = "python"
    inputs = {"text_input": InputSpec(("BYTES",), ()), "max_tokens": InputSpec(_INTEGERS, ())}
    outputs = {"text_output": OutputSpec("BYTES", (1,))}
    #: Up to 128 rows a batch: a step costs the same however many rows it computes (as a decode
    #: step on an accelerator nearly does, up to its memory bound), so 64 concurrent streams share
    #: one batch instead of half of them waiting for the other half's whole generation.
    options = ModelOptions(max_batch_size=128)
    #: Seconds each step takes (simulated decode time), once per step for the whole batch.
    step_s: float = 0.01

    def validate(self, request: Request) -> None:
        """``text_input`` (with at least one word) and optionally ``max_tokens`` (>= 1), each
        one value for the request's one row."""
        given = {t.name: t for t in request.inputs}
        if "text_input" not in given:
            raise InvalidRequest(f"request {request.id}: model '{self.name}' needs input "
                                 f"'text_input'; got {', '.join(repr(g) for g in sorted(given))}")
        for t in request.inputs:
            spec = self.inputs.get(t.name)
            if spec is None:
                raise InvalidRequest(
                    f"request {request.id}: input '{t.name}' is not an input of model "
                    f"'{self.name}' (inputs: 'text_input', optional 'max_tokens')")
            if t.datatype not in spec.datatypes or len(t.shape) not in (1, 2) or (
                    len(t.shape) == 2 and t.shape[1] != 1):
                raise InvalidRequest(
                    f"request {request.id}: input '{t.name}': {t.datatype} {list(t.shape)} does "
                    f"not match {spec.datatypes[0]} [n] or [n, 1]")
        for row in range(given["text_input"].shape[0]):
            if not _words(given["text_input"].value.reshape(-1)[row]):
                raise InvalidRequest(f"request {request.id}: input 'text_input' holds no word "
                                     f"(model '{self.name}' streams its words back)")
        if "max_tokens" in given:
            limits = given["max_tokens"].value.reshape(-1)
            if bool((limits < 1).any()):
                raise InvalidRequest(f"request {request.id}: input 'max_tokens' must be >= 1, "
                                     f"got {limits.tolist()}")

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        words: list[list[str]] = []
        wanted: list[int] = []
        made: list[int] = []
        _absorb(batch, words, wanted, made)
        while True:
            for _, joined in rows.take_joined():  # rows joined since the last step (in order)
                _absorb(joined, words, wanted, made)
            live = rows.live()  # cancelled rows are not computed
            if not live:
                return
            time.sleep(self.step_s)
            out = np.empty((len(live), 1), dtype=object)
            done = []
            for j, r in enumerate(live):
                out[j, 0] = words[r][made[r] % len(words[r])]
                made[r] += 1
                if made[r] >= wanted[r]:
                    done.append(r)
            yield StreamStep(rows=live, outputs={"text_output": out}, done=done)

    def join_parts(self, name: str, parts: list[Any]) -> Any:
        """``text_output`` [1]: the words of the parts joined with single spaces."""
        words = [_text(part.reshape(-1)[0]) for part in parts]
        return np.array([" ".join(words)], dtype=object)


def _absorb(batch: Batch, words: list[list[str]], wanted: list[int], made: list[int]) -> None:
    """Add the rows of ``batch`` (after those already there): each row's words, how many it
    wants, none made yet."""
    texts = batch["text_input"].reshape(-1)
    added = [_words(text) or ["?"] for text in texts]  # warm-up: any text
    limits = batch.get("max_tokens")
    words.extend(added)
    if limits is not None:
        wanted.extend(max(1, int(n)) for n in limits.reshape(-1).tolist())
    else:
        wanted.extend(len(w) for w in added)
    made.extend(0 for _ in added)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _words(value: Any) -> list[str]:
    return _text(value).split()
