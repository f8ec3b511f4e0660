"""``asyncinfer infer --stream`` when its request fails with one of Celery's failure types (a time
limit, a revoke): the one line ``asyncinfer result`` prints for the same request, no traceback,
exit status 1, as ``infer`` without ``--stream``."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.processes import ROOT, start_worker, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)


def asyncinfer(env: dict[str, str], *args: str, stdin: str | None = None
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncinfer", *args], input=stdin,
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def the_same_line_as_result(env: dict[str, str], stderr: str) -> str:
    """The one line ``infer --stream`` printed, checked against ``asyncinfer result``'s."""
    lines = error_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    request_id = re.match(r"asyncinfer infer: \w+: request (\S+?):? ", lines[0]).group(1)
    result = asyncinfer(env, "result", request_id, "--timeout-s", "10")
    assert result.returncode == 1
    assert error_lines(result.stderr) == [lines[0].replace("asyncinfer infer:", "asyncinfer result:")]
    return lines[0].replace(request_id, "R")


def test_a_stream_past_its_time_limit_is_one_line(redis_db, tmp_path) -> None:
    # Given a worker whose time limit (1 s) a request of 30 s passes
    worker = start_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "sleep", ASYNCINFER_TIME_LIMIT_S="1", ASYNCINFER_MAX_RETRIES="0")
    try:
        env = worker_env(redis_db.url)
        # When it is streamed
        out = asyncinfer(env, "infer", "sleep", "--stream", "--input", "-",
                         stdin=json.dumps([[30.0]]))
        # Then the line `asyncinfer result` prints, and exit status 1
        assert out.returncode == 1, out.stderr
        assert the_same_line_as_result(env, out.stderr) == (
            "asyncinfer infer: TimeLimitExceeded: request R: time limit (1 s) exceeded on model "
            "'sleep' (its batch is still on the device)")
    finally:
        worker.stop()


def test_a_stream_whose_request_is_revoked_is_one_line(redis_db, tmp_path) -> None:
    # Given a streamed request waiting on its queue (no worker serves this database)
    env = worker_env(redis_db.url)
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps([[0.5]]))
    streaming = subprocess.Popen(
        [sys.executable, "-m", "asyncinfer", "infer", "sleep", "--stream", "--input", str(inputs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        wait_for(lambda: redis_db.client.llen("infer.sleep") == 1, 30, "the request queued")
        # When it is revoked (purged: each request removed gets REVOKED)
        assert asyncinfer(env, "purge", "sleep", "--yes").returncode == 0
        _, stderr = streaming.communicate(timeout=60)
    finally:
        if streaming.poll() is None:
            streaming.kill()
            streaming.wait()
    # Then the line `asyncinfer result` prints for it, and exit status 1
    assert streaming.returncode == 1, stderr
    assert the_same_line_as_result(env, stderr) == "asyncinfer infer: TaskRevokedError: request R: purged"
