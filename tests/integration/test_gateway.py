"""The v2 gateway (``asyncinfer gateway``), a real process in front of the session worker, driven by
tritonclient over HTTP (binary and JSON) and raw HTTP where a client library would hide the answer."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from asyncinfer.broker.catalogue import Catalogue
from asyncinfer.wire.keys import CLAIM_PREFIX
from tests.support.marks import ForwardMarks
from tests.support.processes import GatewayProcess, start_gateway
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)

#: One array per v2 datatype, with its edge values: each type's extremes, and for floats -0.0, a
#: subnormal and an inexact decimal (each must come back byte for byte).
DATATYPE_VALUES = {
    "BOOL": np.array([True, False, True, False]),
    "UINT8": np.array([0, 1, 255, 128], np.uint8),
    "UINT16": np.array([0, 1, 65535, 256], np.uint16),
    "UINT32": np.array([0, 1, 2**32 - 1, 2**31], np.uint32),
    "UINT64": np.array([0, 1, 2**64 - 1, 2**63], np.uint64),
    "INT8": np.array([-128, 0, 127, -1], np.int8),
    "INT16": np.array([-32768, 0, 32767, -1], np.int16),
    "INT32": np.array([-2**31, 0, 2**31 - 1, -1], np.int32),
    "INT64": np.array([-2**63, 0, 2**63 - 1, -1], np.int64),
    "FP16": np.array([-65504, 0.5, 65504, -0.0], np.float16),
    "FP32": np.array([-3.4e38, 1.5e-45, 0.1, -0.0], np.float32),
    "FP64": np.array([-1.7e308, 5e-324, 0.1, -0.0], np.float64),
    "BYTES": np.array([b"", b"\x00\xffbinary", "ünïcode".encode(), b"\r\n\"{}"], dtype=object),
}


@pytest.fixture(scope="module")
def gateway(redis_url: str, worker: object, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    proc = start_gateway(redis_url, tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def http(gateway: GatewayProcess) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(gateway.http_url, concurrency=64)
    try:
        yield c
    finally:
        c.close()


def _raw(url: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://{url}{path}", data=body, headers=headers or {},
                                     method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_health_and_metadata_as_the_v2_spec_says(http, gateway) -> None:
    assert http.is_server_live() and http.is_server_ready()
    meta = http.get_server_metadata()
    assert meta["name"] == "asyncinfer" and "binary_tensor_data" in meta["extensions"]
    assert http.get_model_metadata("mlp") == {
        "name": "mlp", "versions": ["1"], "platform": "pytorch",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 16]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]}
    assert http.get_model_metadata("mlp", model_version="1")["name"] == "mlp"
    assert http.is_model_ready("mlp") and http.is_model_ready("mlp", "1")
    assert not http.is_model_ready("nosuchmodel")
    assert not http.is_model_ready("mlp", "7")
    config = http.get_model_config("mlp")
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [16],
                                "format": "FORMAT_NONE"}]
    status, _, body = _raw(gateway.http_url, "/v2/models/nosuchmodel")
    assert status == 404 and "nosuchmodel" in json.loads(body)["error"]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_every_datatype_round_trips_through_identity_exactly(http, binary: bool) -> None:
    values = dict(DATATYPE_VALUES)
    if not binary:  # JSON carries BYTES elements as text
        values["BYTES"] = np.array([b"", b"plain", "\u00fcn\u00efcode".encode(), b'\\"{}'],
                                   dtype=object)
    if binary:  # tritonclient sends BF16 only as binary data, from ml_dtypes.bfloat16 arrays
        import ml_dtypes

        values["BF16"] = np.array([-2.5, 0.0, 3.0e38, -0.0], ml_dtypes.bfloat16)
    inputs, outputs = [], []
    for datatype, value in values.items():
        name = f"x_{datatype.lower()}"
        one = httpclient.InferInput(name, [1, 4], datatype)
        one.set_data_from_numpy(value.reshape(1, 4), binary_data=binary)
        inputs.append(one)
        outputs.append(httpclient.InferRequestedOutput(name, binary_data=binary))
    result = http.infer("identity", inputs, outputs=outputs)
    for datatype, value in values.items():
        got = result.as_numpy(f"x_{datatype.lower()}")
        assert got.shape == (1, 4), datatype
        if datatype == "BYTES":
            expected = value if binary else np.array([v.decode() for v in value], dtype=object)
            got = got.reshape(-1)
            assert [bytes(g) if binary else g for g in got] == list(expected), datatype
        else:
            assert got.dtype == value.dtype, datatype
            assert got.tobytes() == value.tobytes(), datatype  # byte for byte: -0.0 stays -0.0


def test_all_outputs_come_back_binary_when_none_are_named(http, client) -> None:
    x = httpclient.InferInput("input", [2, 16], "FP32")
    x.set_data_from_numpy(np.arange(32, dtype=np.float32).reshape(2, 16))
    result = http.infer("mlp", [x])
    out = result.get_output("output")
    assert out["parameters"]["binary_data_size"] == 2 * 4 * 4
    # the same rows through the Python client
    direct = client.infer("mlp", np.arange(32, dtype=np.float32).reshape(2, 16), timeout_s=30)
    np.testing.assert_allclose(result.as_numpy("output"), direct["output"], rtol=1e-5, atol=1e-5)
    assert result.get_response()["parameters"]["worker"].startswith("test-cpu@")


def test_unknown_model_is_refused_at_once_and_never_enqueued(http, redis_client) -> None:
    x = httpclient.InferInput("input", [1, 1], "FP32")
    x.set_data_from_numpy(np.zeros((1, 1), np.float32))
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as caught:
        http.infer("nosuchmodel", [x], request_id=f"gw-unknown-{uuid.uuid4().hex}")
    assert time.monotonic() - started < 5
    assert caught.value.status() == "404"
    # Triton's words first: simple_http_infer_client.py checks that the message starts with them
    assert caught.value.message().startswith("Request for unknown model: 'nosuchmodel' is not "
                                             "found: no worker announced it (known: ")
    assert "mlp" in caught.value.message()  # it names the known ones
    assert not list(redis_client.scan_iter(match="infer.nosuchmodel*"))


@pytest.mark.parametrize(("shape", "data", "datatype", "message"), [
    ([1, 3], [1.0, 2.0, 3.0], "FP32", "input 'input': shape [1, 3] does not match [n, 16]"),
    ([1, 16], ["NaN"] + [0.0] * 15, "FP32", "NaN and infinite values are not accepted"),
    ([1, 16], [0] * 16, "INT64", "datatype INT64 is not accepted (accepted: FP32)"),
    ([1, 16], [0.0] * 15, "FP32", "data has 15 elements but shape [1, 16] needs 16"),
], ids=["shape", "nan", "datatype", "count"])
def test_bad_input_gets_400_with_the_workers_message(gateway, shape, data, datatype, message) -> None:
    if data[0] == "NaN":
        body = ('{"inputs":[{"name":"input","datatype":"FP32","shape":[1,16],"data":[NaN'
                + ",0.0" * 15 + "]}]}").encode()
    else:
        body = json.dumps({"inputs": [{"name": "input", "datatype": datatype, "shape": shape,
                                       "data": data}]}).encode()
    status, _, answer = _raw(gateway.http_url, "/v2/models/mlp/infer", body)
    assert status == 400, answer
    error = json.loads(answer)["error"]
    assert error.startswith("request ") and message in error


def test_malformed_bodies_get_400_naming_the_rule(gateway) -> None:
    for body, rule in [(b"{not json", "not valid JSON"), (b"[]", "must be a JSON object"),
                       (b'{"inputs": []}', "'inputs' must be a non-empty list"),
                       (b'{"inputs":[{"name":"input","datatype":"FP32","shape":[1,16],'
                        b'"parameters":{"binary_data_size":64}}]}', "runs past the end")]:
        status, _, answer = _raw(gateway.http_url, "/v2/models/mlp/infer", body)
        assert status == 400 and rule in json.loads(answer)["error"], (body, answer)
    status, _, answer = _raw(gateway.http_url, "/v2/models/mlp/infer", b"{}",
                             {"Inference-Header-Content-Length": "99"})
    assert status == 400 and "Inference-Header-Content-Length is 99" in json.loads(answer)["error"]


def test_a_gzip_or_deflate_body_is_accepted(gateway) -> None:
    import zlib

    doc = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
    for encoding, packed in (("gzip", gzip.compress(json.dumps(doc).encode())),
                             ("deflate", zlib.compress(json.dumps(doc).encode()))):
        status, _, answer = _raw(gateway.http_url, "/v2/models/mlp/infer", packed,
                                 {"Content-Encoding": encoding, "Content-Type": "application/json"})
        assert status == 200, answer
        assert json.loads(answer)["outputs"][0]["shape"] == [1, 4]


def test_an_answer_is_compressed_when_accepted_and_large_enough(gateway) -> None:
    accepts = {"Content-Type": "application/json", "Accept-Encoding": "gzip, deflate"}
    # a small answer (mlp's 4 values) goes as it is: compressing it would cost more than it saves
    small = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}
    status, headers, answer = _raw(gateway.http_url, "/v2/models/mlp/infer",
                                   json.dumps(small).encode(), accepts)
    assert status == 200 and "Content-Encoding" not in headers
    assert json.loads(answer)["outputs"][0]["shape"] == [1, 4]
    # a large one (identity's 4,096 values) is compressed, and inflates to the answer
    import zlib

    values = [float(i % 7) for i in range(4096)]
    large = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4096], "data": values}]}
    for accepted, wbits in (("gzip", 31), ("deflate", 15)):
        status, headers, answer = _raw(gateway.http_url, "/v2/models/identity/infer",
                                       json.dumps(large).encode(),
                                       {**accepts, "Accept-Encoding": accepted})
        assert status == 200 and headers["Content-Encoding"] == accepted
        assert len(answer) < len(json.dumps(values))
        assert json.loads(zlib.decompress(answer, wbits))["outputs"][0]["data"] == values
    # and not without Accept-Encoding
    status, headers, answer = _raw(gateway.http_url, "/v2/models/identity/infer",
                                   json.dumps(large).encode(), {"Accept-Encoding": "identity"})
    assert status == 200 and "Content-Encoding" not in headers
    assert json.loads(answer)["outputs"][0]["data"] == values


def test_v2_parameters_reach_the_request(gateway, redis_client) -> None:
    request_id = f"gw-params-{uuid.uuid4().hex}"
    doc = {"id": request_id, "parameters": {"priority": 3, "timeout": 30_000_000},
           "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]}
    idempotent = {"Idempotency-Key": request_id}
    status, _, answer = _raw(gateway.http_url, "/v2/models/mlp/infer", json.dumps(doc).encode(),
                             idempotent)
    assert status == 200, answer
    assert json.loads(answer)["id"] == request_id
    # the idempotency key is the request ID: asking again gives the same request's answer
    assert redis_client.exists(CLAIM_PREFIX + request_id)
    status, _, again = _raw(gateway.http_url, "/v2/models/mlp/infer", json.dumps(doc).encode(),
                            idempotent)
    assert status == 200 and json.loads(again)["parameters"] == json.loads(answer)["parameters"]


def _sleep_model_busy(client, redis_client) -> tuple[ForwardMarks, object]:
    """The sleep model's device busy with a 1.5 s request (so the next ones wait behind it)."""
    marks = ForwardMarks(redis_client, "sleep")
    blocker = client.submit("sleep", np.array([[1.5]], np.float32))
    marks.wait_on_device(1.5)
    return marks, blocker


