"""Which column feeds which input of the model, and a row's values as the model's inputs.

By name: each input the model declares is read from the column of its name. ``mapping``
(``--map INPUT=COLUMN``) names others. A model of one input fed from a table of one column (a
folder of ``.npy`` files: its ``array``) needs neither. A row's value becomes a batch of one
row of the input's declared datatype (a CSV cell, text, is read as JSON for a numeric input: a
number or a list of them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from asyncinfer.wire.datatypes import SPECS

__all__ = ["declared", "input_columns", "inputs_of_row"]


def declared(client: Any, model: str, kind: str = "inputs") -> dict[str, str]:
    """Name → datatype of ``model``'s ``inputs`` (or ``outputs``) as its workers announced them
    in the catalogue (empty when it announced none, or the broker cannot be read: the submit
    then says so in its own words)."""
    from asyncinfer.errors import BrokerUnavailable

    try:
        entry = client.models().get(model)
    except BrokerUnavailable:
        return {}
    if entry is None:
        return {}
    return {str(t["name"]): str(t["datatype"]) for t in entry.metadata.get(kind) or []}


def input_columns(model: str, declared: Mapping[str, str], columns: Sequence[str],
                  mapping: Mapping[str, str] | None = None) -> dict[str, str]:
    """Input name → the column that feeds it (ValueError naming what cannot be matched)."""
    mapping = dict(mapping or {})
    for name, column in mapping.items():
        if declared and name not in declared:
            raise ValueError(f"job: --map {name}={column}: model {model!r} has no input {name!r} "
                             f"(its inputs: {', '.join(declared)})")
        if column not in columns:
            raise ValueError(f"job: --map {name}={column}: the input has no column {column!r} "
                             f"(its columns: {', '.join(columns)})")
    names = list(declared) or list(mapping) or ["input"]
    data_columns = [c for c in columns if c != "file"]
    found: dict[str, str] = {}
    for name in names:
        if name in mapping:
            found[name] = mapping[name]
        elif name in columns:
            found[name] = name
        elif len(names) == 1 and len(data_columns) == 1:
            found[name] = data_columns[0]  # one input, one column: whatever their names
        else:
            raise ValueError(f"job: model {model!r} input {name!r}: no column of that name (the "
                             f"input's columns: {', '.join(columns)}); name one with --map "
                             f"{name}=COLUMN")
    return found


def inputs_of_row(row: Mapping[str, Any], feeds: Mapping[str, str],
                  declared: Mapping[str, str]) -> dict[str, Any]:
    """The request's inputs for one row (ValueError naming the column and what is wrong)."""
    inputs: dict[str, Any] = {}
    for name, column in feeds.items():
        value = row.get(column)
        if value is None:
            raise ValueError(f"column {column!r} (input {name!r}) is empty in this row")
        inputs[name] = _one_row(name, column, value, declared.get(name))
    return inputs


def _one_row(name: str, column: str, value: Any, datatype: str | None) -> Any:
    spec = SPECS.get(datatype or "")
    if spec is None:  # not declared: the client infers the datatype from the value
        return value[np.newaxis] if isinstance(value, np.ndarray) else [value]
    if spec.name == "BYTES":
        return np.array([value], dtype=object) if isinstance(value, (str, bytes)) else \
            np.asarray(value, dtype=object)[np.newaxis]
    if isinstance(value, str):  # a CSV cell: a number or a JSON list of them
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"column {column!r} (input {name!r}, {spec.name}): {value[:40]!r} is "
                             f"not a number or a JSON list of numbers") from None
    try:
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise ValueError(f"values of kind {array.dtype}")
        return array.astype(spec.dtype, copy=False)[np.newaxis]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"column {column!r} (input {name!r}, {spec.name}): not numeric "
                         f"({exc})") from None
