"""Stand-ins for the models NVIDIA's Triton client examples call, as asyncinfer factory models.

``bench/triton_examples.py`` starts a worker with ``ASYNCINFER_MODEL_FACTORIES`` naming each
class below (``simple=triton_examples_models:Simple``, with this folder on ``PYTHONPATH``), so the
examples (tritonclient's ``src/python/examples`` and the python backend's
``examples/decoupled``) run unchanged against the gateway. Each stand-in has the name, input and
output names, datatypes and row shapes of the Triton model it replaces (Triton's example model
repository, ``docs/examples/model_repository``, and the decoupled examples' ``*_config.pbtxt``) and
computes what the examples check. The image models are small deterministic classifiers, not
DenseNet or Inception: the examples check the shape of the answer, not the class.

Where the Triton model relies on something asyncinfer does not serve yet, the stand-in is the
closest model that can be declared today, so the example runs and fails for that reason, not for a
missing model:

- ``simple_sequence`` / ``simple_dyna_sequence`` / ``simple_string_dyna_sequence``: stateful
  models (``sequence_batching``, Triton's configs' control inputs): the worker's sequence batcher
  gives them START, END, READY and CORRID; ``simple_string_dyna_sequence`` keeps each sequence's
  running sum as its implicit state.
- ``repeat_int32``: ``max_batch_size: 0`` in Triton (``IN [n]``, ``DELAY [n]`` beside ``WAIT [1]``);
  here every input's first dimension is its rows, so a request whose inputs differ in it is refused
  by :meth:`RepeatInt32.validate`, naming the feature.
- ``square_int32``: a request with ``IN = 0`` finishes with no response (Triton sends only the
  empty final flag).
- the image models: Triton's configs give ``format`` (NCHW / NHWC), which the stand-ins declare
  on their input as Triton's do, and ``label_filename``; classification is not served yet, so the
  labels below are what a classification extension would answer with
  (:attr:`ImageClassifier.labels`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from asyncinfer.config.model_options import ModelOptions
from asyncinfer.errors import InvalidRequest
from asyncinfer.models.base import Batch, InputSpec, Model, OutputSpec, StreamRows, StreamStep
from asyncinfer.models.sequence import SequenceBatching, SequenceState
from asyncinfer.wire.protocol import Request

__all__ = ["Simple", "SimpleInt8", "SimpleString", "SimpleIdentity", "CustomIdentityInt32",
           "SimpleSequence", "SimpleDynaSequence", "SimpleStringDynaSequence", "RepeatInt32",
           "SquareInt32", "DensenetOnnx", "InceptionGraphdef", "FACTORIES"]

#: Triton's example models batch up to 8 rows (``max_batch_size: 8``); no warm-up: the stand-ins
#: are cheap, and a warm-up's zeros or "warm up" strings are not inputs every one of them takes.
_OPTIONS = ModelOptions(max_batch_size=8, warmup=False)


def _np(value: Any) -> np.ndarray:
    """A batch value (torch tensor or numpy array) as a numpy array on the host."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


class Simple(Model):
    """Triton's ``simple``: INT32 INPUT0, INPUT1 [n, 16] → OUTPUT0 = sum, OUTPUT1 = difference."""

    name = "simple"
    platform = "onnxruntime_onnx"
    inputs = {"INPUT0": InputSpec(("INT32",), (16,)), "INPUT1": InputSpec(("INT32",), (16,))}
    outputs = {"OUTPUT0": OutputSpec("INT32", (16,)), "OUTPUT1": OutputSpec("INT32", (16,))}
    options = _OPTIONS

    def forward(self, batch: Batch) -> Batch:
        a, b = batch["INPUT0"], batch["INPUT1"]
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}


class SimpleInt8(Simple):
    """Triton's ``simple_int8``: ``simple`` in INT8 (wrapping as the graph's int8 ops do)."""

    name = "simple_int8"
    inputs = {"INPUT0": InputSpec(("INT8",), (16,)), "INPUT1": InputSpec(("INT8",), (16,))}
    outputs = {"OUTPUT0": OutputSpec("INT8", (16,)), "OUTPUT1": OutputSpec("INT8", (16,))}


