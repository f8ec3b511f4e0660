"""A pool that forks runs no model: one lifecycle, the pipeline, in the process that owns the
device. The app's configuration names the threads pool (``-P prefork`` cannot override it), so
these workers use a configuration that asks for prefork (tests/support/prefork_app.py), as a
user's own could."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import InvalidRequest
from asyncinfer.supervision.supervisor import CANNOT_START
from tests.support.databases import RedisDatabases
from tests.support.processes import ROOT, WorkerProcess, worker_env
from tests.support.producer import json_producer

pytestmark = pytest.mark.timeout(120)

STAGE_QUEUE = "prefork.cpu"


def _argv(queues: str, name: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tests.support.prefork_app", "worker", "-c", "1",
            "-Q", queues, "-n", f"{name}@%h", "-l", "INFO"]


@pytest.fixture(scope="module")
def db_url(redis_databases: RedisDatabases) -> Iterator[str]:
    with redis_databases.take("test_prefork") as db:
        yield db.url


def test_a_device_worker_with_a_forking_pool_refuses_to_start_naming_the_rule(db_url: str) -> None:
    done = subprocess.run(_argv("infer.mlp", "prefork-device"), cwd=ROOT, capture_output=True,
                          text=True, timeout=90, env=worker_env(db_url, ASYNCINFER_DEVICE="cpu"))
    assert done.returncode == CANNOT_START, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "cannot start" in line]
    assert len(lines) == 1, done.stderr[-2000:]
    assert "a device worker (queues infer.mlp) runs the threads or solo pool, not prefork" in lines[0]
    assert "Traceback" not in done.stderr


@pytest.fixture(scope="module")
def stage_worker(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(_argv(STAGE_QUEUE, "prefork-stage"),
                         worker_env(db_url, ASYNCINFER_DEVICE="cpu"),
                         tmp_path_factory.mktemp("prefork") / "worker.log").wait_ready()
    yield proc
    proc.stop()


def test_a_prefork_worker_refuses_inference_by_request_and_goes_on_serving(
        db_url: str, stage_worker: WorkerProcess) -> None:
    app = json_producer(db_url)
    request_id = "prefork-" + uuid.uuid4().hex
    refused = app.send_task(TASK_NAME, task_id=request_id, queue=STAGE_QUEUE, kwargs={
        "model": "mlp", "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                    "data": [0.5] * 16}]})
    with pytest.raises(InvalidRequest) as err:
        refused.get(timeout=30)
    assert str(err.value) == (
        f"request {request_id}: {TASK_NAME} is refused by a worker whose pool forks (prefork): a "
        f"model runs in the process that owns its device — run the threads or solo pool "
        f"(asyncinfer worker)")
    assert refused.state == "FAILURE"
    # and the worker goes on serving what it may run (Celery's own tasks: not a device worker)
    assert app.send_task("celery.accumulate", args=(1, 2), queue=STAGE_QUEUE).get(timeout=30) == [1, 2]
    assert stage_worker.process.poll() is None
    app.close()
