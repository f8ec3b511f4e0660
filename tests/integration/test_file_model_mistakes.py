"""A client's mistakes with a model file, end to end: a real worker hosting a ``torch.export``
program (``exported.pt2``) and a TorchScript one (``scripted.pt``) from a model folder, behind a
real gateway, called over HTTP.

The worker reads each program's signature at load (models/program_signature.py): a request that
does not fit — a wrong or missing name, an input too many, a wrong datatype, shape or rank — is a
400 naming the input and the rule, in one line, and the worker serves the next request. A
TorchScript file says no shapes or datatypes: its names and count are checked; a wrong shape is
the program's own error, in one line too.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support.databases import RedisDatabases
from tests.support.processes import (
    GatewayProcess,
    WorkerProcess,
    launch_gateway,
    launch_worker,
    ready_together,
    stop_together,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)


class Pair(torch.nn.Module):
    """``features`` FP32 [n, 4] and ``ids`` INT64 [n, 3] → their outputs, in that order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, features: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(features), ids * 2


@pytest.fixture(scope="module")
def served(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[WorkerProcess, GatewayProcess]]:
    """A worker hosting ``exported`` and ``scripted``, and a gateway in front of it."""
    folder = tmp_path_factory.mktemp("file_model_mistakes")
    models = folder / "models"
    models.mkdir()
    batch = torch.export.Dim("batch", min=1, max=1024)
    example = (torch.randn(2, 4), torch.zeros(2, 3, dtype=torch.int64))
    torch.export.save(torch.export.export(Pair(), example, dynamic_shapes=({0: batch}, {0: batch})),
                      str(models / "exported.pt2"))
    torch.jit.script(Pair()).save(str(models / "scripted.pt"))
    with redis_databases.take("test_file_model_mistakes") as db:
        procs = ready_together([
            launch_worker(db.url, folder / "worker.log", "--device", "cpu", "--models",
                          "exported,scripted", ASYNCINFER_MODEL_DIR=str(models)),
            launch_gateway(db.url, folder / "gateway.log")])
        try:
            worker, gateway = procs
            assert isinstance(gateway, GatewayProcess)
            for model in ("exported", "scripted"):
                wait_for(lambda m=model: _call(gateway, f"/v2/models/{m}/ready")[0] == 200, 60,
                         f"{model} ready at the gateway")
            yield worker, gateway
        finally:
            stop_together(procs)


@pytest.fixture()
def gateway(served: tuple[WorkerProcess, GatewayProcess]) -> GatewayProcess:
    return served[1]


def _call(gateway: GatewayProcess, path: str, body: dict[str, Any] | None = None
          ) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://{gateway.http_url}{path}", data=data,
                                     headers={"Content-Type": "application/json"},
                                     method="POST" if data is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    count = 1
    for d in shape:
        count *= d
    element: Any = {"BYTES": "x", "BOOL": False}.get(datatype, 1)
    return {"name": name, "datatype": datatype, "shape": shape, "data": [element] * count}


GOOD = [_tensor("ids", "INT64", [2, 3]), _tensor("features", "FP32", [2, 4])]  # any order


def _infer(gateway: GatewayProcess, model: str, inputs: list[dict[str, Any]], request_id: str
           ) -> tuple[int, str]:
    return _call(gateway, f"/v2/models/{model}/infer", {"id": request_id, "inputs": inputs})


def _answered(gateway: GatewayProcess, model: str) -> None:
    """A good request is answered: the worker still serves."""
    status, text = _infer(gateway, model, GOOD, "good")
    assert status == 200, text
    outputs = {o["name"]: o for o in json.loads(text)["outputs"]}
    assert outputs["output_0"]["shape"] == [2, 2]
    assert outputs["output_1"]["data"] == [2] * 6


def _one_line(text: str) -> str:
    """The error of a v2 error body, which must hold no traceback."""
    assert "Traceback" not in text and 'File "' not in text, text
    error = json.loads(text)["error"]
    assert "\n" not in error
    return str(error)


