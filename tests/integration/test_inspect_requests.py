"""``celery inspect active / reserved / scheduled`` show a fast-consumer worker's requests, with
Celery's request fields; and ``celery -A asyncinfer worker -Q infer.M`` runs the fast consumer."""

from __future__ import annotations

import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.constants import TASK_NAME
from tests.support.databases import RedisDatabases, gated_broker, gated_executions
from tests.support.processes import WorkerProcess, start_worker, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


def _index(i: float) -> dict[str, np.ndarray]:
    return {"index": np.array([[float(i)]], np.float64)}


@pytest.fixture()
def gated_db(redis_databases: RedisDatabases) -> Iterator[str]:
    with redis_databases.take("inspect-requests") as db:
        yield db.url


def _ids(replies: dict | None, node: str) -> set[str]:
    return {r["id"] for r in (replies or {}).get(node, [])}


def test_inspect_shows_requests_on_the_device_waiting_and_scheduled(gated_db: str,
                                                                    tmp_path: Path) -> None:
    prefix, r, env = gated_broker(gated_db, "inspect")
    node = f"inspect@{socket.gethostname()}"
    r.set(f"{prefix}:gate", "closed")
    proc = start_worker(gated_db, tmp_path / "worker.log", "--device", "cpu", "--models", "gated",
                        "--hostname", "inspect@%h", "--concurrency", "8", **env)
    try:
        with Client(broker_url=gated_db) as client:
            first = client.submit("gated", _index(0))
            wait_for(lambda: r.get(f"{prefix}:blocked"), 30, "the first batch on the device")
            waiting = [client.submit("gated", _index(i)) for i in range(1, 4)]
            later_id = str(uuid.uuid4())
            client.app.send_task(TASK_NAME, queue="infer.gated", task_id=later_id, countdown=60,
                                 kwargs={"model": "gated", "inputs": [{"name": "index", "shape": [1, 1],
                                                                       "datatype": "FP64", "data": [9]}]})
            inspect = client.app.control.inspect(destination=[node], timeout=5)
            wait_for(lambda: len(_ids(inspect.reserved(), node)) == 3, 30, "three reserved")
            active = inspect.active()[node]
            assert [a["id"] for a in active] == [first.id]
            assert active[0]["name"] == TASK_NAME and active[0]["hostname"] == node
            assert active[0]["delivery_info"]["routing_key"] == "infer.gated"
            assert active[0]["time_start"] > 0 and active[0]["worker_pid"] == proc.pid
            assert _ids(inspect.reserved(), node) == {f.id for f in waiting}
            wait_for(lambda: _ids({node: [s["request"] for s in (inspect.scheduled() or {})
                                          .get(node, [])]}, node) == {later_id}, 30, "scheduled")
            [scheduled] = inspect.scheduled()[node]
            assert scheduled["eta"] and scheduled["request"]["id"] == later_id
            r.delete(f"{prefix}:gate")
            assert [f.result(timeout=30)["output"].item() for f in [first, *waiting]] == [0, 1, 2, 3]
            # the worker lets go of a request just after its answer is out: within moments
            wait_for(lambda: _ids(inspect.active(), node) == set(), 10, "nothing active")
            wait_for(lambda: _ids(inspect.reserved(), node) == set(), 10, "nothing reserved")
            assert gated_executions(r, prefix) == {0: 1, 1: 1, 2: 1, 3: 1}
    finally:
        proc.stop()
        r.close()


def test_celery_worker_command_runs_the_fast_consumer_on_its_infer_queues(gated_db: str,
                                                                          tmp_path: Path) -> None:
    # the command a Celery user types: the app's bootstep gives infer.* to the fast consumer
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-Q", "infer.identity",
            "-n", "celerycmd@%h", "-l", "info"]
    proc = WorkerProcess(argv, worker_env(gated_db), tmp_path / "worker.log").wait_ready()
    try:
        log = proc.log()
        assert "fast consumer on infer.identity" in log
        assert ".> asyncinfer.control" in log  # Celery's consumer keeps remote control
        with Client(broker_url=gated_db) as client:
            out = client.infer("identity", {"x": np.arange(3, dtype=np.float32).reshape(1, 3)},
                               timeout_s=60)
            assert out["x"].tolist() == [[0.0, 1.0, 2.0]]
            node = f"celerycmd@{socket.gethostname()}"
            queues = {q["name"] for q in client.app.control.inspect(
                destination=[node], timeout=5).active_queues()[node]}
            assert queues == {"infer.identity", "asyncinfer.control"}
    finally:
        proc.stop()
    # the banner (on stdout: complete once the worker is gone) tells the fast consumer's truth
    banner = [line for line in proc.log().splitlines() if ".> " in line]
    assert any(line.endswith(".> infer.identity (fast consumer)") for line in banner), banner
    assert not any(":**@" in line for line in banner), banner


def test_celery_worker_command_keeps_the_stock_consumer_when_asked(gated_db: str,
                                                                   tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-Q", "infer.identity",
            "-n", "celerystock@%h", "-l", "info"]
    env = worker_env(gated_db, ASYNCINFER_CONSUMER="celery")
    proc = WorkerProcess(argv, env, tmp_path / "worker.log").wait_ready()
    try:
        assert "fast consumer" not in proc.log()
        with Client(broker_url=gated_db) as client:
            out = client.infer("identity", {"x": np.ones((1, 2), np.float32)}, timeout_s=60)
            assert out["x"].tolist() == [[1.0, 1.0]]
    finally:
        proc.stop()
