"""Models without a batch dimension (Triton's ``max_batch_size: 0``): inputs of different first
dimensions, each request alone and whole, through tritonclient (HTTP, gRPC, a gRPC stream)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.databases import RedisDatabases
from tests.support.processes import TEST_FACTORIES, GatewayProcess, start_gateway, start_worker
from tests.support.unbatched_models import UNBATCHED_FACTORIES

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateway(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    factories = f"{TEST_FACTORIES},{UNBATCHED_FACTORIES}"
    with redis_databases.take("unbatched models") as db:
        logs = tmp_path_factory.mktemp("unbatched")
        worker = start_worker(db.url, logs / "worker.log", "--device", "cpu", "--models",
                              "repeat,planes", ASYNCINFER_MODEL_FACTORIES=factories)
        try:
            proc = start_gateway(db.url, logs / "gateway.log",
                                 ASYNCINFER_MODEL_FACTORIES=factories)
            try:
                yield proc
            finally:
                proc.stop()
        finally:
            worker.stop()


def test_the_config_says_max_batch_size_0_and_the_whole_shapes(gateway: GatewayProcess) -> None:
    http = httpclient.InferenceServerClient(gateway.http_url)
    try:
        config = http.get_model_config("planes")
        assert config["max_batch_size"] == 0
        assert [(t["name"], t["dims"]) for t in config["input"]] == [("data", [3, -1, -1])]
        assert http.get_model_metadata("repeat")["inputs"] == [
            {"name": "IN", "datatype": "INT32", "shape": [-1]},
            {"name": "DELAY", "datatype": "UINT32", "shape": [-1]},
            {"name": "WAIT", "datatype": "UINT32", "shape": [1]}]
    finally:
        http.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_request_runs_whole_with_its_own_shapes(gateway: GatewayProcess, protocol: str) -> None:
    lib: Any = httpclient if protocol == "http" else grpcclient
    client = lib.InferenceServerClient(gateway.http_url if protocol == "http"
                                       else gateway.grpc_url)
    try:
        for shape in ([3, 2, 4], [3, 5, 1]):
            data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
            x = lib.InferInput("data", shape, "FP32")
            x.set_data_from_numpy(data)
            result = client.infer("planes", [x])
            assert result.as_numpy("shape").tolist() == shape  # forward saw it as sent
            np.testing.assert_allclose(result.as_numpy("sums"), data.sum(axis=(1, 2)))
        bad = lib.InferInput("data", [2, 2, 2], "FP32")
        bad.set_data_from_numpy(np.zeros((2, 2, 2), np.float32))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("planes", [bad])
        assert "input 'data': shape [2, 2, 2] does not match [3, any, any]" in (
            refused.value.message())
    finally:
        client.close()


def test_a_decoupled_model_takes_inputs_of_different_first_dimensions(
        gateway: GatewayProcess) -> None:
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        values = np.array([4, 2, 0, 1], np.int32)
        inputs = [grpcclient.InferInput("IN", [4], "INT32"),
                  grpcclient.InferInput("DELAY", [4], "UINT32"),
                  grpcclient.InferInput("WAIT", [1], "UINT32")]
        inputs[0].set_data_from_numpy(values)
        inputs[1].set_data_from_numpy(np.zeros(4, np.uint32))
        inputs[2].set_data_from_numpy(np.zeros(1, np.uint32))
        client.async_stream_infer("repeat", inputs, request_id="r")
        got = []
        for _ in range(4):
            result, error = responses.get(timeout=60)
            assert error is None, error
            got.append((int(result.as_numpy("OUT")[0]), int(result.as_numpy("IDX")[0])))
        assert got == [(4, 0), (2, 1), (0, 2), (1, 3)]
    finally:
        client.stop_stream()
        client.close()
