"""Model control across the fleet (Triton's model repository extension), end to end: real Redis,
real worker processes, a real gateway process, Triton's own client.

After an unload, a model that another worker still hosts is served there; one that nobody hosts
any more stays known (the catalogue's retention) and its requests wait in its queue, as for a
fleet scaled to zero, until a worker loads it again (docs/operations.md).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from tests.support.marks import FORWARD_MARKS_ENV, ForwardMarks
from tests.support.model_control import BIG_BYTES, rss_bytes
from tests.support.processes import (
    TEST_FACTORIES,
    GatewayProcess,
    WorkerProcess,
    start_gateway,
    start_worker,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

FACTORIES = TEST_FACTORIES + ",big=tests.support.model_control:Big"
HOST = socket.gethostname()


def _worker(url: str, tmp_path: Path, name: str, models: str, **env: str) -> WorkerProcess:
    return start_worker(url, tmp_path / f"{name}.log", "--device", "cpu", "--models", models,
                        "--hostname", f"{name}@%h", ASYNCINFER_MODEL_FACTORIES=FACTORIES,
                        **{FORWARD_MARKS_ENV: url}, **env)


def _client(url: str) -> Client:
    return Client(settings=Settings.from_env(environ={"ASYNCINFER_BROKER_URL": url,
                                                     "ASYNCINFER_MODEL_FACTORIES": FACTORIES}))


@pytest.fixture()
def fleet(redis_db, tmp_path) -> Iterator[tuple[WorkerProcess, GatewayProcess, Client]]:
    """One worker hosting identity (its model folder holds a file that is no model), a gateway."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "bad.pt").write_bytes(b"this is not a TorchScript archive")
    worker = _worker(redis_db.url, tmp_path, "a", "identity", ASYNCINFER_MODEL_DIR=str(models))
    gateway = None
    client = _client(redis_db.url)
    try:
        gateway = start_gateway(redis_db.url, tmp_path / "gateway.log")
        yield worker, gateway, client
    finally:
        client.close()
        if gateway is not None:
            gateway.stop()
        worker.stop()


def _index(rows: list[dict[str, str]]) -> dict[str, tuple[str, str]]:
    return {r["name"]: (r["state"], r.get("reason", "")) for r in rows}


def test_load_infer_unload_and_failed_loads_through_tritonclient(fleet) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    worker, gateway, client = fleet
    http = httpclient.InferenceServerClient(gateway.http_url, network_timeout=120.0)
    grpc = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        # Given a worker hosting identity only: the index says what it could load
        index = _index(http.get_model_repository_index())
        assert index["identity"] == ("READY", "")
        assert index["affine"][0] == "UNAVAILABLE" and f"a@{HOST}" in index["affine"][1]
        assert not http.is_model_ready("affine")

        # When affine is loaded through Triton's client, Then it is ready and serves
        http.load_model("affine")
        assert http.is_model_ready("affine")
        assert _index(http.get_model_repository_index())["affine"] == ("READY", "")
        x = np.array([[1.0, 2.0, 3.0]], np.float64)
        inp = httpclient.InferInput("x", [1, 3], "FP64")
        inp.set_data_from_numpy(x)
        out = http.infer("affine", [inp]).as_numpy("y")
        assert out.tolist() == (x * 3 + 1).tolist()
        assert [h.worker for h in client.models()["affine"].hosts] == [f"a@{HOST}"]

        # A failed load answers with the reason and the worker serves on
        with pytest.raises(InferenceServerException, match="'nosuch' is not registered"):
            http.load_model("nosuch")
        with pytest.raises(InferenceServerException, match="'bad' failed to load on cpu"):
            http.load_model("bad")
        with pytest.raises(InferenceServerException, match="parameter 'config' is not supported"):
            http.load_model("affine", config='{"max_batch_size": 8}')
        assert http.infer("affine", [inp]).as_numpy("y").tolist() == (x * 3 + 1).tolist()
        assert client.infer("identity", np.ones((2, 2), np.float32), timeout_s=60)[
            "input"].tolist() == [[1, 1], [1, 1]]
        assert "bad" not in client.models()

        # Over gRPC: the index, an unload, a load again
        rows = {m.name: m for m in grpc.get_model_repository_index().models}
        assert rows["affine"].state == "READY" and rows["identity"].state == "READY"
        grpc.unload_model("affine")
        assert not grpc.is_model_ready("affine")
        rows = {m.name: m for m in grpc.get_model_repository_index().models}
        assert rows["affine"].state == "UNAVAILABLE" and "no live worker" in rows["affine"].reason
        ready = urllib.request.urlopen(urllib.request.Request(  # tritonclient sends no 'ready'
            f"http://{gateway.http_url}/v2/repository/index", data=b'{"ready": true}',
            method="POST"), timeout=30)
        assert [r["name"] for r in json.load(ready)] == ["identity"]
        with pytest.raises(InferenceServerException, match="no live worker hosts it"):
            grpc.unload_model("affine")
        grpc.load_model("affine")
        assert grpc.is_model_ready("affine")
        assert http.infer("affine", [inp]).as_numpy("y").tolist() == (x * 3 + 1).tolist()
    finally:
        http.close()
        grpc.close()