def _never_ran(client, marks: ForwardMarks, request_id: str, value: float) -> None:
    state = wait_for(lambda: (s := client.app.AsyncResult(request_id).state) in ("REVOKED", "SUCCESS")
                     and s, 30, "the request settled")
    assert state == "REVOKED"
    time.sleep(0.5)
    assert not any(value in batch for batch in marks.batches())


def test_a_client_that_disconnects_gets_its_request_revoked(gateway, client, redis_client) -> None:
    # Given the sleep model busy with a long request
    marks, blocker = _sleep_model_busy(client, redis_client)
    # When a gateway client sends a request queued behind it, then hangs up
    request_id = f"gw-hangup-{uuid.uuid4().hex}"
    body = json.dumps({"id": "1", "parameters": {"idempotency_key": request_id}, "inputs": [
        {"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [0.0123]}]}).encode()
    sock = socket.create_connection(("127.0.0.1", gateway.http_port))
    sock.sendall(b"POST /v2/models/sleep/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    wait_for(lambda: redis_client.exists(CLAIM_PREFIX + request_id), 10, "the request sent")
    sock.close()
    blocker.result(timeout=60)
    # Then it is revoked and never runs
    _never_ran(client, marks, request_id, 0.0123)


def test_256_concurrent_requests_agree_with_the_celery_path(http, client) -> None:
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((256, 1, 16)).astype(np.float32)
    handles = []
    for row in rows:
        x = httpclient.InferInput("input", [1, 16], "FP32")
        x.set_data_from_numpy(row)
        handles.append(http.async_infer("mlp", [x]))
    through_gateway = np.concatenate([h.get_result(timeout=60).as_numpy("output") for h in handles])
    results = [client.app.send_task("asyncinfer.infer", queue="infer.mlp", kwargs={
        "model": "mlp", "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                    "data": row.reshape(-1).tolist()}]}) for row in rows]
    through_celery = np.concatenate([
        np.asarray(r.get(timeout=60)["outputs"][0]["data"], np.float32).reshape(1, 4)
        for r in results])
    np.testing.assert_allclose(through_gateway, through_celery, rtol=1e-5, atol=1e-5)


def test_metrics_count_calls_and_show_queue_gauges(gateway, http) -> None:
    x = httpclient.InferInput("input", [1, 16], "FP32")
    x.set_data_from_numpy(np.zeros((1, 16), np.float32))
    http.infer("mlp", [x])
    _, _, text = _raw(f"127.0.0.1:{gateway.metrics_port}", "/metrics")
    metrics = text.decode()
    line = next(m for m in metrics.splitlines()
                if m.startswith("asyncinfer_gateway_requests_total{") and 'model="mlp"' in m
                and 'code="200"' in m and 'protocol="http"' in m)
    assert float(line.rsplit(" ", 1)[1]) >= 1
    assert 'asyncinfer_queue_depth{model="mlp"}' in metrics
    assert 'asyncinfer_queue_oldest_age_seconds{model="mlp"}' in metrics
    assert "asyncinfer_gateway_request_duration_seconds_bucket" in metrics
    assert "asyncinfer_gateway_in_flight" in metrics


def test_calls_for_made_up_models_count_under_one_series(gateway) -> None:
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1],
                                   "data": [1.0]}]}).encode()
    names = [f"nosuch-{uuid.uuid4().hex}" for _ in range(5)]
    for name in names:
        status, _, _ = _raw(gateway.http_url, f"/v2/models/{name}/infer", body)
        assert status == 404
    _, _, text = _raw(f"127.0.0.1:{gateway.metrics_port}", "/metrics")
    metrics = text.decode()
    assert not any(name in metrics for name in names)  # no series per made-up name
    line = next(m for m in metrics.splitlines()
                if m.startswith("asyncinfer_gateway_requests_total{") and 'code="404"' in m
                and 'model="(unknown)"' in m and 'protocol="http"' in m)
    assert float(line.rsplit(" ", 1)[1]) >= 5


def test_a_full_queue_gives_429_with_retry_after(redis_db, tmp_path) -> None:
    # Given a model the fleet knows, with a queue bound of 2 and no live worker (its worker's
    # announcement has expired before the gateway first reads the catalogue)
    catalogue = Catalogue(redis_db.client, ttl_s=0.5)
    catalogue.announce("gone@host", [{"name": "parked"}])
    wait_for(lambda: not catalogue.read()["parked"].ready, 5, "the announcement expiring")
    proc = start_gateway(redis_db.url, tmp_path / "gateway.log",
                         ASYNCINFER_MODEL_OPTIONS='{"parked": {"max_queue_size": 2}}')
    try:
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1],
                                       "data": [1.0]}]}).encode()
        def wait_in_queue() -> None:
            try:
                _raw(proc.http_url, "/v2/models/parked/infer", body)
            except OSError:  # the gateway stops under it at the end of the test
                pass

        waiting = [threading.Thread(target=wait_in_queue, daemon=True) for _ in range(2)]
        for t in waiting:
            t.start()
        wait_for(lambda: redis_db.client.llen("infer.parked") == 2, 10, "two requests queued")
        # When a third arrives, Then it is refused with 429 and Retry-After
        status, headers, answer = _raw(proc.http_url, "/v2/models/parked/infer", body)
        assert status == 429, answer
        assert int(headers["Retry-After"]) >= 1
        assert "max_queue_size 2" in json.loads(answer)["error"]
        # and a known model with no live worker reports not ready, yet is queued
        assert _raw(proc.http_url, "/v2/models/parked/ready")[0] == 503
    finally:
        proc.stop()


