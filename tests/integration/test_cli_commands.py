"""The CLI's everyday commands as a user types them: compact and npy output, status --json,
cancel, purge (with its confirmation), help that shows defaults, a bad flag's usage."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid

import numpy as np
import pytest
from celery.exceptions import TaskRevokedError

from asyncinfer.client import Client
from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.timeout(120)

X = [[0.5, 1.5, 2.5]]


def run(env: dict[str, str], *args: str, stdin: str | None = None,
        text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "asyncinfer", *args], input=stdin,
                          capture_output=True, text=text, timeout=90, cwd=ROOT, env=env)


def test_infer_prints_one_line_pretty_on_request_and_npy_archives(worker, redis_url) -> None:
    env = worker_env(redis_url)
    doc = json.dumps({"x": X})
    compact = run(env, "infer", "identity", "--input", "-", "--datatype", "FP32", stdin=doc)
    assert compact.returncode == 0, compact.stderr[-2000:]
    [line] = compact.stdout.splitlines()
    assert json.loads(line)["outputs"][0]["data"] == [0.5, 1.5, 2.5]
    pretty = run(env, "infer", "identity", "--input", "-", "--datatype", "FP32", "--pretty",
                 stdin=doc)
    assert len(pretty.stdout.splitlines()) > 5 and json.loads(pretty.stdout) is not None
    npy = subprocess.run([sys.executable, "-m", "asyncinfer", "infer", "identity", "--input", "-",
                          "--datatype", "FP32", "--output", "npy"], input=doc.encode(),
                         capture_output=True, timeout=90, cwd=ROOT, env=env)
    assert npy.returncode == 0, npy.stderr[-2000:]
    arrays = np.load(io.BytesIO(npy.stdout))
    assert arrays["x"].dtype == np.float32 and arrays["x"].tolist() == X


def test_npy_output_of_text_is_read_without_pickle_and_a_lossy_one_is_refused(worker,
                                                                              redis_url) -> None:
    # BYTES outputs are object arrays, which np.savez would pickle: they are written as numpy
    # bytes, which np.load reads with its default allow_pickle=False
    env = worker_env(redis_url)
    npy = subprocess.run([sys.executable, "-m", "asyncinfer", "infer", "identity", "--input", "-",
                          "--datatype", "BYTES", "--output", "npy"],
                         input=json.dumps({"t": ["héllo", "a b"]}).encode(), capture_output=True,
                         timeout=90, cwd=ROOT, env=env)
    assert npy.returncode == 0, npy.stderr[-2000:]
    arrays = np.load(io.BytesIO(npy.stdout), allow_pickle=False)
    assert arrays["t"].tolist() == ["héllo".encode(), b"a b"]
    # An element numpy's bytes would change (a trailing NUL) is refused, nothing written
    lossy = subprocess.run([sys.executable, "-m", "asyncinfer", "infer", "identity", "--input", "-",
                            "--datatype", "BYTES", "--output", "npy"],
                           input=json.dumps({"t": ["ends in nul\u0000"]}).encode(),
                           capture_output=True, timeout=90, cwd=ROOT, env=env)
    assert lossy.returncode == 1 and lossy.stdout == b""
    assert b"output 't': an element that is not text, or ends in a NUL byte, has no .npy form " \
           b"without pickle" in lossy.stderr


def test_status_json_names_the_worker_and_the_queues(worker, redis_url) -> None:
    out = run(worker_env(redis_url), "status", "--json", "--timeout-s", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout)
    assert any(w["name"].startswith("test-cpu@") and "identity" in w["models"]
               for w in status["workers"])
    assert status["queue_depths"]["identity"] >= 0


def test_cancel_revokes_a_request(worker, redis_url) -> None:
    request_id = f"cancel-{uuid.uuid4()}"
    out = run(worker_env(redis_url), "cancel", request_id)
    assert out.returncode == 0 and out.stdout.strip() == f"revoked {request_id}"
    with Client(broker_url=redis_url) as client:
        with pytest.raises(TaskRevokedError):
            client.result(request_id, timeout_s=10)


def test_purge_asks_first_then_removes_and_answers_every_waiting_request(redis_db) -> None:
    env = worker_env(redis_db.url)  # no worker reads this database: requests wait
    with Client(broker_url=redis_db.url) as client:
        futures = [client.submit("mlp", np.zeros((1, 16), np.float32)) for _ in range(3)]
        refused = run(env, "purge", "mlp", stdin="n\n")
        assert refused.returncode == 1 and "nothing removed" in refused.stdout
        assert redis_db.client.llen("infer.mlp") == 3
        done = run(env, "purge", "mlp", "--yes")
        assert done.returncode == 0 and done.stdout.strip() == "infer.mlp: removed 3 requests (REVOKED)"
        assert redis_db.client.llen("infer.mlp") == 0
        for future in futures:
            with pytest.raises(TaskRevokedError, match="purged"):
                future.result(timeout=10)
        assert run(env, "purge", "mlp", "--yes").stdout.strip() == "infer.mlp: nothing waiting"


@pytest.mark.parametrize(("args", "shown"), [
    (["infer", "--help"], "how long to wait (default: 60.0)"),
    (["status", "--help"], "--watch S"),
    (["--help"], "cancel, purge, status"),
])
def test_help_shows_every_command_and_the_defaults(args, shown, tmp_path) -> None:
    out = run(worker_env(""), *args)
    assert out.returncode == 0 and shown in " ".join(out.stdout.split())


def test_a_bad_flag_prints_the_subcommands_usage(tmp_path) -> None:
    out = run(worker_env(""), "status", "--bogus")
    assert out.returncode == 2
    assert out.stderr.splitlines()[0].startswith("usage: asyncinfer status")
    assert "unrecognized arguments: --bogus" in out.stderr
