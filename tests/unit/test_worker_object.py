"""A device worker is one object, built and passed: two live in one process, each with its own
device runtime, models, metrics and name, and a unit test builds one without Celery's worker."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.errors import UnknownModel
from asyncinfer.worker.worker import Worker, attach, existing_worker, worker_of

pytestmark = pytest.mark.timeout(60)


def _request(model: str, name: str, width: int, value: float) -> dict:
    return {"model": model, "inputs": [{"name": name, "shape": [1, width], "datatype": "FP32",
                                        "data": [value] * width}]}


def _worker(name: str, models: tuple[str, ...]) -> Worker:
    settings = dataclasses.replace(Settings.from_env(device="cpu"), models=models,
                                   metrics_port=0)
    return Worker(create_app(settings), settings, name)


def test_two_workers_live_in_one_process() -> None:
    a, b = _worker("a@host", ("identity",)), _worker("b@host", ("mlp",))
    try:
        a.load(["identity"])
        b.load(["mlp"])
        # Each has its own runtime and models
        assert a.runtime is not b.runtime
        assert a.runtime.models == ["identity"] and b.runtime.models == ["mlp"]
        with pytest.raises(UnknownModel, match="not hosted by this worker"):
            a.runtime.runner("mlp")
        # Each answers with its own name and model
        first = a.runtime.infer("r-a", _request("identity", "x", 2, 3.0), worker=a.name)
        second = b.runtime.infer("r-b", _request("mlp", "input", 16, 1.0), worker=b.name)
        assert first["parameters"]["worker"] == "a@host" and first["model_name"] == "identity"
        assert np.allclose(first["outputs"][0]["data"], [3.0, 3.0])
        assert second["parameters"]["worker"] == "b@host" and second["model_name"] == "mlp"
        assert second["outputs"][0]["shape"] == [1, 4]
        # and counts in its own metrics
        a.metrics.record_outcome("identity", a.runtime.device.label, "SUCCESS")
        assert a.metrics.throughput_per_s() > 0 and b.metrics.throughput_per_s() == 0
        assert a.metrics.registry is not b.metrics.registry
        assert a.info()["models"] == ["identity"] and b.info()["models"] == ["mlp"]
    finally:
        a.close()
        b.close()
    assert not a.has_runtime() and not b.has_runtime()


def test_an_app_has_one_worker_per_process_made_once() -> None:
    app = create_app(Settings.from_env(device="cpu"))
    assert existing_worker(app) is None
    made = worker_of(app)  # a task run in a process that Celery's worker did not start
    assert worker_of(app) is made and existing_worker(app) is made
    other = attach(app, _worker("other@host", ("identity",)))
    assert worker_of(app) is other
    assert not made.has_runtime()  # nothing touched a device
