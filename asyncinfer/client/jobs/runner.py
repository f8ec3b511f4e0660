"""A job: every row of a file through a model, the answers written beside the rows in a file of
the same order, resumable under its ID (``asyncinfer job run``, ``Client.run_job``).

Row ``i`` of job ``J`` is request ``J-i``. The rows go out through the client's window
(client/jobs/windowed.py: at most ``window`` unanswered, memory bounded by it, not by the file), and
come back in order into parts of the output (client/jobs/output_parts.py), each written whole once it
holds ``part_rows`` rows or ``part_every_s`` has passed. A job started again under its ID goes on
from the first row no part holds; the rows that were on their way are sent again under the same
IDs, which the broker answers from the request already sent (its stored result, or its answer
when it comes: a submit of an ID already sent is that request, not a second one). So each row is
in the output once, in order, and a row is run twice only when its first request was lost.

A row that fails (its columns cannot be read as the model's inputs, the model refuses or fails
it) is written with ``status`` ``error`` and the reason in ``error``; the job goes on. The job's
record in Redis (client/jobs/record.py) holds its counts for ``asyncinfer job status`` and its state for
``asyncinfer job cancel``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from asyncinfer.client.jobs import output_parts, record
from asyncinfer.client.jobs.row_inputs import declared, input_columns, inputs_of_row
from asyncinfer.client.jobs.tables import BadRow, Table, format_of, open_table
from asyncinfer.client.jobs.windowed import DEFAULT_WINDOW, Answering, windowed
from asyncinfer.store.places import Place, place_of

__all__ = ["JobCancelled", "JobResult", "PART_ROWS", "PART_EVERY_S", "revoke_rows", "run_job"]

#: Rows in a part of the output (at most): what a producer killed can lose and send again.
PART_ROWS = 1024
#: A part is written at least this often while rows come back (a slow model's job resumes close
#: to where it was).
PART_EVERY_S = 5.0
#: How often the job's counts are written to its record between parts.
_PROGRESS_EVERY_S = 1.0

_JOB_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")
_STATUS_COLUMNS = ("status", "error")


class JobCancelled(Exception):
    """The job was cancelled (``asyncinfer job cancel``) while it ran."""


@dataclass(frozen=True)
class JobResult:
    """What a job did: its rows, those answered and failed (over all its runs), this run's rows
    and seconds, and its output."""

    job_id: str
    output: str
    rows: int
    answered: int
    failed: int
    resumed_at: int
    run_rows: int
    run_s: float


class _Row(Answering):
    """One row on its way (``number``: its index), with the input's columns it keeps."""

    def __init__(self, number: int, kept: dict[str, Any], **rest: Any) -> None:
        super().__init__(number, **rest)
        self.kept = kept


