"""A job's output, written as it goes in parts that each hold a run of rows, then put together.

A part is written whole or not at all (a file of its own, written under a temporary name, synced
and renamed), named by its first row, its number of rows and how many of them failed
(``part-000000001024-001024-000003.parquet``), in a folder beside the output (``OUTPUT.parts``).
What a job has done is the run of parts from row 0 with no gap: a job started again reads it here
(:func:`committed_rows`), drops anything past a gap or half-written, and goes on from the next
row; so each row is in the output once, in order, however often the job's producer was killed.
When every row has its part, :func:`assemble` writes the output (one file, under a temporary
name, then renamed) and removes the folder.

Rows are dicts of column → value: the input's own columns, each output of the model (a number, a
text, or an array: numpy's), ``status`` (``ok`` or ``error``) and ``error`` (None, or why).
"""

from __future__ import annotations

import base64
import csv
import io
import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from asyncinfer.store.places import Place

__all__ = ["assemble", "committed_rows", "parts_folder", "write_part"]

_PART = re.compile(r"^part-(\d{12})-(\d{6,})-(\d{6,})\.(parquet|jsonl|csv)$")
_SUFFIX = {"parquet": "parquet", "jsonl": "jsonl", "csv": "csv"}


def parts_folder(output: Place) -> Place:
    """Where the parts of the job writing ``output`` are kept until it is done."""
    return output.sibling(output.name + ".parts")


def committed_rows(folder: Place, kind: str) -> tuple[int, int]:
    """Rows written in the run of parts from row 0, and how many of them failed ((0, 0): none);
    anything else in the folder (a part past a gap, one half-written under its temporary name)
    is removed."""
    parts = {}
    for place in folder.children():
        found = _PART.match(place.name)
        if found and found.group(4) == _SUFFIX[kind]:
            parts[int(found.group(1))] = (int(found.group(2)), int(found.group(3)), place)
        else:
            place.remove()
    done = failed = 0
    while done in parts:
        count, failures, _ = parts.pop(done)
        done, failed = done + count, failed + failures
    for _, _, place in parts.values():
        place.remove()
    return done, failed


def write_part(folder: Place, kind: str, start: int, rows: Sequence[dict[str, Any]],
               failed: int) -> Place:
    """Write ``rows`` (rows ``start`` on, ``failed`` of them failed) as one part, whole or not at
    all."""
    part = folder.child(f"part-{start:012d}-{len(rows):06d}-{failed:06d}.{_SUFFIX[kind]}")
    part.write_whole(_encode(kind, rows))
    return part


def assemble(folder: Place, kind: str, output: Place) -> None:
    """Write ``output`` from the parts in row order (whole or not at all: locally under a
    temporary name, then renamed; in an object store through its upload, which shows the object
    once complete) and remove the parts' folder."""
    parts = [p for p in folder.children() if _PART.match(p.name)]
    target = output.sibling(f".{output.name}.tmp") if output.local else output
    with target.open("wb") as stream:
        if kind == "parquet":
            _assemble_parquet(parts, stream)
        elif kind == "csv":
            _assemble_csv(parts, stream)
        else:
            for part in parts:
                with part.open("rb") as source:
                    shutil.copyfileobj(source, stream, 1 << 20)
        if output.local:
            stream.flush()
            os.fsync(stream.fileno())
    if output.local:
        os.replace(target.path, output.path)
    folder.remove()


def _encode(kind: str, rows: Sequence[dict[str, Any]]) -> bytes:
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([{k: _for_arrow(v) for k, v in row.items()} for row in rows])
        sink = io.BytesIO()
        pq.write_table(table, sink)
        return sink.getvalue()
    if kind == "jsonl":
        return b"".join(orjson.dumps({k: _for_json(v) for k, v in row.items()},
                                     option=orjson.OPT_SERIALIZE_NUMPY) + b"\n" for row in rows)
    text = io.StringIO()
    header = list(dict.fromkeys(k for row in rows for k in row))
    writer = csv.DictWriter(text, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: _for_csv(v) for k, v in row.items()} for row in rows)
    return text.getvalue().encode("utf-8")


def _for_arrow(value: Any) -> Any:
    """A cell as pyarrow takes it: a 1-D numeric array as it is, any other array as lists."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind == "O":
            return _texts(value.tolist())
        return value if value.ndim == 1 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _texts(value: Any) -> Any:
    """Bytes (a BYTES output's elements) as UTF-8 text where they are, nested lists kept."""
    if isinstance(value, list):
        return [_texts(v) for v in value]
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return "base64:" + base64.b64encode(value).decode("ascii")
    return value


def _for_json(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind == "O":
        return _texts(value.tolist())
    if isinstance(value, bytes):
        return _texts(value)
    if isinstance(value, np.ndarray) and value.dtype == np.float16:
        return value.astype(np.float32)  # orjson writes float16 as float32's text
    return value


def _for_csv(value: Any) -> Any:
    """A cell as CSV text: a number or a text as it is, an array as JSON, None as empty."""
    value = _for_json(value)
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode("utf-8")


def _assemble_parquet(parts: Sequence[Place], stream: Any) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schemas = []
    for part in parts:
        with part.open("rb") as source:
            schemas.append(pq.read_schema(source))
    schema = pa.unify_schemas(schemas, promote_options="permissive") if schemas else pa.schema([])
    with pq.ParquetWriter(stream, schema) as writer:
        for part in parts:
            with part.open("rb") as source:
                table = pq.read_table(source)
            columns = [table.column(f.name).cast(f.type) if f.name in table.column_names
                       else pa.nulls(table.num_rows, f.type) for f in schema]
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))


def _assemble_csv(parts: Sequence[Place], stream: Any) -> None:
    headers: dict[str, None] = {}
    for part in parts:
        with part.open("rb") as source:
            headers.update(dict.fromkeys(next(csv.reader(io.TextIOWrapper(source, "utf-8")), [])))
    out = io.TextIOWrapper(stream, "utf-8", newline="", write_through=True)
    writer = csv.DictWriter(out, fieldnames=list(headers), lineterminator="\n")
    writer.writeheader()
    for part in parts:
        with part.open("rb") as source:
            writer.writerows(csv.DictReader(io.TextIOWrapper(source, "utf-8", newline="")))
    out.flush()
    out.detach()
