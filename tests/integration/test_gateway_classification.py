"""Triton's classification extension through the gateway, and the Triton parameters it refuses,
driven by tritonclient (HTTP and gRPC) against a real gateway and a real worker.

The worker hosts ``scores`` (its output is its input, four classes with labels: the expected
strings are known exactly), ``scores-whole`` (the same, not batching), ``mlp`` (no labels),
``identity`` (any datatype) and ``echo-stream`` (a declared BYTES output).
"""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.support.databases import RedisDatabases
from tests.support.processes import (
    TEST_FACTORIES,
    GatewayProcess,
    start_gateway,
    start_worker,
)

pytestmark = pytest.mark.timeout(120)

FACTORIES = (f"{TEST_FACTORIES},scores=tests.support.classifier_models:Scores,"
             f"scores-whole=tests.support.classifier_models:WholeScores")
#: Two rows of ``scores``: the doc's example row, and one with a tie and a class without a label.
ROWS = np.array([[1.1, 3.3, 0.5, 2.4], [0.0, -1.0, 7.5, 7.5]], np.float32)
#: Their top two classes, as Triton writes them (``%f``, index, label; class 2 has none).
TOP2 = [["3.300000:1:pickle", "2.400000:3:kiwi"], ["7.500000:2", "7.500000:3:kiwi"]]