NAMES_AND_COUNT = [
    ("a-wrong-name", [_tensor("input", "FP32", [2, 4]), _tensor("ids", "INT64", [2, 3])],
     "model '{model}' needs input(s) 'features'; got 'ids', 'input'"),
    ("one-missing", [_tensor("features", "FP32", [2, 4])],
     "model '{model}' needs input(s) 'ids'; got 'features'"),
    ("one-too-many", [*GOOD, _tensor("mask", "BOOL", [2, 3])],
     "input 'mask' is not an input of model '{model}' (inputs: 'features', 'ids')"),
]
EXPORTED_ONLY = [
    ("a-wrong-datatype", [_tensor("features", "INT64", [2, 4]), _tensor("ids", "INT64", [2, 3])],
     "input 'features': datatype INT64 is not accepted (accepted: FP32)"),
    ("a-wrong-shape", [_tensor("features", "FP32", [2, 5]), _tensor("ids", "INT64", [2, 3])],
     "input 'features': shape [2, 5] does not match [n, 4]"),
    ("a-wrong-rank", [_tensor("features", "FP32", [2, 4]), _tensor("ids", "INT64", [2, 3, 1])],
     "input 'ids': shape [2, 3, 1] does not match [n, 3]"),
]


@pytest.mark.parametrize(("model", "request_id", "inputs", "rule"), [
    *(("exported", *case) for case in NAMES_AND_COUNT + EXPORTED_ONLY),
    *(("scripted", *case) for case in NAMES_AND_COUNT),
    ("scripted", "bytes", [_tensor("features", "BYTES", [2]), _tensor("ids", "INT64", [2, 3])],
     "input 'features': datatype BYTES is not accepted (accepted: FP32, BOOL, "),
])
def test_a_request_that_does_not_fit_a_model_file_is_a_400_naming_the_input_and_the_rule(
        gateway: GatewayProcess, model: str, request_id: str, inputs: list[dict[str, Any]],
        rule: str) -> None:
    # When the mistake is sent
    status, text = _infer(gateway, model, inputs, request_id)
    # Then it is a 400 whose one line names the request, the input and the rule, no traceback
    assert status == 400, text
    named, words = _one_line(text).split(": ", 1)
    assert named.startswith("request ") and words.startswith(rule.format(model=model)), text
    # and the worker answers the next request
    _answered(gateway, model)


def test_a_wrong_shape_for_a_torchscript_file_is_the_programs_error_in_one_line(
        gateway: GatewayProcess) -> None:
    # Given a TorchScript file, which says no shapes: When a wrong shape is sent
    status, text = _infer(gateway, "scripted", [_tensor("features", "FP32", [2, 5]),
                                                _tensor("ids", "INT64", [2, 3])], "ts-shape")
    # Then the program's own error comes back in one line, and the worker still serves
    assert status == 500, text
    error = _one_line(text)
    assert error.startswith("ModelError: request ") and (
        "model 'scripted' raised RuntimeError: " in error), error
    assert "(2x5 and 4x2)" in error
    _answered(gateway, "scripted")


def test_the_metadata_shows_the_inputs_each_program_declares(gateway: GatewayProcess) -> None:
    status, text = _call(gateway, "/v2/models/exported")
    assert status == 200, text
    assert json.loads(text) == {
        "name": "exported", "versions": ["1"], "platform": "torch_export",
        "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]},
                   {"name": "ids", "datatype": "INT64", "shape": [-1, 3]}],
        "outputs": [{"name": "output_0", "datatype": "FP32", "shape": [-1, 2]},
                    {"name": "output_1", "datatype": "INT64", "shape": [-1, 3]}]}
    status, text = _call(gateway, "/v2/models/scripted")
    assert status == 200, text
    meta = json.loads(text)
    assert meta["platform"] == "pytorch_libtorch"
    assert [t["name"] for t in meta["inputs"]] == ["features", "ids"] and meta["outputs"] == []


def test_the_exported_program_is_warmed_up_and_the_torchscript_one_is_not(
        served: tuple[WorkerProcess, GatewayProcess]) -> None:
    log = served[0].log()
    assert "model exported warmed up at batch sizes 1, 2, 4, 8, 16, 32" in log
    assert "model scripted warmed up" not in log and "warm-up raised" not in log
