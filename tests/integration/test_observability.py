"""What an operator sees: Prometheus metrics, Celery task events (Flower), ``asyncinfer status``
and the one log line of a failed request — against a real Redis and real worker processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from asyncinfer.ops.redis_server import free_port
from tests.support.metrics import scrape, value
from tests.support.processes import ROOT, TEST_FACTORIES, WorkerProcess, start_worker, worker_env

pytestmark = pytest.mark.timeout(180)

#: Models only the metrics worker serves, so its counts are exactly what these tests sent.
OBS_FACTORIES = (TEST_FACTORIES + ",obs_identity=asyncinfer.models.builtin:Identity"
                 ",obs_poison=tests.support.models:Poison")


@pytest.fixture(scope="module")
def metrics_worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[WorkerProcess, int]]:
    port = free_port()
    proc = start_worker(redis_url, tmp_path_factory.mktemp("obs") / "worker.log",
                        "--device", "cpu", "--models", "obs_identity,obs_poison",
                        "--hostname", "obs-cpu@%h", "--metrics-port", str(port),
                        ASYNCINFER_MODEL_FACTORIES=OBS_FACTORIES)
    try:
        yield proc, port
    finally:
        proc.stop()



def test_metrics_count_requests_batches_and_failures(redis_url, metrics_worker) -> None:
    from asyncinfer.client import Client

    _, port = metrics_worker
    # Given requests of 1 to 3 rows, and poison requests of which one has a negative input
    rows = [1 + i % 3 for i in range(12)]
    with Client(broker_url=redis_url) as client:
        futures = [client.submit("obs_identity", np.full((n, 2), i, np.float32))
                   for i, n in enumerate(rows)]
        good = [client.submit("obs_poison", np.ones((1, 1), np.float32)) for _ in range(3)]
        bad = client.submit("obs_poison", -np.ones((1, 1), np.float32))
        # When they are answered
        for f in futures + good:
            f.result(timeout=60)
        with pytest.raises(Exception, match="negative input poisons this model"):
            bad.result(timeout=60)

    # Then the scraped counts are exactly what was sent
    m = scrape(port)
    ident = {"model": "obs_identity", "device": "cpu"}
    poison = {"model": "obs_poison", "device": "cpu"}
    assert value(m, "asyncinfer_inference_request_success_total", **ident) == len(rows)
    assert value(m, "asyncinfer_inference_request_success_total", **poison) == 3
    assert value(m, "asyncinfer_inference_request_failure_total", reason="ModelError", **poison) == 1
    assert value(m, "asyncinfer_inference_request_failure_total", reason="ModelError", **ident) == 0
    # Every row went to the device in some batch; each batch has a compute time
    assert value(m, "asyncinfer_inference_batch_size_sum", **ident) == sum(rows)
    batches = value(m, "asyncinfer_inference_batch_size_count", **ident)
    assert 1 <= batches <= len(rows)
    assert value(m, "asyncinfer_inference_compute_duration_seconds_count", **ident) == batches
    assert value(m, "asyncinfer_inference_batch_size_bucket", le="+Inf", **ident) == batches
    # The poisoned batch never reached the host: only the three good rows did, one batch each at
    # most; every request that ran has a queue time
    assert value(m, "asyncinfer_inference_batch_size_sum", **poison) == 3
    assert value(m, "asyncinfer_inference_queue_duration_seconds_count", **ident) == len(rows)
    assert value(m, "asyncinfer_inference_queue_duration_seconds_count", **poison) == 3
    # The gauges are there, read at scrape time
    assert value(m, "asyncinfer_inference_pending_requests", **ident) == 0
    assert ("asyncinfer_inference_in_flight_requests", (("device", "cpu"),)) in m
    assert value(m, "asyncinfer_inference_retries_total", **poison) == 0


def test_task_events_for_flower(redis_url, metrics_worker) -> None:
    from asyncinfer.celery_app import create_app
    from asyncinfer.client import Client
    from asyncinfer.config.settings import Settings

    app = create_app(Settings(broker_url=redis_url))
    events: list[dict[str, Any]] = []
    heartbeat = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        # The worker's periodic heartbeat (it carries the active count); a heartbeat sent in
        # answer to Celery's `heartbeat` control command has none.
        if (event["type"] == "worker-heartbeat" and event["hostname"].startswith("obs-cpu@")
                and "active" in event):
            heartbeat.set()

    # Given a receiver that hears the worker's heartbeats (so it is subscribed)
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": on_event})
        thread = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None},
                                  daemon=True)
        thread.start()
        try:
            assert heartbeat.wait(30), "no worker-heartbeat from the worker in 30 s"
            # When two good requests and a failing one are answered
            with Client(broker_url=redis_url) as client:
                ok = [client.submit("obs_identity", np.ones((1, 2), np.float32)) for _ in range(2)]
                bad = client.submit("obs_poison", -np.ones((1, 1), np.float32))
                for f in ok:
                    f.result(timeout=60)
                with pytest.raises(Exception, match="negative input"):
                    bad.result(timeout=60)
            wanted = {(f.id, "task-succeeded") for f in ok} | {(bad.id, "task-failed")}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not wanted <= {
                    (e.get("uuid"), e["type"]) for e in list(events)}:
                time.sleep(0.1)
        finally:
            receiver.should_stop = True
            thread.join(timeout=10)

    # Then each request has the events Celery's worker sends, with its fields
    def of(request_id: str) -> dict[str, dict[str, Any]]:
        return {e["type"]: e for e in events if e.get("uuid") == request_id}

    for f in ok:
        got = of(f.id)
        assert {"task-received", "task-started", "task-succeeded"} <= set(got), got
        received = got["task-received"]
        assert received["name"] == "asyncinfer.infer"
        assert received["hostname"].startswith("obs-cpu@")
        assert received["retries"] == 0 and received["root_id"] == f.id
        assert "obs_identity" in received["kwargs"]
        succeeded = got["task-succeeded"]
        assert succeeded["runtime"] > 0 and f.id in succeeded["result"]
    failed = of(bad.id)
    assert {"task-received", "task-failed"} <= set(failed) and "task-succeeded" not in failed
    assert "ModelError" in failed["task-failed"]["exception"]
    assert "negative input poisons this model" in failed["task-failed"]["traceback"]
    beats = [e for e in events
             if e["type"] == "worker-heartbeat" and str(e.get("hostname", "")).startswith("obs-cpu@")]
    assert any(isinstance(e.get("active"), int) for e in beats), [
        {k: e.get(k) for k in ("type", "active", "processed", "freq")} for e in beats]


def test_status_shows_in_flight_pending_and_throughput(redis_url, worker, client) -> None:
    # Given requests flowing to the session worker while the status is taken
    stop = threading.Event()

    def keep_sending() -> None:
        while not stop.is_set():
            client.infer("identity", np.ones((1, 4), np.float32), timeout_s=60)

    sender = threading.Thread(target=keep_sending, daemon=True)
    for _ in range(5):
        client.infer("identity", np.ones((1, 4), np.float32), timeout_s=60)
    sender.start()
    try:
        out = subprocess.run([sys.executable, "-m", "asyncinfer", "status", "--timeout-s", "3"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env=worker_env(redis_url))
    finally:
        stop.set()
        sender.join(timeout=60)
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["WORKER", "DEVICE", "MODELS", "IN-FLIGHT", "PENDING", "REQ/S"]
    row = next(li for li in lines if li.startswith("test-cpu@")).split()
    assert row[1] == "cpu"
    assert set(row[2].split(",")) == {"identity", "mlp", "sleep", "poison", "affine", "affine3"}
    assert int(row[3]) >= 0 and int(row[4]) >= 0
    assert float(row[5]) > 0
    queue_rows = {li.split()[0]: int(li.split()[1]) for li in lines if li.startswith("infer.")}
    assert "infer.identity" in queue_rows and queue_rows["infer.identity"] >= 0


def _failure_lines(log: str, request_id: str) -> list[str]:
    return [line for line in log.splitlines() if request_id in line]


def _wait_for_line(proc: WorkerProcess, needle: str) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = proc.log()
        if needle in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in the worker log:\n{proc.log()[-3000:]}")


def test_one_log_line_per_failed_request(worker, client) -> None:
    # Given a request that fails in the model
    future = client.submit("poison", -np.ones((1, 1), np.float32), request_id="fail-" + uuid.uuid4().hex)
    with pytest.raises(Exception, match="negative input"):
        future.result(timeout=60)
    # Then the worker's log names it in exactly one line: ID, model, worker, reason
    log = _wait_for_line(worker, f"request {future.id} failed:")
    lines = _failure_lines(log, future.id)
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0]
    assert (f"request {future.id} failed: model=poison worker=test-cpu@" in lines[0]
            and "reason=ModelError: " in lines[0] and "negative input poisons this model" in lines[0])


def test_stock_celery_path_logs_once_and_counts(redis_url, tmp_path) -> None:
    from asyncinfer.client import Client

    # Given Celery's own worker command, with metrics from the environment
    port = free_port()
    env = worker_env(redis_url, ASYNCINFER_MODEL_FACTORIES="stock_poison=tests.support.models:Poison",
                     ASYNCINFER_DEVICE="cpu", ASYNCINFER_METRICS_PORT=str(port))
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-Q", "infer.stock_poison",
            "-n", "stock-cpu@%h", "-c", "4", "-l", "INFO"]
    proc = WorkerProcess(argv, env, tmp_path / "stock.log").wait_ready()
    try:
        with Client(broker_url=redis_url) as client:
            good = client.infer("stock_poison", np.ones((2, 1), np.float32), timeout_s=60)
            assert good["output"].tolist() == [[2.0], [2.0]]
            bad = client.submit("stock_poison", -np.ones((1, 1), np.float32))
            with pytest.raises(Exception, match="negative input"):
                bad.result(timeout=60)
        # Then one log line names the failure, and the metrics count both outcomes
        log = _wait_for_line(proc, f"request {bad.id} failed:")
        lines = [line for line in _failure_lines(log, bad.id)
                 if "WARNING" in line or "ERROR" in line]
        assert len(lines) == 1, lines
        assert "model=stock_poison worker=stock-cpu@" in lines[0] and "reason=ModelError" in lines[0]
        m = scrape(port)
        labels = {"model": "stock_poison", "device": "cpu"}
        assert value(m, "asyncinfer_inference_request_success_total", **labels) == 1
        assert value(m, "asyncinfer_inference_request_failure_total", reason="ModelError",
                     **labels) == 1
        assert value(m, "asyncinfer_inference_batch_size_sum", **labels) == 2
    finally:
        proc.stop()