@pytest.fixture(scope="module")
def gateway(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    logs = tmp_path_factory.mktemp("classification")
    with redis_databases.take("test_gateway_classification") as db:
        worker = start_worker(db.url, logs / "worker.log", "--device", "cpu", "--models",
                              "scores,scores-whole,mlp,identity,echo-stream",
                              "--hostname", "classify@%h", ASYNCINFER_MODEL_FACTORIES=FACTORIES)
        try:
            proc = start_gateway(db.url, logs / "gateway.log")
            try:
                yield proc
            finally:
                proc.stop()
        finally:
            worker.stop()


@pytest.fixture(scope="module")
def http(gateway: GatewayProcess) -> Iterator[httpclient.InferenceServerClient]:
    client = httpclient.InferenceServerClient(gateway.http_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc(gateway: GatewayProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    yield client
    client.close()


def _input(module: Any, name: str, value: np.ndarray, datatype: str = "FP32") -> Any:
    x = module.InferInput(name, list(value.shape), datatype)
    x.set_data_from_numpy(value)
    return x


def _strings(array: np.ndarray) -> list[Any]:
    """A BYTES answer (bytes, or str from JSON data) as nested lists of str."""
    return np.vectorize(lambda b: b.decode() if isinstance(b, bytes) else b,
                        otypes=[object])(array).tolist()


def _classes(client: Any, module: Any, model: str, name: str, value: np.ndarray, count: int,
             output: str, datatype: str = "FP32", **kw: Any) -> tuple[list[Any], Any]:
    result = client.infer(model, [_input(module, name, value, datatype)],
                          outputs=[module.InferRequestedOutput(output, class_count=count, **kw)])
    answer = result.get_output(output)
    datatype = answer["datatype"] if isinstance(answer, dict) else answer.datatype
    return _strings(result.as_numpy(output)), datatype


# -- classification ---------------------------------------------------------------------------------

@pytest.mark.parametrize("front", ["http", "http-json", "grpc"])
def test_top_classes_come_back_as_triton_writes_them_with_the_models_labels(
        http: Any, grpc: Any, front: str) -> None:
    client, module, kw = {"http": (http, httpclient, {}),
                          "http-json": (http, httpclient, {"binary_data": False}),
                          "grpc": (grpc, grpcclient, {})}[front]
    strings, datatype = _classes(client, module, "scores", "scores", ROWS, 2, "probs", **kw)
    assert strings == TOP2
    assert datatype == "BYTES"


@pytest.mark.parametrize("module_name", ["http", "grpc"])
def test_mlp_classes_without_labels_are_value_and_index(http: Any, grpc: Any,
                                                        module_name: str) -> None:
    client, module = (http, httpclient) if module_name == "http" else (grpc, grpcclient)
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    raw = client.infer("mlp", [_input(module, "input", x)]).as_numpy("output")
    strings, _ = _classes(client, module, "mlp", "input", x, 3, "output")
    expected = [[f"{float(row[i]):f}:{i}" for i in np.argsort(-row, kind="stable")[:3]]
                for row in raw]
    assert strings == expected


@pytest.mark.parametrize("module_name", ["http", "grpc"])
def test_more_classes_than_the_row_has_give_the_whole_row_and_integers_print_as_integers(
        http: Any, grpc: Any, module_name: str) -> None:
    client, module = (http, httpclient) if module_name == "http" else (grpc, grpcclient)
    strings, _ = _classes(client, module, "scores", "scores", ROWS[:1], 10, "probs")
    assert strings == [["3.300000:1:pickle", "2.400000:3:kiwi", "1.100000:0:apple", "0.500000:2"]]
    ints = np.array([[3, 9, 9, -1], [0, 0, 5, 0]], np.int32)
    strings, _ = _classes(client, module, "identity", "x", ints, 3, "x", "INT32")
    assert strings == [["9:1", "9:2", "3:0"], ["5:2", "0:0", "0:1"]]


def test_a_model_that_does_not_batch_is_classified_over_its_whole_tensor(http: Any) -> None:
    config = http.get_model_config("scores-whole")
    assert config["max_batch_size"] == 0
    result = http.infer("scores-whole", [_input(httpclient, "scores", ROWS.reshape(1, 2, 4))],
                        outputs=[httpclient.InferRequestedOutput("probs", class_count=3)])
    assert result.as_numpy("probs").shape == (3,)
    assert _strings(result.as_numpy("probs")) == ["7.500000:6", "7.500000:7", "3.300000:1:pickle"]


def test_classes_on_a_grpc_stream(grpc: Any) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        grpc.async_stream_infer("scores", [_input(grpcclient, "scores", ROWS)], request_id="s1",
                                outputs=[grpcclient.InferRequestedOutput("probs", class_count=2)])
        result, error = answers.get(timeout=30)
    finally:
        grpc.stop_stream()
    assert error is None
    assert result.get_response().id == "s1"
    assert _strings(result.as_numpy("probs")) == TOP2


def test_the_config_names_the_labels_and_the_metadata_keeps_to_v2(http: Any, grpc: Any) -> None:
    assert "classification" in http.get_server_metadata()["extensions"]
    output = http.get_model_config("scores")["output"][0]
    assert output["label_filename"] == "probs_labels.txt"
    assert output["labels"] == ["apple", "pickle", "", "kiwi"]
    assert "label_filename" not in http.get_model_config("mlp")["output"][0]
    assert http.get_model_metadata("scores")["outputs"] == [
        {"name": "probs", "datatype": "FP32", "shape": [-1, 4]}]
    assert [o.name for o in grpc.get_model_metadata("scores").outputs] == ["probs"]


@pytest.mark.parametrize("module_name", ["http", "grpc"])
def test_classes_of_a_bytes_output_are_refused_naming_the_type(http: Any, grpc: Any,
                                                                module_name: str) -> None:
    client, module = (http, httpclient) if module_name == "http" else (grpc, grpcclient)
    words = np.array([[b"a", b"b"]], dtype=np.object_)
    # an undeclared output (identity): refused when its answer comes
    with pytest.raises(InferenceServerException) as caught:
        _classes(client, module, "identity", "x", words, 1, "x", "BYTES")
    assert ("output 'x': class result not available for output due to unsupported type 'BYTES'"
            in caught.value.message())
    # a declared one (echo-stream's text_output): refused before it is sent
    with pytest.raises(InferenceServerException) as caught:
        _classes(client, module, "echo-stream", "text_input", np.array([b"hi"], np.object_), 1,
                 "text_output", "BYTES")
    assert ("output 'text_output': class result not available for output due to unsupported "
            "type 'BYTES'" in caught.value.message())


# -- Triton parameters not served: refused by name; their defaults pass --------------------------

@pytest.mark.parametrize("module_name", ["http", "grpc"])
def test_tritonclients_default_call_passes(http: Any, grpc: Any, module_name: str) -> None:
    client, module = (http, httpclient) if module_name == "http" else (grpc, grpcclient)
    result = client.infer("scores", [_input(module, "scores", ROWS)], sequence_id=0,
                          sequence_start=False, sequence_end=False, priority=0)
    np.testing.assert_array_equal(result.as_numpy("probs"), ROWS)


#: A sequence's parameters for a model that declares no sequence batching.
NOT_STATEFUL = ("model 'scores' is not stateful (it declares no sequence batching): parameter "
                "'sequence_id' is not served for it")


@pytest.mark.parametrize("module_name", ["http", "grpc"])
@pytest.mark.parametrize(("kw", "named"), [
    ({"sequence_id": 42}, NOT_STATEFUL),
    ({"sequence_id": "user-7"}, NOT_STATEFUL),
    ({"sequence_id": 42, "sequence_start": True}, NOT_STATEFUL),
], ids=["int id", "string id", "start"])
def test_a_sequence_for_a_stateless_model_is_refused_by_name(http: Any, grpc: Any,
                                                             module_name: str,
                                       kw: dict[str, Any], named: str) -> None:
    client, module = (http, httpclient) if module_name == "http" else (grpc, grpcclient)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("scores", [_input(module, "scores", ROWS)], request_id="q1", **kw)
    assert f"request q1: {named}" in caught.value.message()
    if module_name == "grpc":
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    else:
        assert caught.value.status() == "400"


def test_a_sequence_on_a_grpc_stream_is_refused_and_the_stream_goes_on(grpc: Any) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        grpc.async_stream_infer("scores", [_input(grpcclient, "scores", ROWS)], request_id="seq",
                                sequence_id=9, sequence_end=True)
        _, error = answers.get(timeout=30)
        grpc.async_stream_infer("scores", [_input(grpcclient, "scores", ROWS)], request_id="ok")
        result, ok_error = answers.get(timeout=30)
    finally:
        grpc.stop_stream()
    assert f"request seq: {NOT_STATEFUL}" in error.message()
    assert ok_error is None and result.get_response().id == "ok"


@pytest.mark.parametrize(("body", "named"), [
    ({"scores": [1.0, 2.0, 3.0, 4.0], "sequence_id": 3}, NOT_STATEFUL),
    ({"scores": [1.0, 2.0, 3.0, 4.0], "parameters": {"sequence_start": True}},
     "parameter 'sequence_start' needs a non-zero 'sequence_id'"),
], ids=["top level", "in parameters"])
def test_generate_refuses_a_sequence_by_name(gateway: GatewayProcess, body: dict[str, Any],
                                             named: str) -> None:
    request = urllib.request.Request(f"http://{gateway.http_url}/v2/models/scores/generate",
                                     data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert named in json.loads(caught.value.read())["error"]
