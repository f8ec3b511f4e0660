"""The rows of a job's input file: Parquet, JSON Lines, CSV, or a folder of ``.npy`` files (one row
each), read from a given row on without holding the file whole.

A table says its columns and its number of rows before the first is read (Parquet's footer says
both; a JSON Lines or CSV file is counted in one pass over its lines, a folder by its names), so
that a job can show its total and resume at a row. Rows come as dicts of column → value: what
Parquet or JSON holds (text, numbers, lists), a CSV cell as its text (turned into the model's
datatype later: client/jobs/row_inputs.py), a ``.npy`` file's array under the column ``array`` beside its
name under ``file``.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncinfer.store.places import Place, place_of

__all__ = ["FORMATS", "BadRow", "Table", "format_of", "open_table"]

#: File suffix → format of a job's input or output (a folder is ``npy``: input only).
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".csv": "csv"}

#: Rows read from Parquet at a time.
_PARQUET_BATCH_ROWS = 1024


def format_of(where: Place, *, output: bool = False) -> str:
    """The format a job's file is read or written in, by its suffix (a folder: ``npy``)."""
    if not output and where.is_dir():
        return "npy"
    found = FORMATS.get(where.suffix.lower())
    if found is None:
        what = "output" if output else "input"
        folder = "" if output else ", or a folder of .npy files"
        raise ValueError(f"job {what} {where.url!r}: unknown format (its suffix {where.suffix!r}); "
                         f"a job reads and writes {', '.join(sorted(FORMATS))}{folder}")
    return found


@dataclass(frozen=True)
class BadRow:
    """A row that could not be read (a JSON Lines line that is not an object, a ``.npy`` file
    np.load refuses): the job records ``reason`` as that row's error and goes on."""

    reason: str


@dataclass(frozen=True)
class Table:
    """A job's input: its path, format, columns and number of rows."""

    path: Place
    format: str
    columns: tuple[str, ...]
    rows: int

    def read(self, start: int = 0) -> Iterator[dict[str, Any] | BadRow]:
        """Each row from row ``start`` (0-based) on, in file order (one not read: a BadRow)."""
        reader = {"parquet": _parquet_rows, "jsonl": _jsonl_rows, "csv": _csv_rows,
                  "npy": _npy_rows}[self.format]
        return reader(self.path, start)


def open_table(path: str | os.PathLike[str] | Place,
               options: dict[str, Any] | None = None) -> Table:
    """The table at ``path`` (a local path or an fsspec URL, ``options`` fsspec's), its columns and
    row count read (FileNotFoundError, ValueError naming the file and what is wrong with it)."""
    where = path if isinstance(path, Place) else place_of(path, options)
    if not where.exists():
        raise FileNotFoundError(f"job input {where.url!r}: no such file or folder")
    kind = format_of(where)
    if kind == "parquet":
        meta = _parquet(where)
        return Table(where, kind, tuple(meta.schema_arrow.names), meta.metadata.num_rows)
    if kind == "npy":
        return Table(where, kind, ("file", "array"), len(_npy_files(where)))
    if kind == "csv":
        with _text(where) as stream:
            header = next(csv.reader(stream), None)
            if not header:
                raise ValueError(f"job input {where.url!r}: a CSV file needs a header line naming "
                                 f"its columns")
            count = sum(1 for row in csv.reader(stream) if row)
        return Table(where, kind, tuple(header), count)
    columns: dict[str, None] = {}
    count = 0
    for row in _jsonl_objects(where):
        count += 1
        if count <= 100 and isinstance(row, dict):  # the first rows' columns (a row may lack one)
            columns.update(dict.fromkeys(row))
    return Table(where, kind, tuple(columns), count)


def _text(where: Place) -> io.TextIOWrapper:
    """A text file of a table, read as UTF-8 with CSV's newlines."""
    return io.TextIOWrapper(where.open("rb"), "utf-8", newline="")


def _parquet(path: Place) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"job input {path.url!r}: Parquet needs pyarrow (pip install "
                         f"'asyncinfer[jobs]')") from None
    try:
        return pq.ParquetFile(path.path if path.local else path.open("rb"))
    except Exception as exc:  # noqa: BLE001 - pyarrow's own errors: said with the file's name
        raise ValueError(f"job input {path.url!r}: not a Parquet file pyarrow reads "
                         f"({type(exc).__name__}: {exc})") from None


def _parquet_rows(path: Place, start: int) -> Iterator[dict[str, Any] | BadRow]:
    source = _parquet(path)
    skip = start
    for group in range(source.metadata.num_row_groups):  # whole row groups skipped unread
        in_group = source.metadata.row_group(group).num_rows
        if skip >= in_group:
            skip -= in_group
            continue
        for batch in source.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group]):
            if skip >= batch.num_rows:
                skip -= batch.num_rows
                continue
            if skip:
                batch, skip = batch.slice(skip), 0
            names = batch.schema.names
            for values in zip(*(_cells(column) for column in batch.columns), strict=True):
                yield dict(zip(names, values, strict=True))


def _cells(column: Any) -> Any:
    """A Parquet column's values, one a row: a list column of numbers whose rows are all of one
    length as the rows of one numpy array (no Python list a row), any other as Python values."""
    import pyarrow as pa

    kind = column.type
    if ((pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))
            and (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type))
            and column.null_count == 0 and len(column)):
        values = column.flatten()
        if values.null_count == 0 and len(values) % len(column) == 0:
            offsets = None if pa.types.is_fixed_size_list(kind) else column.offsets.to_numpy()
            width = len(values) // len(column)
            if offsets is None or bool((offsets[1:] - offsets[:-1] == width).all()):
                return values.to_numpy(zero_copy_only=False).reshape(len(column), width)
    return column.to_pylist()


def _jsonl_objects(path: Place, start: int = 0) -> Iterator[dict[str, Any] | BadRow]:
    """Each non-blank line's object from the ``start``-th on (lines before it are not parsed)."""
    with path.open("rb") as stream:
        index = 0
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            index += 1
            if index <= start:
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                yield BadRow(f"line {number} of {path.name} is not JSON ({exc})")
                continue
            if not isinstance(row, dict):
                yield BadRow(f"line {number} of {path.name} is not a JSON object of column → "
                             f"value (a {type(row).__name__})")
                continue
            yield row


def _jsonl_rows(path: Place, start: int) -> Iterator[dict[str, Any] | BadRow]:
    return _jsonl_objects(path, start)


def _csv_rows(path: Place, start: int) -> Iterator[dict[str, Any] | BadRow]:
    with _text(path) as stream:
        reader = csv.reader(stream)
        header = next(reader)
        index = 0
        for cells in reader:
            if not cells:
                continue
            if index >= start:
                yield dict(zip(header, cells, strict=False))
            index += 1


def _npy_files(folder: Place) -> list[Place]:
    return [p for p in folder.children() if p.suffix == ".npy" and not p.is_dir()]


def _npy_rows(folder: Place, start: int) -> Iterator[dict[str, Any] | BadRow]:
    import numpy as np

    for path in _npy_files(folder)[start:]:
        try:
            with path.open("rb") as stream:
                array = np.load(io.BytesIO(stream.read()), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:  # an object array: refused, never unpickled
            yield BadRow(f"{path.name}: not an array np.load reads without pickle ({exc})")
            continue
        yield {"file": path.name, "array": array}