class SimpleString(Model):
    """Triton's ``simple_string``: BYTES INPUT0, INPUT1 [n, 16] holding decimal integers →
    BYTES OUTPUT0 (their sum) and OUTPUT1 (their difference), as decimal strings."""

    name = "simple_string"
    platform = "tensorflow_graphdef"
    inputs = {"INPUT0": InputSpec(("BYTES",), (16,)), "INPUT1": InputSpec(("BYTES",), (16,))}
    outputs = {"OUTPUT0": OutputSpec("BYTES", (16,)), "OUTPUT1": OutputSpec("BYTES", (16,))}
    options = _OPTIONS

    def validate(self, request: Request) -> None:
        super().validate(request)
        for t in request.inputs:
            for value in _np(t.value).reshape(-1):
                try:
                    int(_text(value))
                except ValueError:
                    raise InvalidRequest(
                        f"request {request.id}: input '{t.name}': {value!r} is not a decimal "
                        f"integer (model '{self.name}' adds and subtracts them)") from None

    def forward(self, batch: Batch) -> Batch:
        a = np.vectorize(lambda v: int(_text(v)), otypes=[np.int64])(_np(batch["INPUT0"]))
        b = np.vectorize(lambda v: int(_text(v)), otypes=[np.int64])(_np(batch["INPUT1"]))
        encode = np.vectorize(lambda v: str(v).encode(), otypes=[object])
        return {"OUTPUT0": encode(a + b), "OUTPUT1": encode(a - b)}


class SimpleIdentity(Model):
    """Triton's ``simple_identity``: BYTES INPUT0 [n, any] → OUTPUT0, unchanged."""

    name = "simple_identity"
    platform = "tensorflow_savedmodel"
    inputs = {"INPUT0": InputSpec(("BYTES",), (-1,))}
    outputs = {"OUTPUT0": OutputSpec("BYTES", (-1,))}
    options = _OPTIONS

    def forward(self, batch: Batch) -> Batch:
        return {"OUTPUT0": batch["INPUT0"]}


class CustomIdentityInt32(Model):
    """Triton's QA model ``custom_identity_int32`` (memory_growth_test.py): INT32 INPUT0
    [n, any] → OUTPUT0, unchanged."""

    name = "custom_identity_int32"
    platform = "custom"
    inputs = {"INPUT0": InputSpec(("INT32",), (-1,))}
    outputs = {"OUTPUT0": OutputSpec("INT32", (-1,))}
    options = _OPTIONS

    def forward(self, batch: Batch) -> Batch:
        return {"OUTPUT0": batch["INPUT0"]}


def _control(batch: Batch, name: str, rows: int) -> list[int]:
    """Control input ``name`` of a sequence model (Triton's CONTROL_SEQUENCE_*), one integer per
    row (a string correlation id as the integer it spells)."""
    return [int(_text(v)) if isinstance(v, (bytes, bytearray, str)) else int(v)
            for v in _np(batch[name]).reshape(rows, -1)[:, 0]]


class SimpleSequence(Model):
    """Triton's ``simple_sequence`` (its example repository: controls START and READY, int32):
    INT32 INPUT [n, 1] → OUTPUT [n, 1] = INPUT + START — what the examples check: the first
    request of a sequence answers its input plus one, every later one its input."""

    name = "simple_sequence"
    platform = "onnxruntime_onnx"
    inputs = {"INPUT": InputSpec(("INT32",), (1,))}
    outputs = {"OUTPUT": OutputSpec("INT32", (1,))}
    options = _OPTIONS
    sequence_batching = SequenceBatching(start="START", ready="READY")

    def forward(self, batch: Batch) -> Batch:
        value = _np(batch["INPUT"]).astype(np.int64).reshape(-1)
        rows = value.shape[0]
        start = _control(batch, "START", rows)
        out = [int(value[r]) + (1 if start[r] else 0) for r in range(rows)]
        return {"OUTPUT": np.array(out, np.int32).reshape(rows, 1)}