def test_ready_is_false_while_the_broker_cannot_be_reached(tmp_path) -> None:
    from asyncinfer.ops.redis_server import free_port

    proc = start_gateway(f"redis://127.0.0.1:{free_port()}/0", tmp_path / "gateway.log",
                         ASYNCINFER_CONNECT_TIMEOUT_S="0.5")
    try:
        assert _raw(proc.http_url, "/v2/health/live")[0] == 200
        assert _raw(proc.http_url, "/v2/health/ready")[0] == 503
    finally:
        proc.stop()


# -- gRPC (tritonclient.grpc) ----------------------------------------------------------------------

@pytest.fixture()
def grpc(gateway: GatewayProcess) -> Iterator[object]:
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        yield c
    finally:
        c.close()


def test_grpc_health_metadata_and_config(grpc) -> None:
    assert grpc.is_server_live() and grpc.is_server_ready()
    assert "binary_tensor_data" in grpc.get_server_metadata().extensions
    meta = grpc.get_model_metadata("mlp")
    assert (meta.name, list(meta.versions), meta.platform) == ("mlp", ["1"], "pytorch")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("input", "FP32", [-1, 16])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("output", "FP32", [-1, 4])]
    assert grpc.is_model_ready("mlp") and not grpc.is_model_ready("nosuchmodel")
    config = grpc.get_model_config("mlp").config
    assert config.max_batch_size == 32 and list(config.input[0].dims) == [16]