def run_job(client: Any, model: str, input_path: str | os.PathLike[str],
            output_path: str | os.PathLike[str], *, job_id: str | None = None,
            mapping: Mapping[str, str] | None = None, window: int = DEFAULT_WINDOW,
            part_rows: int = PART_ROWS, part_every_s: float = PART_EVERY_S,
            timeout_s: float | None = None, progress: bool | None = None,
            announce: Callable[[str], None] | None = None,
            storage_options: dict[str, Any] | None = None) -> JobResult:
    """Run (or resume) job ``job_id`` (default: a new ID, said through ``announce``): each row of
    ``input_path`` through ``model``, written to ``output_path`` in the same order with its
    input's columns, the model's outputs (one named like an input column as ``<name>_output``),
    ``status`` and ``error``. See the module's text. Either may be an fsspec URL (``s3://…``:
    the output and its parts go straight to the store; ``storage_options``: fsspec's, default the
    tensor store's, ``ASYNCINFER_TENSOR_STORE_OPTIONS``, for a URL of the store's kind).

    Raises ValueError (naming the file, column or input) for what cannot start, JobCancelled when
    the job is cancelled while it runs, and BrokerUnavailable when the broker goes: start it again
    with the same ``job_id`` to go on."""
    table = open_table(place_of(input_path, _options(client, input_path, storage_options)))
    output = place_of(output_path, _options(client, output_path, storage_options))
    kind = format_of(output, output=True)
    if job_id is None:
        job_id = uuid.uuid4().hex[:16]
    elif not _JOB_ID.match(job_id):
        raise ValueError(f"job ID {job_id!r}: 1 to 100 letters, digits and _.:- only")
    client.check_model(model)
    inputs = declared(client, model, "inputs")
    feeds = input_columns(model, inputs, table.columns, mapping)
    kept = [c for c in table.columns if c != "array"]  # a .npy file's array: not copied out
    _refuse_clashes(kept)
    redis = client.app_for(model).backend.client
    job = record.JobRecord(job_id, model, table.path.url, output.url,
                           dict(sorted(feeds.items())), table.rows)
    folder = output_parts.parts_folder(output)
    if output.exists() and not folder.exists():
        done = _completed(redis, job)
        if done is not None:  # the same job, run to its end before: nothing to do again
            if announce is not None:
                announce(f"job {job_id}: completed before ({done.rows:,} rows, {done.failed:,} "
                         f"failed) -> {output.url}")
            return JobResult(job_id, output.url, done.rows, done.answered, done.failed,
                             done.rows, 0, 0.0)
        raise ValueError(f"job {job_id}: its output {output.url!r} exists; remove it or name "
                         f"another")
    written, failed_written = output_parts.committed_rows(folder, kind)
    record.begin(redis, job, written, failed_written)
    if announce is not None:
        announce(f"job {job_id}: {table.rows:,} rows of {table.path.name} through {model} -> "
                 f"{output.url}" + (f", from row {written:,}" if written else "")
                 + f"; resume with --job-id {job_id}")
    run = _Run(client, redis, job, table, kind, folder, written, failed_written, feeds, inputs,
               kept, part_rows, part_every_s, timeout_s)
    began_s = time.monotonic()
    try:
        run.go(window, progress)
    except JobCancelled:
        run.revoke_unwritten()
        raise
    except KeyboardInterrupt:
        record.finish(redis, job_id, "stopped", f"interrupted; resume with --job-id {job_id}")
        raise
    except BaseException as exc:
        try:
            record.finish(redis, job_id, "failed", f"{type(exc).__name__}: {exc}; resume with "
                                                   f"--job-id {job_id}")
        except Exception:  # noqa: BLE001 - the broker may be what failed: the error is what counts
            pass
        raise
    output_parts.assemble(folder, kind, output)
    record.finish(redis, job_id, "completed")
    return JobResult(job_id, output.url, table.rows, table.rows - run.failed, run.failed, written,
                     table.rows - written, time.monotonic() - began_s)


def _completed(redis: Any, job: record.JobRecord) -> record.JobStatus | None:
    """The status of ``job`` when it is this very job (model, files, mapping), run to its end."""
    try:
        found = record.read(redis, job.job_id)
    except KeyError:
        return None
    mine = job.fields()
    same = (found.model, found.input, found.output) == (mine["model"], mine["input"], mine["output"])
    return found if same and found.state == "completed" else None


def _options(client: Any, where: str | os.PathLike[str],
             given: dict[str, Any] | None) -> dict[str, Any] | None:
    """fsspec's options for ``where``: those given, else the tensor store's for a URL of its kind."""
    if given is not None:
        return given
    settings = getattr(client, "settings", None)
    text = os.fspath(where)
    if "://" not in text or settings is None or not settings.tensor_store_options:
        return None
    if settings.tensor_store_url.startswith(text.split("://", 1)[0] + "://"):
        return dict(json.loads(settings.tensor_store_options))
    return None


def _refuse_clashes(kept: list[str]) -> None:
    clash = [c for c in _STATUS_COLUMNS if c in kept]
    if clash:
        raise ValueError(f"job: the input has column(s) {', '.join(map(repr, clash))}, which a job "
                         f"writes itself (each row's status and error); rename them in the input")


def output_column(name: str, kept: list[str]) -> str:
    """The column output ``name`` is written under: its name, or ``<name>_output`` where the
    input has a column of that name (kept beside it)."""
    return f"{name}_output" if name in kept else name