class SimpleDynaSequence(Model):
    """Triton's ``simple_dyna_sequence`` (controls START, END, READY, CORRID uint64; Oldest):
    OUTPUT = INPUT + START, plus the correlation id on the request that ENDs its sequence."""

    name = "simple_dyna_sequence"
    platform = "onnxruntime_onnx"
    inputs = {"INPUT": InputSpec(("INT32",), (1,))}
    outputs = {"OUTPUT": OutputSpec("INT32", (1,))}
    options = _OPTIONS
    sequence_batching = SequenceBatching(start="START", end="END", ready="READY",
                                         corrid="CORRID", idle_timeout_s=10.0)

    def forward(self, batch: Batch) -> Batch:
        value = _np(batch["INPUT"]).astype(np.int64).reshape(-1)
        rows = value.shape[0]
        start, end = _control(batch, "START", rows), _control(batch, "END", rows)
        corrid = _control(batch, "CORRID", rows)
        out = [int(value[r]) + (1 if start[r] else 0) + (corrid[r] if end[r] else 0)
               for r in range(rows)]
        return {"OUTPUT": np.array(out, np.int32).reshape(rows, 1)}


class SimpleStringDynaSequence(Model):
    """``simple_string_dyna_sequence`` (the sequence examples' ``-d``, string correlation ids,
    CORRID TYPE_STRING): an accumulator — each request adds its INPUT to its sequence's running
    sum (the implicit state ``SUM``; zero at START) and answers the sum, plus the correlation id
    (the integer it spells) on the request that ENDs it."""

    name = "simple_string_dyna_sequence"
    platform = "custom"
    inputs = {"INPUT": InputSpec(("INT32",), (1,))}
    outputs = {"OUTPUT": OutputSpec("INT32", (1,))}
    options = _OPTIONS
    sequence_batching = SequenceBatching(
        start="START", end="END", ready="READY", corrid="CORRID", corrid_datatype="BYTES",
        state=SequenceState("SUM", "SUM_OUT", (1,), "INT64"), idle_timeout_s=10.0)

    def forward(self, batch: Batch) -> Batch:
        total = batch["SUM"] + torch.as_tensor(_np(batch["INPUT"]), dtype=torch.int64)
        rows = total.shape[0]
        end, corrid = _control(batch, "END", rows), _control(batch, "CORRID", rows)
        bonus = torch.tensor([c if e else 0 for c, e in zip(corrid, end, strict=True)],
                             dtype=torch.int64).reshape(rows, 1)
        return {"OUTPUT": (total + bonus).to(torch.int32), "SUM_OUT": total}


class RepeatInt32(Model):
    """The python backend's decoupled ``repeat_int32`` (``max_batch_size: 0``): INT32 IN [n],
    UINT32 DELAY [n] and WAIT [1] → one response per element of IN, OUT [1] = IN[i] and
    IDX [1] = i, DELAY[i] ms apart, then WAIT ms before the request ends. No batch dimension
    (``batch_dimension = False``): each request runs whole, its inputs as sent."""

    name = "repeat_int32"
    platform = "python"
    decoupled = True
    batch_dimension = False
    inputs = {"IN": InputSpec(("INT32",), (-1,)), "DELAY": InputSpec(("UINT32",), (-1,)),
              "WAIT": InputSpec(("UINT32",), (1,))}
    outputs = {"OUT": OutputSpec("INT32", (1,)), "IDX": OutputSpec("UINT32", (1,))}
    options = ModelOptions(warmup=False)
    #: Longest DELAY / WAIT honoured, in ms (the examples ask for up to 1000 each).
    max_sleep_ms = 1000

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        values = _np(batch["IN"]).reshape(-1)
        delays = _np(batch["DELAY"]).reshape(-1)
        wait = int(_np(batch["WAIT"]).reshape(-1)[0])
        for i, value in enumerate(values):
            if not rows.is_live(0):
                return
            time.sleep(min(int(delays[i]), self.max_sleep_ms) / 1000)
            last = i == len(values) - 1
            if last:
                time.sleep(min(wait, self.max_sleep_ms) / 1000)
            yield StreamStep(rows=[0], outputs={"OUT": np.array([value], np.int32),
                                                "IDX": np.array([i], np.uint32)},
                             done=[0] if last else [])


