"""A v2 ``id`` is a label, never another request's answer; an explicit idempotency key keeps one
run (gateway/idempotency.py, wire/request_identity.py), through every front: HTTP, gRPC unary, a
gRPC stream, the ``Client`` and a Celery producer."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from asyncinfer.errors import RequestIdReused
from asyncinfer.wire.keys import CLAIM_PREFIX
from tests.support.processes import GatewayProcess, start_gateway
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateway(redis_url: str, worker: object, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    proc = start_gateway(redis_url, tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        yield proc
    finally:
        proc.stop()


def _post(gateway: GatewayProcess, model: str, doc: dict[str, Any],
          headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(f"http://{gateway.http_url}/v2/models/{model}/infer",
                                     data=json.dumps(doc).encode(), headers=headers or {},
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _ints(request_id: str, values: list[int], name: str = "INPUT0", **extra: Any
          ) -> dict[str, Any]:
    return {"id": request_id, "inputs": [{"name": name, "datatype": "INT32",
                                          "shape": [1, len(values)], "data": values}], **extra}


def _mlp(request_id: str) -> dict[str, Any]:
    return {"id": request_id, "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 16],
                                          "data": [0.25] * 16}]}


# -- HTTP --------------------------------------------------------------------------------------------

def test_http_the_same_id_with_new_data_gets_its_own_answer(gateway: GatewayProcess) -> None:
    # Given a call with Triton's habit of a small id
    status, first = _post(gateway, "identity", _ints("7", [1, 2, 3, 4]))
    assert status == 200 and first["outputs"][0]["data"] == [1, 2, 3, 4] and first["id"] == "7"
    # When the same id comes with other data
    status, second = _post(gateway, "identity", _ints("7", [10, 20, 30, 40]))
    # Then it is another request, answered with its own data and the id echoed
    assert status == 200 and second["outputs"][0]["data"] == [10, 20, 30, 40]
    assert second["id"] == "7"


def test_http_the_same_id_for_another_model_is_another_request(gateway: GatewayProcess) -> None:
    assert _post(gateway, "identity", _ints("8", [5]))[1]["outputs"][0]["data"] == [5]
    status, answer = _post(gateway, "mlp", _mlp("8"))
    assert status == 200 and answer["id"] == "8" and answer["model_name"] == "mlp"
    assert answer["outputs"][0]["shape"] == [1, 4]


def test_http_an_id_with_spaces_is_echoed_as_it_came(gateway: GatewayProcess) -> None:
    status, answer = _post(gateway, "identity", _ints("my request id", [3]))
    assert status == 200 and answer["id"] == "my request id"
    assert answer["outputs"][0]["data"] == [3]


@pytest.mark.parametrize("how", ["header", "parameter"])
def test_http_an_idempotency_key_keeps_one_run_and_refuses_other_data(
        gateway: GatewayProcess, redis_client: Any, how: str) -> None:
    key = f"idem-{how}-{uuid.uuid4().hex}"

    def send(values: list[int]) -> tuple[int, dict[str, Any]]:
        if how == "header":
            return _post(gateway, "identity", _ints("1", values), {"Idempotency-Key": key})
        return _post(gateway, "identity", _ints("1", values, parameters={"idempotency_key": key}))

    # Given a call that asks for idempotency
    status, first = send([1, 2])
    assert status == 200 and first["outputs"][0]["data"] == [1, 2] and first["id"] == "1"
    assert redis_client.exists(CLAIM_PREFIX + key)
    # When it is sent again as it was: the first request's answer, from its one run
    status, again = send([1, 2])
    assert status == 200 and again["outputs"][0]["data"] == [1, 2]
    assert again["parameters"] == first["parameters"]  # its worker, batch and timings: one run
    # When the same key comes with other data: refused, naming the key and what differs
    status, refused = send([9, 9])
    assert status == 422
    assert refused["error"].startswith(f"request {key}: this request ID was already sent with a "
                                       f"different inputs")


# -- gRPC unary --------------------------------------------------------------------------------------

@pytest.fixture()
def grpc(gateway: GatewayProcess) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        yield c
    finally:
        c.close()


def _grpc_ints(values: list[int]) -> list[grpcclient.InferInput]:
    x = grpcclient.InferInput("INPUT0", [1, len(values)], "INT32")
    x.set_data_from_numpy(np.array([values], np.int32))
    return [x]


def test_grpc_ids_are_labels_and_a_key_keeps_one_run(
        grpc: grpcclient.InferenceServerClient) -> None:
    # the same id, new data: its own answer
    for values in ([1, 2, 3], [10, 20, 30]):
        result = grpc.infer("identity", _grpc_ints(values), request_id="7")
        assert result.as_numpy("INPUT0").tolist() == [values]
        assert result.get_response().id == "7"
    # the same id for another model, and an id with spaces
    x = grpcclient.InferInput("input", [1, 16], "FP32")
    x.set_data_from_numpy(np.full((1, 16), 0.25, np.float32))
    assert grpc.infer("mlp", [x], request_id="7").as_numpy("output").shape == (1, 4)
    spaced = grpc.infer("identity", _grpc_ints([4]), request_id="my request id")
    assert spaced.get_response().id == "my request id"
    # an idempotency key in the metadata: one run, then other data refused
    key = f"idem-grpc-{uuid.uuid4().hex}"
    first = grpc.infer("identity", _grpc_ints([1]), request_id="1",
                       headers={"idempotency-key": key})
    again = grpc.infer("identity", _grpc_ints([1]), request_id="2",
                       headers={"idempotency-key": key})
    assert again.as_numpy("INPUT0").tolist() == [[1]] and again.get_response().id == "2"
    assert (dict(again.get_response().parameters) == dict(first.get_response().parameters))
    with pytest.raises(InferenceServerException) as refused:
        grpc.infer("identity", _grpc_ints([2]), request_id="3", headers={"idempotency-key": key})
    assert "INVALID_ARGUMENT" in str(refused.value.status())
    assert f"request {key}: this request ID was already sent with a different inputs" in (
        refused.value.message())


# -- a gRPC stream -------------------------------------------------------------------------------------

def test_grpc_stream_ids_are_labels_and_a_key_keeps_one_run(gateway: GatewayProcess) -> None:
    responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    key = f"idem-stream-{uuid.uuid4().hex}"

    def one() -> tuple[Any, Any]:
        return responses.get(timeout=60)

    try:
        # the same id on one stream for two models, then with new data: each its own answer
        client.async_stream_infer("identity", _grpc_ints([1, 2]), request_id="7")
        result, error = one()
        assert error is None and result.as_numpy("INPUT0").tolist() == [[1, 2]]
        x = grpcclient.InferInput("input", [1, 16], "FP32")
        x.set_data_from_numpy(np.full((1, 16), 0.25, np.float32))
        client.async_stream_infer("mlp", [x], request_id="7")
        result, error = one()
        assert error is None and result.get_response().model_name == "mlp"
        assert result.as_numpy("output").shape == (1, 4) and result.get_response().id == "7"
        client.async_stream_infer("identity", _grpc_ints([10, 20]), request_id="my request id")
        result, error = one()
        assert error is None and result.as_numpy("INPUT0").tolist() == [[10, 20]]
        assert result.get_response().id == "my request id"
        # an idempotency key per request: one run, then other data refused, the stream going on
        answers = []
        for values in ([5], [5], [6]):
            client.async_stream_infer("identity", _grpc_ints(values), request_id="k",
                                      parameters={"idempotency_key": key})
            answers.append(one())
        (first, e1), (again, e2), (_, refused) = answers
        assert e1 is None and e2 is None and again.as_numpy("INPUT0").tolist() == [[5]]
        assert dict(again.get_response().parameters) == dict(first.get_response().parameters)
        assert refused is not None
        assert f"request {key}: this request ID was already sent with a different inputs" in (
            refused.message())
        client.async_stream_infer("identity", _grpc_ints([7]), request_id="after")
        result, error = one()
        assert error is None and result.as_numpy("INPUT0").tolist() == [[7]]
    finally:
        client.stop_stream()
        client.close()


# -- the Client and a Celery producer ------------------------------------------------------------

def test_client_a_request_id_sent_again_with_other_parameters_is_refused(client: Any) -> None:
    rid = f"client-params-{uuid.uuid4().hex}"
    x = {"x": np.ones((1, 2), np.float32)}
    first = client.submit("identity", x, request_id=rid, parameters={"note": "a"})
    assert first.result(timeout=30)["x"].tolist() == [[1.0, 1.0]]
    same = client.submit("identity", x, request_id=rid, parameters={"note": "a"})
    assert same.result(timeout=30)["x"].tolist() == [[1.0, 1.0]]
    with pytest.raises(RequestIdReused, match=rf"^request {rid}: this request ID was already sent "
                                              r"with a different parameters"):
        client.submit("identity", x, request_id=rid, parameters={"note": "b"}).sent(timeout_s=30)
    with pytest.raises(RequestIdReused, match=r"different model version \(first the latest "
                                              r"version, now version 1\)"):
        client.submit("identity", x, request_id=rid, parameters={"note": "a"},
                      version="1").sent(timeout_s=30)


def test_client_a_request_id_reused_with_other_inputs_never_gets_the_first_answer(
        client: Any, redis_url: str) -> None:
    # the first request answered and stored: another producer's watcher finds its result at once,
    # before the publish script refuses the second; the refusal must be the outcome
    from asyncinfer.client import Client

    rid = f"client-inputs-{uuid.uuid4().hex}"
    first = client.submit("identity", {"x": np.array([[1.0, 2.0]], np.float32)}, request_id=rid)
    assert first.result(timeout=30)["x"].tolist() == [[1.0, 2.0]]
    for _ in range(10):  # the race, again and again, each from a producer of its own
        with Client(broker_url=redis_url) as producer:
            other = producer.submit("identity", {"x": np.array([[1.0, 3.0]], np.float32)},
                                    request_id=rid)
            with pytest.raises(RequestIdReused, match=rf"^request {rid}: this request ID was "
                                                      r"already sent with a different inputs"):
                other.result(timeout=30)


def test_http_client_ids_reused_by_tritonclient_are_answered_each(gateway: GatewayProcess) -> None:
    # tritonclient's own habit: every call of an example with request_id="1"
    http = httpclient.InferenceServerClient(gateway.http_url)
    try:
        for values in ([1, 1], [2, 2], [3, 3]):
            x = httpclient.InferInput("INPUT0", [1, 2], "INT32")
            x.set_data_from_numpy(np.array([values], np.int32))
            result = http.infer("identity", [x], request_id="1")
            assert result.as_numpy("INPUT0").tolist() == [values]
            assert result.get_response()["id"] == "1"
    finally:
        http.close()


def _celery_kwargs(values: list[int]) -> dict[str, Any]:
    return {"model": "identity", "inputs": [{"name": "x", "datatype": "INT32",
                                             "shape": [1, len(values)], "data": values}]}


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_celery_send_task_claims_its_task_id(client: Any, redis_client: Any,
                                             serializer: str) -> None:
    # Given a plain Celery producer's request with its own task ID, answered
    rid = f"celery-{serializer}-{uuid.uuid4().hex}"
    send = client.app.send_task
    first = send("asyncinfer.infer", kwargs=_celery_kwargs([1, 2]), task_id=rid,
                 queue="infer.identity", serializer=serializer)
    assert first.get(timeout=30)["outputs"][0]["data"] in ([1, 2], np.array([1, 2], np.int32)
                                                           .tobytes())
    assert redis_client.exists(CLAIM_PREFIX + rid)
    answered = redis_client.get(client.app.backend.get_key_for_task(rid))
    # When the same request is sent again: not pushed again (one run, one answer)
    again = send("asyncinfer.infer", kwargs=_celery_kwargs([1, 2]), task_id=rid,
                 queue="infer.identity", serializer=serializer)
    assert again.get(timeout=30) == first.get(timeout=30)
    assert redis_client.llen("infer.identity") == 0
    assert redis_client.get(client.app.backend.get_key_for_task(rid)) == answered
    # When the same task ID comes with other inputs: send_task refuses at once, naming it
    with pytest.raises(RequestIdReused, match=rf"^request {rid}: this request ID was already "
                                              r"sent with a different inputs"):
        send("asyncinfer.infer", kwargs=_celery_kwargs([7, 7]), task_id=rid,
             queue="infer.identity", serializer=serializer)
    assert redis_client.llen("infer.identity") == 0


def test_celery_send_task_claims_after_the_app_ran_an_inspect(client: Any, redis_client: Any) -> None:
    # Given a producer's app that ran a remote-control inspect (its reply queue expires: kombu
    # notes the expiry on the channel the app publishes on)
    client.app.control.inspect(timeout=0.5).ping()
    # When it sends a request with its own task ID, then the same ID with other inputs
    rid = f"celery-after-inspect-{uuid.uuid4().hex}"
    send = client.app.send_task
    first = send("asyncinfer.infer", kwargs=_celery_kwargs([4, 5]), task_id=rid,
                 queue="infer.identity")
    first.get(timeout=30)
    # Then the first claimed its ID (it did not, before: every request after an inspect went out
    # unclaimed) and the second is refused
    assert redis_client.exists(CLAIM_PREFIX + rid)
    with pytest.raises(RequestIdReused, match=rf"^request {rid}: "):
        send("asyncinfer.infer", kwargs=_celery_kwargs([6, 6]), task_id=rid,
             queue="infer.identity")


def test_celery_retry_of_a_claimed_request_goes_on_its_queue(client: Any) -> None:
    # Given a claimed request, answered
    rid = f"celery-retry-{uuid.uuid4().hex}"
    first = client.app.send_task("asyncinfer.infer", kwargs=_celery_kwargs([3]), task_id=rid,
                                 queue="infer.identity")
    first.get(timeout=30)
    done = client.app.backend.get_task_meta(rid)["date_done"]
    # When Celery sends it again as its retry (Task.retry: the same ID, retries above 0)
    client.app.send_task("asyncinfer.infer", kwargs=_celery_kwargs([3]), task_id=rid,
                         queue="infer.identity", retries=1)
    # Then it is pushed and runs again (its result stored anew)
    wait_for(lambda: client.app.backend.get_task_meta(rid)["date_done"] != done, 30,
             "the retry's result")


def test_http_the_answer_names_its_request_id_to_look_it_up(gateway: GatewayProcess,
                                                            client: Any) -> None:
    status, answer = _post(gateway, "identity", _ints("label", [4, 2]))
    assert status == 200
    request_id = answer["parameters"]["request_id"]
    assert request_id != "label"
    stored = client.app.AsyncResult(request_id).get(timeout=30)
    assert stored["id"] == request_id and stored["model_name"] == "identity"
