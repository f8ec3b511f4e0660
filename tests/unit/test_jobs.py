"""Jobs over files in process (asyncinfer/client/jobs): the tables read from a row on, the columns
that feed a model's inputs, the parts a job writes and goes on from, its record (fakeredis), and a
job run, stopped and started again against a stub client: every row once, in order. The real
thing against real workers: tests/integration/test_jobs.py, tests/faults/test_job_kills.py."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncinfer.client.jobs import record
from asyncinfer.client.jobs.output_parts import assemble, committed_rows, parts_folder, write_part
from asyncinfer.client.jobs.row_inputs import input_columns, inputs_of_row
from asyncinfer.client.jobs.runner import JobCancelled, run_job
from asyncinfer.client.jobs.tables import BadRow, open_table
from asyncinfer.errors import InvalidRequest
from asyncinfer.store.places import place_of

# -- tables ---------------------------------------------------------------------------------------


def test_each_format_says_its_columns_and_rows_and_reads_from_a_row_on(tmp_path: Path) -> None:
    rows = [{"id": i, "text": f"t{i}"} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=3)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" + ("\n" if i == 4 else "")
                                              for i, r in enumerate(rows)))
    (tmp_path / "a.csv").write_text("id,text\n" + "".join(f"{r['id']},{r['text']}\n" for r in rows))
    for name in ("a.parquet", "a.jsonl", "a.csv"):
        table = open_table(tmp_path / name)
        assert (table.columns, table.rows) == (("id", "text"), 10), name
        got = list(table.read(7))
        assert [str(r["id"]) for r in got] == ["7", "8", "9"], name  # CSV cells are text
        assert [r["text"] for r in got] == ["t7", "t8", "t9"], name
        assert len(list(table.read(0))) == 10 and list(table.read(10)) == []


def test_a_folder_of_npy_files_is_a_row_a_file_in_name_order_and_a_pickle_is_a_bad_row(
        tmp_path: Path) -> None:
    folder = tmp_path / "arrays"
    folder.mkdir()
    for i in (2, 0, 1):
        np.save(folder / f"x{i}.npy", np.full((2, 3), i, np.float32))
    np.save(folder / "x3.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    table = open_table(folder)
    assert (table.format, table.rows) == ("npy", 4)
    got = list(table.read(1))
    assert [r["file"] for r in got[:2]] == ["x1.npy", "x2.npy"]  # type: ignore[index]
    assert np.array_equal(got[0]["array"], np.full((2, 3), 1, np.float32))  # type: ignore[index]
    assert isinstance(got[2], BadRow) and "x3.npy" in got[2].reason and "pickle" in got[2].reason


def test_a_jsonl_line_that_is_no_object_is_a_bad_row_naming_its_line(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\nnot json\n[1, 2]\n{"x": 4}\n')
    table = open_table(path)
    assert table.rows == 4
    got = list(table.read())
    assert got[0] == {"x": 1} and got[3] == {"x": 4}
    assert isinstance(got[1], BadRow) and "line 2 of a.jsonl is not JSON" in got[1].reason
    assert isinstance(got[2], BadRow) and "line 3 of a.jsonl is not a JSON object" in got[2].reason


@pytest.mark.parametrize("name, words", [
    ("a.txt", "unknown format (its suffix '.txt')"),
    ("missing.parquet", "no such file"),
])
def test_an_input_that_cannot_be_read_is_named(tmp_path: Path, name: str, words: str) -> None:
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises((ValueError, FileNotFoundError), match=words.replace("(", r"\(").replace(")", r"\)")):
        open_table(tmp_path / name)


def test_a_file_that_is_not_parquet_is_named(tmp_path: Path) -> None:
    (tmp_path / "a.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="a.parquet.*not a Parquet file"):
        open_table(tmp_path / "a.parquet")

# -- which column feeds which input ---------------------------------------------------------------


def test_inputs_are_fed_by_name_by_map_or_one_by_the_one_column() -> None:
    assert input_columns("m", {"text": "BYTES"}, ["id", "text"]) == {"text": "text"}
    assert input_columns("m", {"x": "FP32"}, ["id", "v"], {"x": "v"}) == {"x": "v"}
    assert input_columns("m", {"x": "FP32"}, ["file", "array"]) == {"x": "array"}
    assert input_columns("m", {}, ["values"]) == {"input": "values"}  # undeclared: `input`
    with pytest.raises(ValueError, match="model 'm' input 'x': no column of that name.*--map x=COLUMN"):
        input_columns("m", {"x": "FP32"}, ["id", "v"])
    with pytest.raises(ValueError, match="--map y=v: model 'm' has no input 'y'"):
        input_columns("m", {"x": "FP32"}, ["v"], {"y": "v"})
    with pytest.raises(ValueError, match="--map x=w: the input has no column 'w'"):
        input_columns("m", {"x": "FP32"}, ["v"], {"x": "w"})


def test_a_row_becomes_a_batch_of_one_row_of_the_declared_datatype() -> None:
    got = inputs_of_row({"v": "[1, 2.5]", "t": "hi"}, {"x": "v", "text": "t"},
                        {"x": "FP32", "text": "BYTES"})
    assert got["x"].dtype == np.float32 and got["x"].tolist() == [[1.0, 2.5]]
    assert got["text"].dtype == object and got["text"].tolist() == ["hi"]
    assert inputs_of_row({"v": [3, 4]}, {"input": "v"}, {}) == {"input": [[3, 4]]}
    with pytest.raises(ValueError, match="column 'v' \\(input 'x'\\) is empty"):
        inputs_of_row({"v": None}, {"x": "v"}, {"x": "FP32"})
    with pytest.raises(ValueError, match="column 'v' \\(input 'x', FP32\\): 'abc' is not a number"):
        inputs_of_row({"v": "abc"}, {"x": "v"}, {"x": "FP32"})

# -- parts ----------------------------------------------------------------------------------------


def _rows(first: int, count: int, failed: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    return [{"id": i, "out": None if i in failed else np.full(3, i, np.float32),
             "status": "error" if i in failed else "ok", "error": "bad" if i in failed else None}
            for i in range(first, first + count)]


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv"])
def test_parts_from_row_0_without_a_gap_are_what_a_job_goes_on_from(tmp_path: Path, kind: str) -> None:
    output = place_of(tmp_path / f"out.{kind}")
    folder = parts_folder(output)
    assert committed_rows(folder, kind) == (0, 0)
    write_part(folder, kind, 0, _rows(0, 4, failed=(1,)), 1)
    write_part(folder, kind, 4, _rows(4, 3), 0)
    write_part(folder, kind, 9, _rows(9, 2), 0)  # past a gap: dropped
    (tmp_path / f"out.{kind}.parts" / f"part-000000000007-000002-000000.{kind}.tmp").write_bytes(
        b"half")  # half-written
    assert committed_rows(folder, kind) == (7, 1)
    assert [p.name for p in folder.children()] == [
        f"part-000000000000-000004-000001.{kind}", f"part-000000000004-000003-000000.{kind}"]
    write_part(folder, kind, 7, _rows(7, 3, failed=(7, 8, 9)), 3)  # all failed: no output values
    assert committed_rows(folder, kind) == (10, 4)
    assemble(folder, kind, output)
    assert not folder.exists()
    written = tmp_path / f"out.{kind}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [written.name]  # no temporary left
    if kind == "parquet":
        got = pq.read_table(written).to_pylist()
        assert pq.read_schema(written).field("out").type == pa.list_(pa.float32())
    elif kind == "jsonl":
        got = [json.loads(line) for line in written.read_text().splitlines()]
    else:
        import csv
        got = list(csv.DictReader(written.open()))
    assert [int(r["id"]) for r in got] == list(range(10))
    assert [r["status"] for r in got] == ["ok", "error"] + ["ok"] * 5 + ["error"] * 3
    first = got[2]["out"]
    assert (json.loads(first) if kind == "csv" else first) == [2.0, 2.0, 2.0]
    assert got[1]["out"] in (None, "") and got[1]["error"] == "bad"

# -- the record -----------------------------------------------------------------------------------


def test_a_record_says_progress_and_refuses_another_job_under_its_id() -> None:
    redis = fakeredis.FakeRedis()
    job = record.JobRecord("j", "m", "/in.parquet", "/out.parquet", {"x": "v"}, 100)
    assert record.begin(redis, job, 0, 0) == 1
    assert record.progress(redis, "j", written=40, failed_written=2, answered=50, failed=3,
                           sent=90) == "running"
    found = record.read(redis, "j")
    assert (found.state, found.answered, found.failed, found.written, found.sent) == \
        ("running", 50, 3, 40, 90)
    assert "job j: running, 50 / 100 rows (50.0 %), 3 failed" in found.line()
    assert record.begin(redis, job, 40, 2) == 2  # again: from what was written
    again = record.read(redis, "j")
    assert (again.answered, again.failed, again.runs) == (40, 2, 2)
    other = record.JobRecord("j", "m", "/other.parquet", "/out.parquet", {"x": "v"}, 100)
    with pytest.raises(ValueError, match="job j was started with another input '/in.parquet'"):
        record.begin(redis, other, 0, 0)
    record.cancel(redis, "j")
    assert record.progress(redis, "j", written=40, failed_written=2, answered=41, failed=2,
                           sent=90) == "cancelled"
    with pytest.raises(ValueError, match="job j was cancelled"):
        record.begin(redis, job, 40, 2)
    with pytest.raises(KeyError, match="job nothing: no record of it"):
        record.read(redis, "nothing")

# -- a job against a stub client ------------------------------------------------------------------


class _Future(concurrent.futures.Future):  # type: ignore[type-arg]
    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.id = request_id

    def _settle(self, meta: Any) -> None:
        pass


class _Response:
    def __init__(self, values: np.ndarray) -> None:
        self.outputs = {"y": None}
        self._values = values

    def as_numpy(self, name: str) -> np.ndarray:
        return self._values


class _StubClient:
    """Answers ``y = 2x`` at once; refuses x = -1 at submit; fails x = -2 in the 'model'; stops
    the producer (SystemExit, as a kill would) at the ``stop_at``-th submit."""

    def __init__(self, redis: Any, stop_at: int | None = None) -> None:
        self.redis, self.stop_at, self.sent = redis, stop_at, []
        self.backend = type("B", (), {"client": redis})()

    def check_model(self, model: str) -> None:
        pass

    def models(self) -> dict[str, Any]:
        meta = {"inputs": [{"name": "x", "datatype": "FP32"}], "outputs": [{"name": "y"}]}
        return {"m": type("E", (), {"metadata": meta})()}

    def app_for(self, model: str) -> Any:
        return self

    def sender_for(self, model: str) -> Any:
        return type("S", (), {"watcher": type("W", (), {"unwatch": lambda *a: None})()})()

    def submit(self, model: str, inputs: dict[str, Any], request_id: str, serializer: str) -> _Future:
        if self.stop_at is not None and len(self.sent) == self.stop_at:
            raise SystemExit("killed")
        x = inputs["x"]
        if x[0] == -1:
            raise InvalidRequest(f"request {request_id}: x -1 refused")
        self.sent.append(request_id)
        future = _Future(request_id)
        if x[0] == -2:
            future.set_exception(RuntimeError(f"request {request_id}: model failed"))
        else:
            future.set_result(_Response(2 * x))
        return future


def test_a_job_stopped_and_started_again_writes_every_row_once_in_order(tmp_path: Path) -> None:
    xs = [float(i) for i in range(50)]
    xs[7], xs[30] = -1.0, -2.0
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"n": i, "x": x}) + "\n" for i, x in enumerate(xs)))
    output, redis = tmp_path / "out.jsonl", fakeredis.FakeRedis()
    first = _StubClient(redis, stop_at=23)
    with pytest.raises(SystemExit):
        run_job(first, "m", source, output, job_id="j", part_rows=8, window=4, progress=False)
    assert not output.exists()
    assert committed_rows(parts_folder(place_of(output)), "jsonl")[0] == 16
    assert record.read(redis, "j").state == "failed"
    second = _StubClient(redis)
    done = run_job(second, "m", source, output, job_id="j", part_rows=8, window=4, progress=False)
    assert (done.rows, done.failed, done.resumed_at, done.run_rows) == (50, 2, 16, 34)
    assert second.sent[0] == "j-16"  # the rows not written are sent again under their IDs
    got = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["n"] for r in got] == list(range(50))
    assert [r["y"] for r in got if r["status"] == "ok"] == [2 * x for x in xs if x >= 0]
    assert "x -1 refused" in got[7]["error"] and "model failed" in got[30]["error"]
    assert record.read(redis, "j").state == "completed"
    assert (record.read(redis, "j").answered, record.read(redis, "j").failed) == (50, 2)
    with pytest.raises(ValueError, match="its output .* exists"):
        run_job(second, "m", source, output, job_id="k", progress=False)
    said: list[str] = []
    again = run_job(second, "m", source, output, job_id="j", progress=False, announce=said.append)
    assert (again.rows, again.failed, again.run_rows) == (50, 2, 0)  # done before: nothing sent
    assert said == [f"job j: completed before (50 rows, 2 failed) -> {output}"]


def test_a_cancelled_job_stops_at_its_next_write(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "in.csv"
    source.write_text("x\n" + "".join(f"{i}\n" for i in range(40)))
    redis = fakeredis.FakeRedis()
    client = _StubClient(redis)
    record.begin(redis, record.JobRecord("c", "m", str(source.resolve()),
                                         str((tmp_path / "out.csv").resolve()), {"x": "x"}, 40), 0, 0)
    record.cancel(redis, "c")
    with pytest.raises(ValueError, match="job c was cancelled"):
        run_job(client, "m", source, tmp_path / "out.csv", job_id="c", progress=False)
    revoked: list[str] = []
    client.control = type("C", (), {"revoke": lambda self, ids: revoked.extend(ids)})()  # type: ignore[attr-defined]
    original = record.progress

    def cancelled_midway(*args: Any, **kwargs: Any) -> str:
        state = original(*args, **kwargs)
        return "cancelled" if kwargs["written"] >= 8 else state

    monkeypatch.setattr(record, "progress", cancelled_midway)
    with pytest.raises(JobCancelled, match="job d: cancelled at row 8 of 40"):
        run_job(client, "m", source, tmp_path / "out2.csv", job_id="d", part_rows=8, window=4,
                progress=False)
    assert revoked == [f"d-{i}" for i in range(8, 8 + len(revoked))] and revoked