def test_grpc_every_datatype_round_trips_through_identity_exactly(grpc) -> None:
    import ml_dtypes
    import tritonclient.grpc as grpcclient

    values = {**DATATYPE_VALUES, "BF16": np.array([-2.5, 0.0, 3.0e38, -0.0], ml_dtypes.bfloat16)}
    inputs = []
    for datatype, value in values.items():
        one = grpcclient.InferInput(f"x_{datatype.lower()}", [1, 4], datatype)
        one.set_data_from_numpy(value.reshape(1, 4))
        inputs.append(one)
    result = grpc.infer("identity", inputs)
    for datatype, value in values.items():
        got = result.as_numpy(f"x_{datatype.lower()}")
        assert got.shape == (1, 4), datatype
        if datatype == "BYTES":
            assert [bytes(g) for g in got.reshape(-1)] == list(value)
        else:
            assert got.dtype == value.dtype, datatype
            assert got.tobytes() == value.tobytes(), datatype  # byte for byte: -0.0 stays -0.0


def test_grpc_errors_carry_the_fitting_codes(grpc, redis_client) -> None:
    import tritonclient.grpc as grpcclient

    x = grpcclient.InferInput("input", [1, 3], "FP32")
    x.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("nosuchmodel", [x])
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert not list(redis_client.scan_iter(match="infer.nosuchmodel*"))
    with pytest.raises(InferenceServerException) as caught:
        grpc.infer("mlp", [x])
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "shape [1, 3] does not match [n, 16]" in caught.value.message()


