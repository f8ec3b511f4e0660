"""The cross-worker pipeline: preprocess on a CPU worker → infer on the device worker → postprocess."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from asyncinfer.constants import CPU_QUEUE
from tests.support.processes import WorkerProcess, worker_env

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cpu_worker(redis_url, worker, tmp_path_factory):
    """A Celery worker for the CPU stages (it loads no model until asked)."""
    argv = [sys.executable, "-m", "celery", "-A", "asyncinfer", "worker", "-Q", CPU_QUEUE,
            "-n", "cpu-stages@%h", "-c", "4", "-l", "INFO"]
    proc = WorkerProcess(argv, worker_env(redis_url, ASYNCINFER_DEVICE="cpu"),
                         tmp_path_factory.mktemp("cpu") / "cpu.log").wait_ready()
    yield proc
    proc.stop()


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_staged_chain_gives_what_one_worker_gives(client, cpu_worker, serializer) -> None:
    x = np.array([[1.0], [2.5]], np.float32)
    # Given the same request run whole on the device worker, and as a three-task chain
    whole = client.infer("affine3", x, timeout_s=60, serializer=serializer)
    staged = client.submit_staged("affine3", x, serializer=serializer).result(timeout=60)
    # Then both give (x + 1) × 10 − 1
    assert whole["output"].tolist() == [[19.0], [34.0]]
    assert staged["output"].tolist() == [[19.0], [34.0]]
    assert staged.parameters["stages"] == ["asyncinfer.preprocess", "asyncinfer.infer",
                                           "asyncinfer.postprocess"]
    # and the device worker ran only the forward (its worker name is in the response)
    assert staged.parameters["worker"].startswith("test-cpu@")


def test_staged_chain_reports_bad_input_from_the_first_stage(client, cpu_worker) -> None:
    from asyncinfer.errors import InvalidRequest

    future = client.submit_staged("affine3", np.ones((1, 2), np.float32))
    with pytest.raises(InvalidRequest, match=r"shape \[1, 2\] does not match \[n, 1\]"):
        future.result(timeout=60)


def test_a_chain_may_pass_the_request_positionally(client, cpu_worker) -> None:
    # A producer's own chain: its first task returns a v2 request that asyncinfer.infer takes
    from celery import signature

    request = {"model": "identity", "inputs": [
        {"name": "x", "shape": [1, 2], "datatype": "INT32", "data": [7, 8]}]}
    result = signature("asyncinfer.infer", args=(request,), queue="infer.identity",
                       app=client.app).apply_async()
    assert result.get(timeout=60)["outputs"][0]["data"] == [7, 8]


def test_a_failure_on_the_device_stage_reaches_the_chains_future(client, cpu_worker) -> None:
    from asyncinfer.errors import ModelError

    future = client.submit_staged("affine3", np.array([[1000.0]], np.float32))
    with pytest.raises(ModelError, match="affine3 refuses values over 999"):
        future.result(timeout=60)
