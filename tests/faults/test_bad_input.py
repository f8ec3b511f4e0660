"""Bad input, each kind through a real worker: a FAILURE naming the request and the rule broken,
and the worker goes on serving.

Requests a Client cannot produce (malformed JSON, bodies that are no Celery protocol-2 message,
oversized or pickle bodies) are hand-built kombu envelopes pushed raw onto the queue, as any
producer with a Redis connection could. That a pickle body is never unpickled (on both consumers)
is shown in tests/integration/test_wire.py; the client-side checks of ``submit`` are at the end.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from asyncinfer.constants import TASK_NAME, queue_for
from asyncinfer.errors import InvalidRequest, UnknownModel
from asyncinfer.wire.messages import task_message
from tests.support.processes import SESSION_MAX_PAYLOAD_BYTES

pytestmark = pytest.mark.timeout(120)


def _fp32(name: str, shape: list[int], data: list[Any], datatype: str = "FP32") -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def _mlp_row(bad_at: int, value: float, rows: int = 1) -> list[float]:
    data = [0.5] * (16 * rows)
    data[bad_at] = value
    return data


def envelope(request_id: str, queue: str, body: bytes, *,
             content_type: str = "application/json") -> str:
    """A kombu envelope for ``request_id`` carrying ``body`` as it is (no checks on it)."""
    message = json.loads(task_message(TASK_NAME, request_id, {}, queue))
    message["body"] = base64.b64encode(body).decode()
    message["content-type"] = content_type
    return json.dumps(message)


@dataclass(frozen=True)
class Case:
    """One kind of bad request: what goes on the queue, and the error it must get."""

    kwargs: dict[str, Any] | None = None  # a v2 request sent as a Client sends it
    raw: Callable[[str], str] | None = None  # or the whole message, given the request ID
    model: str = "identity"  # the queue is infer.<model>
    error: type[Exception] = InvalidRequest
    rule: str = ""  # a regular expression the error message must match after the request ID


def _identity_x(rows: int) -> dict[str, Any]:
    return {"model": "identity", "inputs": [_fp32("x", [rows, 1], [1.0] * rows)]}


CASES: dict[str, Case] = {
    "wrong shape": Case(
        {"model": "mlp", "inputs": [_fp32("input", [2, 15], [0.0] * 30)]}, model="mlp",
        rule=r"input 'input': shape \[2, 15\] does not match \[n, 16\]"),
    "data length": Case(
        {"model": "mlp", "inputs": [_fp32("input", [2, 16], [0.0] * 31)]}, model="mlp",
        rule=r"input 'input': data has 31 elements but shape \[2, 16\] needs 32"),
    "unknown datatype": Case(
        {"model": "identity", "inputs": [_fp32("x", [1], [1.0], "FP128")]},
        rule=r"input 'x': unknown datatype 'FP128'"),
    "BYTES to a numeric model": Case(
        {"model": "mlp", "inputs": [_fp32("input", [1, 16], ["a"] * 16, "BYTES")]}, model="mlp",
        rule=r"input 'input': datatype BYTES is not accepted \(accepted: FP32\)"),
    "wrong input name": Case(
        {"model": "mlp", "inputs": [_fp32("inp", [1, 16], [0.0] * 16)]}, model="mlp",
        rule=r"model 'mlp' needs input\(s\) 'input'; got 'inp'"),
    "input the model does not have": Case(
        {"model": "mlp", "inputs": [_fp32("input", [1, 16], [0.0] * 16),
                                    _fp32("bias", [1, 4], [0.0] * 4)]}, model="mlp",
        rule=r"input 'bias' is not an input of model 'mlp'"),
    "input without a name": Case(
        {"model": "identity", "inputs": [{"shape": [1], "datatype": "FP32", "data": [1.0]}]},
        rule=r"input #0: missing 'name'"),
    "unregistered model": Case(
        {"model": "no-such-model", "inputs": [_fp32("x", [1], [1.0])]}, error=UnknownModel,
        rule=r"model 'no-such-model' is not registered"),
    "registered model this worker does not host": Case(
        {"model": "gated", "inputs": [_fp32("index", [1, 1], [1.0], "FP64")]}, error=UnknownModel,
        rule=r"^Request for unknown model: 'gated' is not found \(request [^)]+\): model 'gated' is "
             r"not hosted by this worker \(it hosts: identity,"),
    "NaN where the model forbids it": Case(
        {"model": "mlp", "inputs": [_fp32("input", [1, 16], _mlp_row(3, float("nan")))]},
        model="mlp", rule=r"input 'input': NaN and infinite values are not accepted \(element 3 is nan\)"),
    "Inf where the model forbids it": Case(
        {"model": "mlp", "inputs": [_fp32("input", [2, 16], _mlp_row(17, float("-inf"), rows=2))]},
        model="mlp", rule=r"input 'input': NaN and infinite values are not accepted \(element 17 is -inf\)"),
    "payload over the limit": Case(
        raw=lambda rid: envelope(rid, "infer.identity", json.dumps(
            [[], {"model": "identity", "inputs": [_fp32("x", [1], ["a" * SESSION_MAX_PAYLOAD_BYTES],
                                                         "BYTES")]}, {}]).encode()),
        rule=rf"message body of \d+ bytes is over the limit of {SESSION_MAX_PAYLOAD_BYTES} bytes "
             r"\(ASYNCINFER_MAX_PAYLOAD_BYTES\)"),
    "batch over max_batch_size": Case(
        _identity_x(33), rule=r"33 rows exceed max_batch_size 32 of model 'identity'"),
    "malformed JSON": Case(
        raw=lambda rid: task_message(TASK_NAME, rid, _identity_x(1), "infer.identity")[:-60],
        rule=r"the message on infer.identity is malformed and was dropped \(JSONDecodeError"),
    "no keyword arguments": Case(
        {}, rule=r"'model' must be a non-empty string; it is missing"),
    "no model": Case(
        {"inputs": [_fp32("x", [1], [1.0])]}, rule=r"'model' must be a non-empty string; it is missing"),
    "no inputs": Case({"model": "identity"}, rule=r"missing 'inputs'"),
    "body not [args, kwargs, embed]": Case(
        raw=lambda rid: envelope(rid, "infer.identity", json.dumps(_identity_x(1)).encode()),
        rule=r"the message body must be \[args, kwargs, embed\] \(Celery task protocol 2\)"),
    "positional arguments": Case(
        raw=lambda rid: envelope(rid, "infer.identity", json.dumps([[1, 2], {}, {}]).encode()),
        rule=r"positional arguments are not accepted"),
    "pickle content type": Case(
        raw=lambda rid: envelope(rid, "infer.identity", pickle.dumps(((), _identity_x(1), {})),
                                 content_type="application/x-python-serialize"),
        rule=r"content type 'application/x-python-serialize' is refused: only json and msgpack "
             r"are accepted, never pickle"),
}


def send(client, redis_client, case: Case, request_id: str):
    """Put ``case`` on its queue as ``request_id``; return the request's future."""
    if case.raw is not None:
        future = client.future(request_id)
        redis_client.lpush(queue_for(case.model), case.raw(request_id))
        return future
    assert case.kwargs is not None
    return client.send(TASK_NAME, queue_for(case.model), dict(case.kwargs), request_id=request_id)


