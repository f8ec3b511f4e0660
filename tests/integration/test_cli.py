"""The ``asyncinfer`` and ``celery`` commands against a real Redis and real worker processes."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import uuid

import numpy as np
import pytest

from tests.support.processes import ROOT, start_worker, worker_env

pytestmark = pytest.mark.timeout(180)


def asyncinfer(redis_url: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncinfer", *args], input=stdin, capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=worker_env(redis_url))


def test_submit_then_result_by_id(worker, redis_url) -> None:
    request_id = "cli-" + uuid.uuid4().hex
    sent = asyncinfer(redis_url, "submit", "identity", "--input", "-", "--request-id", request_id,
                      stdin=json.dumps({"x": [[1, 2], [3, 4]]}))
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.strip() == request_id
    got = asyncinfer(redis_url, "result", request_id, "--timeout-s", "60")
    assert got.returncode == 0, got.stderr
    response = json.loads(got.stdout)
    assert response["id"] == request_id
    assert response["outputs"] == [{"name": "x", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]}]


def test_infer_reads_a_v2_request_file(worker, redis_url, tmp_path) -> None:
    request = {"inputs": [{"name": "input", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    out = asyncinfer(redis_url, "infer", "mlp", "--input", str(path))
    assert out.returncode == 0, out.stderr
    response = json.loads(out.stdout)
    assert response["model_name"] == "mlp"
    assert response["outputs"][0]["shape"] == [1, 4] and len(response["outputs"][0]["data"]) == 4


def test_infer_reports_bad_input_and_exits_nonzero(worker, redis_url) -> None:
    out = asyncinfer(redis_url, "infer", "mlp", "--input", "-", "--datatype", "FP32",
                     stdin=json.dumps([[1.0, 2.0]]))
    assert out.returncode == 1
    assert "InvalidRequest" in out.stderr and "shape [1, 2] does not match [n, 16]" in out.stderr


def test_status_lists_workers_devices_models_and_queues(worker, redis_url) -> None:
    out = asyncinfer(redis_url, "status", "--timeout-s", "3")
    assert out.returncode == 0, out.stderr
    line = next(li for li in out.stdout.splitlines() if li.startswith("test-cpu@"))
    assert " cpu " in line and "identity" in line and "mlp" in line
    assert "infer.identity" in out.stdout and "infer.mlp" in out.stdout


def test_config_table_lists_every_variable() -> None:
    from asyncinfer.config.settings_report import settings_table

    out = subprocess.run([sys.executable, "-m", "asyncinfer", "config", "--table"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0
    assert out.stdout.strip() == settings_table()
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert settings_table() in page, "docs/configuration.md's settings table is out of date"


def test_celery_cli_worker_serves_requests(redis_url, client, tmp_path) -> None:
    # Given a worker started with Celery's own command, consuming a queue only it serves
    proc = start_worker_with_celery(redis_url, tmp_path)
    try:
        response = client.infer("echo", np.array([[4, 5]], np.uint8), timeout_s=60)
        assert response["input"].tolist() == [[4, 5]]
        assert response.parameters["worker"].startswith("celery-cli@")
    finally:
        proc.stop()


def start_worker_with_celery(redis_url: str, tmp_path):
    from tests.support.processes import WorkerProcess

    env = worker_env(redis_url, ASYNCINFER_MODEL_FACTORIES="echo=asyncinfer.models.builtin:Identity",
                     ASYNCINFER_DEVICE="cpu")
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-Q", "infer.echo",
            "-n", "celery-cli@%h", "-c", "4", "-l", "INFO"]
    return WorkerProcess(argv, env, tmp_path / "celery-worker.log").wait_ready()


def test_worker_flags_pick_device_and_models(redis_url, client, tmp_path) -> None:
    proc = start_worker(redis_url, tmp_path / "w.log", "--device", "cpu", "--models", "affine",
                        "--hostname", "only-affine@%h")
    try:
        log = proc.log()
        assert "infer.affine" in log and "infer.identity" not in log
        response = client.infer("affine", {"x": np.zeros((1, 3))}, timeout_s=60)
        assert response["y"].tolist() == [[1.0, 1.0, 1.0]]
    finally:
        proc.stop()


def test_a_worker_ignores_sigpipe_so_a_dead_redis_peer_cannot_kill_it(worker) -> None:
    # A write to a socket whose peer died (a Redis master killed during a failover) must raise
    # in the worker, not end it (so must it in every command: below).
    status = open(f"/proc/{worker.pid}/status").read()
    ignored = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (13 - 1)), "SIGPIPE (13) is not ignored by the worker"


def test_a_printing_command_whose_reader_leaves_ends_quietly_and_ignores_sigpipe() -> None:
    # Given `asyncinfer config --table | head -c 10`: the reader leaves after 10 bytes
    proc = subprocess.Popen([sys.executable, "-m", "asyncinfer", "config", "--table"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    fcntl.fcntl(proc.stdout.fileno(), 1031, 4096)  # F_SETPIPE_SZ: the table does not fit in it
    first = proc.stdout.read(10)
    proc.stdout.close()
    # Then the command ends by itself, not by SIGPIPE (which would also end it on a socket
    # whose Redis peer died), and says nothing of the pipe
    rc = proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    assert first.startswith(b"| Variable")
    assert rc == 1 and "Traceback" not in err and "BrokenPipe" not in err, (rc, err)


def test_infer_input_file_answers_every_line_in_order_and_names_the_bad_ones(worker, redis_url,
                                                                             tmp_path) -> None:
    # Given 2,000 requests, one per line, with a line that is not JSON (line 501), a line that is
    # not a tensor (ragged rows, line 1202) and a blank line (line 1500) among them
    rows = [{"x": [[i, -i]]} for i in range(2000)]
    lines = [json.dumps(row) for row in rows]
    lines.insert(500, '{"x": [[1, 2]')
    lines.insert(1201, '{"x": [[1, 2], [3]]}')
    lines.insert(1499, "")
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")

    # When they are sent through a window smaller than the file, without a terminal
    out = asyncinfer(redis_url, "infer", "identity", "--input-file", str(path), "--window", "300")

    # Then each answer is a JSON line, in input order, with its row's values
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == 2000
    assert [a["outputs"][0]["data"] for a in answers] == [[i, -i] for i in range(2000)]
    assert answers[1234]["outputs"] == [{"name": "x", "shape": [1, 2], "datatype": "INT64",
                                         "data": [1234, -1234]}]
    assert len({a["id"] for a in answers}) == 2000
    # and each bad line is one line on stderr naming its number, nothing else (no bar), exit 1
    errors = out.stderr.splitlines()
    assert len(errors) == 2, out.stderr
    assert errors[0].startswith("asyncinfer infer: line 501: not JSON (")
    assert errors[0].endswith("; nothing sent")
    assert errors[1].startswith("asyncinfer infer: line 1202: not a request: InvalidRequest: ")
    assert "nested lists are ragged" in errors[1]
    assert out.returncode == 1


def test_infer_input_file_says_a_request_the_worker_refused_and_exits_zero_when_none_failed(
        worker, redis_url) -> None:
    # --datatype applies to every line; mlp refuses a row of 2 values at the worker or client
    good = json.dumps([[0.5] * 16])
    lines = [good, json.dumps([[1.0, 2.0]]), good]
    out = asyncinfer(redis_url, "infer", "mlp", "--input-file", "-", "--datatype", "FP32",
                     stdin="\n".join(lines) + "\n")
    assert out.returncode == 1
    assert len(out.stdout.splitlines()) == 2
    assert [json.loads(line)["outputs"][0]["shape"] for line in out.stdout.splitlines()] == [[1, 4]] * 2
    [error] = out.stderr.splitlines()
    assert error.startswith("asyncinfer infer: line 2: InvalidRequest: ")
    assert "shape [1, 2] does not match [n, 16]" in error

    fine = asyncinfer(redis_url, "infer", "mlp", "--input-file", "-", stdin=good + "\n" + good)
    assert fine.returncode == 0, fine.stderr
    assert len(fine.stdout.splitlines()) == 2 and fine.stderr == ""


def test_infer_input_file_progress_bar_on_stderr_only_when_asked_or_on_a_terminal(worker, redis_url) -> None:
    stdin = "".join(json.dumps({"x": [[i]]}) + "\n" for i in range(50))
    shown = asyncinfer(redis_url, "infer", "identity", "--input-file", "-", "--progress", stdin=stdin)
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout.splitlines()) == 50
    assert "identity: 50row [" in shown.stderr and "row/s]" in shown.stderr  # tqdm's bar, no total
    # stderr is no terminal here: no bar unless asked, and --no-progress says no
    for flags in ((), ("--no-progress",)):
        quiet = asyncinfer(redis_url, "infer", "identity", "--input-file", "-", *flags, stdin=stdin)
        assert quiet.returncode == 0 and quiet.stderr == ""
        assert [json.loads(li)["outputs"][0]["data"] for li in quiet.stdout.splitlines()] == \
            [[i] for i in range(50)]


def test_infer_input_file_prints_an_answer_before_the_next_line_is_read(worker, redis_url) -> None:
    # Given the command reading stdin with a window of one request
    proc = subprocess.Popen([sys.executable, "-m", "asyncinfer", "infer", "identity", "--input-file", "-",
                             "--window", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=worker_env(redis_url))
    try:
        for i in (7, 8):
            # When a line is written, and the next one not yet
            proc.stdin.write(json.dumps({"x": [[i]]}) + "\n")
            proc.stdin.flush()
            # Then its answer is printed already
            assert json.loads(proc.stdout.readline())["outputs"][0]["data"] == [i]
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