def test_grpc_256_concurrent_requests_agree_with_the_python_client(grpc, client) -> None:
    import queue

    import tritonclient.grpc as grpcclient

    rng = np.random.default_rng(11)
    rows = rng.standard_normal((256, 1, 16)).astype(np.float32)
    done: queue.Queue[tuple[int, object, object]] = queue.Queue()
    for i, row in enumerate(rows):
        x = grpcclient.InferInput("input", [1, 16], "FP32")
        x.set_data_from_numpy(row)
        grpc.async_infer("mlp", [x], callback=lambda result, error, i=i: done.put((i, result, error)))
    answers = {}
    for _ in rows:
        i, result, error = done.get(timeout=60)
        assert error is None, error
        answers[i] = result.as_numpy("output")
    futures = [client.submit("mlp", row) for row in rows]
    direct = np.concatenate([f.result(timeout=60)["output"] for f in futures])
    np.testing.assert_allclose(np.concatenate([answers[i] for i in range(256)]), direct,
                               rtol=1e-5, atol=1e-5)


def test_grpc_cancel_revokes_the_request(gateway, grpc, client, redis_client) -> None:
    import tritonclient.grpc as grpcclient

    # Given the sleep model busy with a long request
    marks, blocker = _sleep_model_busy(client, redis_client)
    # When a gRPC client sends a request queued behind it, then cancels the call
    request_id = f"gw-grpc-cancel-{uuid.uuid4().hex}"
    x = grpcclient.InferInput("input", [1, 1], "FP32")
    x.set_data_from_numpy(np.array([[0.0456]], np.float32))
    call = grpc.async_infer("sleep", [x], callback=lambda result, error: None, request_id="1",
                            headers={"idempotency-key": request_id})
    wait_for(lambda: redis_client.exists(CLAIM_PREFIX + request_id), 10, "the request sent")
    call.cancel()
    blocker.result(timeout=60)
    # Then it is revoked and never runs
    _never_ran(client, marks, request_id, 0.0456)