class SquareInt32(Model):
    """The python backend's decoupled ``square_int32``: INT32 IN [1] → IN responses, each OUT [1]
    = IN; IN = 0 ends the request with no response (Triton sends only the final flag)."""

    name = "square_int32"
    platform = "python"
    decoupled = True
    inputs = {"IN": InputSpec(("INT32",), ())}
    outputs = {"OUT": OutputSpec("INT32", ())}
    options = ModelOptions(max_batch_size=8, warmup=False)

    def stream(self, batch: Batch, rows: StreamRows) -> Iterator[StreamStep]:
        counts = [int(v) for v in _np(batch["IN"]).reshape(-1)]
        made = [0] * len(counts)
        while True:
            live = rows.live()
            if not live:
                return
            produced = [r for r in live if made[r] < counts[r]]
            for r in produced:
                made[r] += 1
            done = [r for r in live if made[r] >= counts[r]]
            yield StreamStep(rows=produced,
                             outputs={"OUT": np.array([counts[r] for r in produced], np.int32)},
                             done=done)


class ImageClassifier(Model):
    """A small deterministic image classifier standing in for Triton's example image models:
    FP32 images → FP32 scores (a softmax over :attr:`classes`) from the mean of each channel
    through a fixed random projection. ``labels`` are what classification would name."""

    input_name = ""
    output_name = ""
    #: NHWC (True) or NCHW (False): Triton's input ``format``.
    channels_last = False
    classes = 0

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.projection = torch.randn(3, self.classes, generator=gen)
        self.labels = [f"{self.name.upper()}_CLASS_{i}" for i in range(self.classes)]

    def forward(self, batch: Batch) -> Batch:
        images = batch[self.input_name].float()
        if not self.batch_dimension:  # one image, as sent
            images = images.unsqueeze(0)
        dims = (1, 2) if self.channels_last else (2, 3)
        means = images.mean(dim=dims)  # [n, 3]
        scores = torch.softmax(means @ self.projection, dim=1)
        return {self.output_name: scores if self.batch_dimension else scores[0]}


class DensenetOnnx(ImageClassifier):
    """``densenet_onnx``: FP32 data_0 [n, 3, 224, 224] (NCHW) → FP32 fc6_1 [n, 1000], labels
    densenet_labels.txt. Triton's example config has ``max_batch_size: 0`` (data_0 [3, 224,
    224], what grpc_client.py sends; image_client.py reads the config and sends the same): no
    batch dimension here either."""

    name = "densenet_onnx"
    platform = "onnxruntime_onnx"
    batch_dimension = False
    input_name, output_name = "data_0", "fc6_1"
    channels_last, classes = False, 1000
    inputs = {"data_0": InputSpec(("FP32",), (3, 224, 224), format="NCHW")}
    outputs = {"fc6_1": OutputSpec("FP32", (1000,), tuple(f"DENSENET_ONNX_CLASS_{i}"
                                                          for i in range(1000)))}
    options = ModelOptions(warmup=False)


class InceptionGraphdef(ImageClassifier):
    """``inception_graphdef``: FP32 input [n, 299, 299, 3] (NHWC) → FP32
    InceptionV3/Predictions/Softmax [n, 1001] (Triton's config: max_batch_size 128, labels
    inception_labels.txt; 8 here, a CPU stand-in)."""

    name = "inception_graphdef"
    platform = "tensorflow_graphdef"
    input_name, output_name = "input", "InceptionV3/Predictions/Softmax"
    channels_last, classes = True, 1001
    inputs = {"input": InputSpec(("FP32",), (299, 299, 3), format="NHWC")}
    outputs = {"InceptionV3/Predictions/Softmax": OutputSpec(
        "FP32", (1001,), tuple(f"INCEPTION_GRAPHDEF_CLASS_{i}" for i in range(1001)))}
    options = _OPTIONS


#: name → class, for ``ASYNCINFER_MODEL_FACTORIES`` (``name=triton_examples_models:Class``).
FACTORIES: dict[str, type[Model]] = {cls.name: cls for cls in (
    Simple, SimpleInt8, SimpleString, SimpleIdentity, CustomIdentityInt32, SimpleSequence,
    SimpleDynaSequence, SimpleStringDynaSequence, RepeatInt32, SquareInt32, DensenetOnnx,
    InceptionGraphdef)}
