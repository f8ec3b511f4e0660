"""Producers that know only the wire contract: a bare Celery app, redis-cli, and refused pickle."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

from asyncinfer.errors import InvalidRequest
from tests.support.processes import ROOT

pytestmark = pytest.mark.timeout(120)

BARE_PRODUCER = r"""
import json, sys
from celery import Celery
app = Celery("producer", broker=sys.argv[1], backend=sys.argv[1])
app.conf.update(task_serializer="json", accept_content=["json"], result_accept_content=["json"])
request = {"model": "identity",
           "inputs": [{"name": "words", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
                      {"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}]}
result = app.send_task("asyncinfer.infer", kwargs=request, queue="infer.identity")
response = result.get(timeout=60)
assert "asyncinfer" not in sys.modules, "the producer must not need asyncinfer"
print(json.dumps({"id": result.id, "response": response}))
"""


def test_bare_celery_app_gets_the_v2_response(worker, redis_url) -> None:
    out = subprocess.run([sys.executable, "-c", BARE_PRODUCER, redis_url], capture_output=True,
                         text=True, timeout=90, cwd="/")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    response = doc["response"]
    assert response["id"] == doc["id"] and response["model_name"] == "identity"
    outputs = {o["name"]: o for o in response["outputs"]}
    assert outputs["words"] == {"name": "words", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}
    assert outputs["x"] == {"name": "x", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}
    assert response["parameters"]["batch_size"] == 2


def test_redis_cli_producer_from_the_readme(worker, redis_url) -> None:
    from asyncinfer.ops.redis_server import redis_server_binary

    url = urlparse(redis_url)
    cli = str(Path(redis_server_binary()).with_name("redis-cli"))
    request_id = "cli-" + uuid.uuid4().hex
    out = subprocess.run(["bash", str(ROOT / "examples" / "redis_cli_producer.sh")], capture_output=True,
                         text=True, timeout=90,
                         env={"PATH": "/usr/bin:/bin", "REDIS_CLI": cli, "REDIS_HOST": url.hostname or "",
                              "REDIS_PORT": str(url.port), "REQUEST_ID": request_id})
    assert out.returncode == 0, out.stderr
    meta = json.loads(out.stdout)
    assert meta["status"] == "SUCCESS" and meta["task_id"] == request_id
    assert meta["result"]["id"] == request_id
    assert meta["result"]["outputs"] == [
        {"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1.5, 2.0, 3.0]}]


class _Tripwire:
    """Unpickling this would create a file: proof that a refused message was never deserialized."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def stock_worker(redis_url, worker, tmp_path_factory):
    """A worker started by ``celery -A asyncinfer worker`` for model ``echo``."""
    from tests.integration.test_cli import start_worker_with_celery

    proc = start_worker_with_celery(redis_url, tmp_path_factory.mktemp("stock"))
    yield proc
    proc.stop()


@pytest.mark.parametrize("model", ["identity", "echo"], ids=["fast-consumer", "celery-consumer"])
def test_pickle_message_is_refused_and_never_executed(client, stock_worker, tmp_path, model) -> None:
    from kombu import Connection

    marker = tmp_path / "unpickled"
    request_id = "pickle-" + uuid.uuid4().hex
    body = pickle.dumps(((), {"model": model, "inputs": [_Tripwire(str(marker))]}, {}))
    with Connection(client.app.conf.broker_url) as conn:
        producer = conn.Producer()
        producer.publish(body, routing_key=f"infer.{model}", content_type="application/x-python-serialize",
                         content_encoding="binary", serializer=None,
                         headers={"task": "asyncinfer.infer", "id": request_id, "lang": "py"},
                         declare=[])
    # The refusal is stored as a FAILURE that names the request and the rule
    refused = rf"request {request_id}: content type .* is refused: only json and msgpack .* never pickle"
    with pytest.raises(InvalidRequest, match=refused):
        client.result(request_id, timeout_s=60)
    assert not marker.exists()
    # and the worker keeps serving
    assert client.infer(model, np.array([[1]], np.int8), timeout_s=60)["input"].tolist() == [[1]]


def test_clients_never_accept_pickle(client) -> None:
    conf = client.app.conf
    assert "pickle" not in conf.accept_content and "pickle" not in conf.result_accept_content
    assert conf.task_serializer in ("json", "msgpack") and conf.result_serializer in ("json", "msgpack")