def test_a_request_that_expires_in_the_queue_gets_504(gateway, client, redis_client) -> None:
    marks, blocker = _sleep_model_busy(client, redis_client)
    doc = {"parameters": {"timeout": 200_000},  # 0.2 s, behind a 1.5 s request
           "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [0.0789]}]}
    status, _, answer = _raw(gateway.http_url, "/v2/models/sleep/infer", json.dumps(doc).encode())
    blocker.result(timeout=60)
    assert status == 504, answer
    assert "expired before a worker ran it" in json.loads(answer)["error"]
    assert not any(0.0789 in batch for batch in marks.batches())


def test_an_output_the_model_does_not_declare_is_refused_before_it_runs(gateway) -> None:
    doc = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}],
           "outputs": [{"name": "nosuchoutput"}]}
    status, _, answer = _raw(gateway.http_url, "/v2/models/mlp/infer", json.dumps(doc).encode())
    assert status == 400
    assert "has no output 'nosuchoutput' (outputs: 'output')" in json.loads(answer)["error"]


def test_bf16_and_fp16_travel_as_json_too(gateway) -> None:
    # tritonclient sends BF16 only as binary; a plain JSON client may send it as numbers
    doc = {"inputs": [{"name": "b", "datatype": "BF16", "shape": [1, 3], "data": [-2.5, 0.0, 3.0e38]},
                      {"name": "h", "datatype": "FP16", "shape": [1, 2], "data": [0.5, -65504.0]}]}
    status, _, answer = _raw(gateway.http_url, "/v2/models/identity/infer", json.dumps(doc).encode())
    assert status == 200, answer
    outputs = {o["name"]: o for o in json.loads(answer)["outputs"]}
    assert outputs["b"]["datatype"] == "BF16" and outputs["b"]["shape"] == [1, 3]
    assert outputs["b"]["data"][:2] == [-2.5, 0.0] and abs(outputs["b"]["data"][2] / 3.0e38 - 1) < 0.01
    assert outputs["h"]["data"] == [0.5, -65504.0]
