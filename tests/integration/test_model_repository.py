"""A Triton model repository served as it is, end to end: a TorchScript model, a ``torch.export``
model and an ONNX model (two versions), each with its ``config.pbtxt``, built by the test from
small modules; served by ``asyncinfer up --model-dir`` and by ``asyncinfer worker --model-dir``,
called through tritonclient's HTTP and gRPC clients and the ``Client``; the model configuration
the gateway answers is the repository's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format, text_format

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.models.proto import model_config_pb2
from asyncinfer.supervision.processes import pid_alive
from tests.support.model_repository import FACTORS, build_repository, scaled
from tests.support.processes import ROOT, WorkerProcess, embedded_up_env, start_gateway, worker_env

pytestmark = pytest.mark.timeout(240)

#: What the version policies serve (onnx: every version; the others their latest); named, so that
#: the built-in models (minilm's weights) are not loaded too.
SERVED = "scripted,exported,onnx,onnx@1"
ROWS = [[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, -1.0, 2.0]]
#: (model, version asked for, output, the factor that answers).
CALLS = [("scripted", "", "output", 2.0), ("exported", "", "output", 3.0),
         ("onnx", "", "y", FACTORS[("onnx", "2")]), ("onnx", "1", "y", FACTORS[("onnx", "1")]),
         ("onnx", "2", "y", FACTORS[("onnx", "2")])]


def _asyncinfer(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncinfer", *args], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env=env)


def _call_all(http_url: str, grpc_url: str, broker_url: str) -> None:
    """Every model and version answers through tritonclient HTTP and gRPC and the Client."""
    x = np.array(ROWS, np.float32)
    http = httpclient.InferenceServerClient(http_url)
    grpc = grpcclient.InferenceServerClient(grpc_url)
    try:
        for model, version, output, factor in CALLS:
            want = scaled(ROWS, factor)
            given = httpclient.InferInput("x", [2, 4], "FP32")
            given.set_data_from_numpy(x)
            answer = http.infer(model, [given], model_version=version)
            assert answer.as_numpy(output).tolist() == want, (model, version, "http")
            given = grpcclient.InferInput("x", [2, 4], "FP32")
            given.set_data_from_numpy(x)
            answer = grpc.infer(model, [given], model_version=version)
            assert answer.as_numpy(output).tolist() == want, (model, version, "grpc")
        settings = Settings.from_env(environ={"ASYNCINFER_BROKER_URL": broker_url})
        with Client(settings=settings) as client:
            for model, version, output, factor in CALLS:
                parameters = {"model_version": version} if version else None
                response = client.infer(model, {"x": x}, parameters=parameters, timeout_s=60)
                assert response[output].tolist() == scaled(ROWS, factor), (model, version)
        _configs_match(http, grpc)
    finally:
        http.close()
        grpc.close()


def _configs_match(http: Any, grpc: Any) -> None:
    """The configuration each front answers holds what the repository's config.pbtxt says."""
    from tests.support.model_repository import CONFIGS

    for model, text in CONFIGS.items():
        wanted = json_format.MessageToDict(text_format.Parse(text, model_config_pb2.ModelConfig()),
                                           preserving_proto_field_name=True)
        for got in (http.get_model_config(model),
                    grpc.get_model_config(model, as_json=True)["config"]):
            assert got["name"] == model and got["platform"] == wanted["platform"]
            assert int(got["max_batch_size"]) == wanted["max_batch_size"]
            for kind in ("input", "output"):
                assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]])
                        for t in got[kind]] == [(t["name"], t["data_type"],
                                                 [int(d) for d in t["dims"]])
                                                for t in wanted[kind]], (model, kind)
            batching = wanted.get("dynamic_batching", {})
            got_batching = got.get("dynamic_batching", {})
            assert [int(s) for s in got_batching.get("preferred_batch_size", [])] == [
                int(s) for s in batching.get("preferred_batch_size", [])], model
            assert int(got_batching.get("max_queue_delay_microseconds", 0)) == int(
                batching.get("max_queue_delay_microseconds", 0)), model
            count = sum(int(g.get("count", 1)) for g in wanted.get("instance_group", [])) or 1
            assert sum(int(g.get("count", 1)) for g in got.get("instance_group", [])) == count


def test_up_serves_a_triton_model_repository(tmp_path: Path) -> None:
    repository = build_repository(tmp_path / "models")
    state = tmp_path / "state"
    env = embedded_up_env(state)
    pid_file = state / "up.pid"
    try:
        up = _asyncinfer(env, "up", "--detach", "--devices", "cpu", "--model-dir",
                         str(repository), "--models", SERVED)
        assert up.returncode == 0, up.stdout + up.stderr
        models = json.loads(_asyncinfer(env, "models", "--json").stdout)
        assert models["onnx"]["versions"] == ["1", "2"] and models["scripted"]["ready"]
        broker_url = (state / "redis" / "broker_url").read_text().strip()
        _call_all(f"127.0.0.1:{env['ASYNCINFER_HTTP_PORT']}",
                  f"127.0.0.1:{env['ASYNCINFER_GRPC_PORT']}", broker_url)
    finally:
        down = _asyncinfer(env, "down", "--purge")
        if pid_file.exists():  # a failed test leaves nothing running
            pid = int(pid_file.read_text())
            if pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
    assert down.returncode == 0, down.stderr


def test_worker_serves_a_triton_model_repository(redis_db: Any, tmp_path: Path) -> None:
    repository = build_repository(tmp_path / "models")
    env = worker_env(redis_db.url)
    env.pop("ASYNCINFER_MODEL_FACTORIES", None)
    worker = WorkerProcess([sys.executable, "-m", "asyncinfer", "worker", "--device", "cpu",
                            "--model-dir", str(repository), "--models", SERVED], env,
                           tmp_path / "worker.log")
    gateway = None
    try:
        worker.wait_ready()
        gateway = start_gateway(redis_db.url, tmp_path / "gateway.log")
        _call_all(gateway.http_url, gateway.grpc_url, redis_db.url)
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