class _Run:
    """One run of a job: sends its rows, writes its parts, keeps its record."""

    def __init__(self, client: Any, redis: Any, job: record.JobRecord, table: Table, kind: str,
                 folder: Place, written: int, failed_written: int, feeds: dict[str, str],
                 inputs: dict[str, str], kept: list[str], part_rows: int, part_every_s: float,
                 timeout_s: float | None) -> None:
        self.client, self.redis, self.job, self.table = client, redis, job, table
        self.kind, self.folder, self.feeds, self.inputs, self.kept = kind, folder, feeds, inputs, kept
        self.written = written
        self.failed = failed_written  # over the rows answered so far (written or buffered)
        self.failed_written = failed_written
        self.sent = written
        self.part_rows, self.part_every_s, self.timeout_s = part_rows, part_every_s, timeout_s
        self.buffer: list[dict[str, Any]] = []

    def go(self, window: int, progress: bool | None) -> None:
        show = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(total=self.table.rows, initial=self.written, desc=self.job.model, unit="row",
                   disable=not show, file=sys.stderr, dynamic_ncols=True)
        sender = self.client.sender_for(self.job.model)

        def forget(row: _Row) -> None:
            if row.future is not None:  # watched on its shard's sender (a spread cluster URL)
                sender.lane(row.future.id).watcher.unwatch(row.future.id, row.future._settle)

        rows = windowed(self._send, self._numbered(), window=window, timeout_s=None, forget=forget)
        part_at = reported_at = time.monotonic()
        try:
            for row in rows:
                self.buffer.append(self._answered(row))
                bar.update(1)
                now = time.monotonic()
                if len(self.buffer) >= self.part_rows or now - part_at >= self.part_every_s:
                    self._write_part()
                    part_at = now
                if now - reported_at >= _PROGRESS_EVERY_S or not self.buffer:
                    reported_at = now
                    if self._report() == "cancelled":
                        raise JobCancelled(f"job {self.job.job_id}: cancelled at row "
                                           f"{self.written:,} of {self.table.rows:,}")
                    if self.failed:
                        bar.set_postfix(failed=self.failed, refresh=False)
            if self.buffer:
                self._write_part()
            self._report()
        finally:
            # the rows still on their way are forgotten (not revoked: the job resumes)
            rows.close()  # type: ignore[attr-defined]  # a generator
            bar.close()

    def _numbered(self) -> Iterator[tuple[int, dict[str, Any] | BadRow]]:
        return enumerate(self.table.read(self.written), start=self.written)

    def _send(self, numbered: tuple[int, dict[str, Any] | BadRow]) -> _Row:
        from asyncinfer.errors import InvalidRequest, ModelError

        index, row = numbered
        self.sent = index + 1
        if isinstance(row, BadRow):
            return _Row(index, {}, error=f"InvalidRequest: {row.reason}; nothing sent")
        kept = {c: row.get(c) for c in self.kept}
        request_id = f"{self.job.job_id}-{index}"
        try:
            inputs = inputs_of_row(row, self.feeds, self.inputs)
        except ValueError as exc:
            return _Row(index, kept, error=f"InvalidRequest: request {request_id}: {exc}; "
                                           f"nothing sent")
        try:
            # msgpack: raw bytes both ways (no list of numbers to write or read a row)
            future = self.client.submit(self.job.model, inputs, request_id=request_id,
                                        serializer="msgpack")
        except (InvalidRequest, ModelError) as exc:  # refused at once: this row's error
            return _Row(index, kept, error=f"{type(exc).__name__}: {exc}")
        return _Row(index, kept, future=future, timeout_s=self.timeout_s)

    def _answered(self, row: _Row) -> dict[str, Any]:
        out = dict(row.kept)
        if row.error is not None:
            self.failed += 1
            out.update(status="error", error=row.error)
            return out
        for name in row.response.outputs:
            value = row.response.as_numpy(name)
            out[output_column(name, self.kept)] = value[0] if value.ndim and value.shape[0] == 1 \
                else value
        out.update(status="ok", error=None)
        return out

    def _write_part(self) -> None:
        output_parts.write_part(self.folder, self.kind, self.written, self.buffer,
                                self.failed - self.failed_written)
        self.written += len(self.buffer)
        self.failed_written = self.failed
        self.buffer = []

    def revoke_unwritten(self) -> None:
        """Revoke the rows sent and not written (a cancelled job's: those queued never run)."""
        revoke_rows(self.client.app_for(self.job.model), self.job.job_id, self.written, self.sent)

    def _report(self) -> str:
        return record.progress(self.redis, self.job.job_id, written=self.written,
                               failed_written=self.failed_written,
                               answered=self.written + len(self.buffer), failed=self.failed,
                               sent=self.sent)


def revoke_rows(app: Any, job_id: str, first: int, end: int) -> int:
    """Revoke the requests of rows ``first`` to ``end`` (not included) of job ``job_id``; returns
    how many."""
    ids = [f"{job_id}-{index}" for index in range(first, end)]
    for at in range(0, len(ids), 1000):
        app.control.revoke(ids[at:at + 1000])
    return len(ids)