def assert_refused(future, case: Case) -> None:
    with pytest.raises(case.error) as err:
        future.result(timeout=60)
    assert type(err.value) is case.error
    message = str(err.value)
    if message.startswith("Request for unknown model: "):  # Triton's words first, then the ID
        assert f" (request {future.id}): " in message, message
    else:
        assert message.startswith(f"request {future.id}: "), message
    assert re.search(case.rule, message), message


def assert_serves(client, value: int) -> None:
    response = client.infer("identity", np.array([[value]], np.int32), timeout_s=60)
    assert response["input"].tolist() == [[value]]


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_request_fails_naming_itself_and_the_rule(client, redis_client, kind: str) -> None:
    # Given one bad request of this kind on the queue
    case = CASES[kind]
    future = send(client, redis_client, case, f"bad-{uuid.uuid4().hex}")
    # Then it fails with an error naming the request and the rule
    assert_refused(future, case)
    # And the worker serves the next good request
    assert_serves(client, 7)


def test_bad_requests_among_good_ones_fail_alone(client, redis_client, worker) -> None:
    # Given every kind of bad request interleaved with good ones, all sent before any is answered,
    # plus a malformed message that names no request at all
    redis_client.lpush("infer.identity", "{not json, and no request ID")
    sent = []
    for i, (kind, case) in enumerate(CASES.items()):
        good = client.submit("identity", np.array([[i]], np.int32))
        sent.append((kind, case, send(client, redis_client, case, f"mix-{uuid.uuid4().hex}"), good))
    # Then each bad one fails with its own error, and each good one gets its own rows back
    for i, (kind, case, bad, good) in enumerate(sent):
        assert good.result(timeout=60)["input"].tolist() == [[i]], kind
        assert_refused(bad, case)
    assert "dropped a malformed message on infer.identity" in worker.log()
    assert_serves(client, 99)


def test_a_model_that_forbids_nonfinite_values_says_which_input(client) -> None:
    # mlp refuses NaN and infinity in its input; identity passes them through
    x = np.ones((3, 16), np.float32)
    x[2, 5] = np.inf
    with pytest.raises(InvalidRequest, match=r"input 'input': NaN and infinite values are not "
                                             r"accepted \(element 37 is inf\)"):
        client.infer("mlp", x, timeout_s=60)
    assert np.isinf(client.infer("identity", x, timeout_s=60)["input"][2, 5])


def test_submit_refuses_a_payload_over_the_limit(redis_url, worker) -> None:
    from asyncinfer.client import Client
    from asyncinfer.config.settings import Settings

    # Given a client whose limit is 1000 bytes
    settings = Settings.from_env(broker_url=redis_url, max_payload_bytes=1000)
    with Client(settings=settings) as small:
        # When a request over it is submitted, Then submit raises at once, naming request and limit
        with pytest.raises(InvalidRequest, match=r"request big-1: message body of at least \d+ bytes "
                                                 r"is over the limit of 1000 bytes"):
            small.submit("identity", np.zeros((1, 400), np.float32), request_id="big-1")
        assert "big-1" not in small.watcher._callbacks
        # And a request under it goes through
        assert small.infer("identity", np.zeros((1, 4), np.float32), timeout_s=60)["input"].shape == (1, 4)
