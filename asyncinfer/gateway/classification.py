"""Triton's classification extension: an output asked for with ``classification: k`` comes back
as the top ``k`` classes of each row instead of the tensor.

The answer is a BYTES tensor of shape ``[batch, k]`` (``[k]`` for a model that does not batch:
its whole tensor is one row), each element ``"<value>:<index>"`` or ``"<value>:<index>:<label>"``,
highest value first, as Triton's ``TopkClassifications`` (server/src/classification.cc) writes
them: the value as C++'s ``std::to_string`` prints it (``%f`` for FP32 and FP64, an integer
otherwise), the index within the row, and the label the model declares for that index
(``OutputSpec(labels=...)``, carried in the catalogue; none for an index without one, or an empty
one). ``k`` beyond a row's size gives the whole row. Equal values keep their order (the lower index
first); NaN ranks last. Integer and floating outputs only (UINT8 … UINT64, INT8 … INT64, FP32,
FP64), as in Triton; a row of more than a million elements is refused, as Triton refuses it.

It is computed here, in the gateway, from the raw output the worker returned: only calls that
ask pay for it, the worker and its batches know nothing of it, and a cached answer
(the response cache) is classified as a computed one is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.errors import InvalidRequest
from asyncinfer.gateway.idempotency import call_label
from asyncinfer.gateway.tensors import InferCall, OutputTensor
from asyncinfer.wire.datatypes import bytes_blob

__all__ = ["CLASSIFIABLE", "MAX_ROW_ELEMENTS", "wants_classes", "check_classes", "classify_outputs",
           "top_classes", "labels_of", "batches"]

#: The datatypes an output may be classified from (Triton's), and their little-endian dtypes.
CLASSIFIABLE = {"UINT8": "<u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
                "INT8": "<i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8",
                "FP32": "<f4", "FP64": "<f8"}
#: The most elements one row may have (Triton's ``kMaxClassificationElements``).
MAX_ROW_ELEMENTS = 1_000_000


def wants_classes(call: InferCall) -> bool:
    """Whether any output of ``call`` asks for classes (cheap: the common call pays only this)."""
    return call.outputs is not None and any(o.classification for o in call.outputs)


def batches(entry: CatalogueEntry) -> bool:
    """Whether the model's tensors have a batch dimension first, as its model config says
    (``max_batch_size`` above 0): each row is then classified on its own."""
    meta = entry.metadata
    return bool(meta.get("batchable", True)) and int(meta.get("max_batch_size", 0) or 0) > 0


def labels_of(entry: CatalogueEntry, output: str) -> Sequence[str]:
    """The labels the model declares for ``output`` (index → label; empty for none)."""
    for tensor in entry.metadata.get("outputs") or []:
        if tensor.get("name") == output:
            return list(tensor.get("labels") or [])
    return []


def check_classes(call: InferCall, entry: CatalogueEntry) -> None:
    """Refuse, before anything is sent, classes asked of an output whose declared datatype has
    none (an undeclared output is checked when its answer comes).

    Raises:
        InvalidRequest: naming the output and its datatype.
    """
    if not wants_classes(call):
        return
    declared = {t.get("name"): t.get("datatype") for t in entry.metadata.get("outputs") or []}
    for output in call.outputs or []:
        datatype = declared.get(output.name)
        if output.classification and datatype is not None and datatype not in CLASSIFIABLE:
            raise _unsupported(f"{call_label(call.id)}: output '{output.name}'", str(datatype))


def classify_outputs(call: InferCall, entry: CatalogueEntry,
                     outputs: list[OutputTensor]) -> list[OutputTensor]:
    """``outputs`` with each one ``call`` asks classes of replaced by its top classes.

    Raises:
        InvalidRequest: an output whose datatype has no classes, or a row too large.
    """
    wanted: Mapping[str, int] = {o.name: o.classification for o in call.outputs or []
                                 if o.classification}
    if not wanted:
        return outputs
    batched = batches(entry)
    return [top_classes(f"{call_label(call.id)}: output '{t.name}'", t, wanted[t.name],
                        batched=batched, labels=labels_of(entry, t.name))
            if t.name in wanted else t for t in outputs]


def top_classes(at: str, tensor: OutputTensor, count: int, *, batched: bool,
                labels: Sequence[str] = ()) -> OutputTensor:
    """The top ``count`` classes of each row of ``tensor`` as Triton's classification output.

    Raises:
        InvalidRequest: a datatype that has no classes, or a row of more than
            ``MAX_ROW_ELEMENTS`` elements.
    """
    dtype = CLASSIFIABLE.get(tensor.datatype)
    if dtype is None:
        raise _unsupported(at, tensor.datatype)
    shape = list(tensor.shape)
    rows = shape[0] if batched and shape else None
    width = math.prod(shape[1:] if rows is not None else shape)
    if width > MAX_ROW_ELEMENTS:
        raise InvalidRequest(f"{at}: classification output tensor too large ({width} elements a "
                             f"row; at most {MAX_ROW_ELEMENTS})")
    k = min(count, width)
    values = np.frombuffer(tensor.raw, dtype=np.dtype(dtype)).reshape(
        rows if rows is not None else 1, width)
    order = _descending(values)[:, :k]
    as_text = _float_text if values.dtype.kind == "f" else _int_text
    strings = []
    for row, indices in zip(np.take_along_axis(values, order, axis=1).tolist(), order.tolist(),
                            strict=True):
        for value, i in zip(row, indices, strict=True):
            label = labels[i] if i < len(labels) else ""
            strings.append(f"{as_text(value)}:{i}:{label}" if label else f"{as_text(value)}:{i}")
    return OutputTensor(tensor.name, "BYTES", [rows, k] if rows is not None else [k],
                        bytes_blob(strings))


def _descending(values: np.ndarray) -> np.ndarray:
    """Each row's indices, highest value first; equal values in index order, NaN last."""
    if values.dtype.kind == "f" and np.isnan(values).any():
        values = np.where(np.isnan(values), -np.inf, values)
    width = values.shape[1]
    # a stable ascending sort of the reversed row, reversed: descending, ties by index
    return width - 1 - np.argsort(values[:, ::-1], axis=1, kind="stable")[:, ::-1]


def _float_text(value: Any) -> str:
    """A float as ``std::to_string`` prints it (``%f``)."""
    return f"{value:f}"


def _int_text(value: Any) -> str:
    return str(int(value))


def _unsupported(at: str, datatype: str) -> InvalidRequest:
    return InvalidRequest(f"{at}: class result not available for output due to unsupported type "
                          f"'{datatype}' (classification takes "
                          f"{', '.join(CLASSIFIABLE)})")
