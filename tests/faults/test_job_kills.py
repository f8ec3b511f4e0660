"""Faults during a job (asyncinfer/client/jobs), at the shipped defaults: its producer killed with
SIGKILL three times and started again under the same ID, and a worker killed while the job's rows
stream through it. Every row must be in the output once, in input order; the "gated" model counts
each row's executions in Redis, so a row run twice is counted, not guessed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncinfer.client.jobs import record
from tests.support.databases import RedisDatabase, RedisDatabases, gated_broker, gated_executions
from tests.support.processes import ROOT, start_worker, stop_together, worker_env

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def gated_db(redis_databases: RedisDatabases, request: pytest.FixtureRequest) -> Iterator[RedisDatabase]:
    with redis_databases.take(request.node.nodeid) as db:
        yield db


def _gated(url: str, tag: str) -> tuple[str, dict[str, str]]:
    prefix, r, env = gated_broker(url, tag)
    r.close()
    del env["ASYNCINFER_VISIBILITY_TIMEOUT_S"]  # the shipped defaults: leases, visibility timeout
    return prefix, env


def _rows_file(path: Path, rows: int) -> None:
    path.write_text("".join(json.dumps({"row": i, "index": [i]}) + "\n" for i in range(rows)))


def _job(url: str, env: dict[str, str], source: Path, output: Path, job_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "asyncinfer", "job", "run", "gated", "--input",
                             str(source), "--output", str(output), "--job-id", job_id],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=worker_env(url, **env))


def _wait_written(db: RedisDatabase, job_id: str, rows: int, proc: subprocess.Popen[str],
                  timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended before {rows} rows: {proc.communicate()}"
        try:
            written = record.read(db.client, job_id).written
        except KeyError:
            written = 0
        if written >= rows:
            return written
        time.sleep(0.05)
    raise AssertionError(f"job {job_id}: {rows} rows not written within {timeout_s} s")


def _every_row_once(db: RedisDatabase, prefix: str, output: Path, rows: int,
                    more: str) -> tuple[int, str]:
    """Assert that the output holds each row once, in order, answered, and that the model ran
    each; returns the rows run twice and the counts in words (printed)."""
    got = [json.loads(line) for line in output.read_text().splitlines()]
    executions = gated_executions(db.client, prefix)
    ran_twice = sum(1 for n in executions.values() if n > 1)
    counts = (f"sent {rows}, answered {sum(r['status'] == 'ok' for r in got)}, lost "
              f"{rows - len(executions)}, ran twice {ran_twice}, {more}")
    print(counts)
    assert [r["row"] for r in got] == list(range(rows)), counts  # each row once, in order
    assert all(r["status"] == "ok" and r["output"] == [float(r["row"])] for r in got), counts
    assert sorted(executions) == list(range(rows)), counts
    return ran_twice, counts


def test_a_producer_killed_three_times_and_started_again_writes_every_row_once_in_order(
        gated_db: RedisDatabase, tmp_path: Path) -> None:
    rows, job_id = 20_000, "killed-producer"
    prefix, env = _gated(gated_db.url, "job-producer")
    source, output = tmp_path / "rows.jsonl", tmp_path / "answers.jsonl"
    _rows_file(source, rows)
    worker = start_worker(gated_db.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "gated", "--hostname", "job-producer@%h", **env)
    killed_at: list[tuple[int, int]] = []  # (rows written, rows sent) at each kill
    try:
        began_s = time.monotonic()
        for threshold in (4_000, 9_000, 14_000):
            proc = _job(gated_db.url, env, source, output, job_id)
            try:
                _wait_written(gated_db, job_id, threshold, proc)
                proc.kill()  # SIGKILL: no clean-up, rows on their way, a part maybe half-written
            finally:
                proc.communicate()
            found = record.read(gated_db.client, job_id)
            killed_at.append((found.written, found.sent))
        proc = _job(gated_db.url, env, source, output, job_id)
        out, err = proc.communicate(timeout=240)
        took_s = time.monotonic() - began_s
        assert proc.returncode == 0, err
    finally:
        worker.stop()
    ran_twice, counts = _every_row_once(gated_db, prefix, output, rows,
                                        f"kills at (written, sent) {killed_at}, {took_s:.1f} s in all")
    # a row on its way at a kill is sent again under its ID: answered by the request already sent
    assert ran_twice == 0, counts
    assert all(written < sent for written, sent in killed_at), counts  # rows were on their way
    assert f"job {job_id}: completed, 20,000 rows (0 failed)" in out
    assert "from row" in err  # the fourth run went on from where the third was
    found = record.read(gated_db.client, job_id)
    assert (found.state, found.runs, found.answered, found.failed) == ("completed", 4, rows, 0)


def test_a_worker_killed_during_a_job_costs_no_row(gated_db: RedisDatabase, tmp_path: Path) -> None:
    rows, job_id = 6_000, "killed-worker"
    prefix, env = _gated(gated_db.url, "job-worker")
    source, output = tmp_path / "rows.jsonl", tmp_path / "answers.jsonl"
    _rows_file(source, rows)
    workers = [start_worker(gated_db.url, tmp_path / f"w{i}.log", "--device", "cpu", "--models",
                            "gated", "--hostname", f"job-worker{i}@%h", **env) for i in range(2)]
    try:
        proc = _job(gated_db.url, env, source, output, job_id)
        try:
            _wait_written(gated_db, job_id, 1_500, proc)
            workers[0].process.kill()  # SIGKILL while it holds the job's rows
            workers[0].process.wait()
            killed_s = time.monotonic()
            out, err = proc.communicate(timeout=240)
            after_kill_s = time.monotonic() - killed_s
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, err
    finally:
        stop_together(workers)
    _every_row_once(gated_db, prefix, output, rows, f"last answer {after_kill_s:.1f} s after the kill")
    assert f"job {job_id}: completed, 6,000 rows (0 failed)" in out
