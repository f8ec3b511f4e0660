"""What a caller is told: an ID reused for another model, a bad request ID, a wait that timed out,
and a result large enough to arrive in many reads."""

from __future__ import annotations

import logging
import uuid

import numpy as np
import pytest

from asyncinfer.client import Client
from asyncinfer.errors import InvalidRequest, RequestIdReused, RequestTimeout

pytestmark = pytest.mark.timeout(120)


def test_a_request_id_reused_for_another_model_is_refused(client) -> None:
    # Given a request with a caller-chosen ID, answered by identity
    rid = f"reuse-{uuid.uuid4().hex[:8]}"
    first = client.submit("identity", {"x": np.ones((1, 2), np.float32)}, request_id=rid)
    assert first.result(timeout=30)["x"].tolist() == [[1.0, 1.0]]
    # When the same ID is sent to another model
    with pytest.raises(RequestIdReused, match=rf"request {rid}: this request ID was already sent "
                                              r"with a different model \(first sent to queue "
                                              r"infer.identity, now to infer.mlp\)"):
        client.submit("mlp", np.ones((1, 16), np.float32), request_id=rid).sent(timeout_s=30)
    # Then nothing waits for it; the same request again gets the first one's answer
    assert list(client.watcher._callbacks).count(rid) == 0
    again = client.submit("identity", {"x": np.ones((1, 2), np.float32)}, request_id=rid)
    assert again.result(timeout=30)["x"].tolist() == [[1.0, 1.0]]
    # and other inputs under the same ID are refused, never answered with the first's outputs
    with pytest.raises(RequestIdReused, match=rf"request {rid}: this request ID was already sent "
                                              r"with a different inputs \(their data"):
        client.submit("identity", {"x": np.zeros((1, 2), np.float32)},
                      request_id=rid).result(timeout=30)


@pytest.mark.parametrize("bad_id", ["two\nlines", "with space", "", "x" * 201, "tab\there"])
def test_a_request_id_must_be_printable_without_whitespace(client, bad_id: str) -> None:
    with pytest.raises(InvalidRequest, match=r"a request ID must be 1 to 200 printable characters"):
        client.submit("identity", {"x": np.ones((1, 1), np.float32)}, request_id=bad_id)
    assert bad_id not in client.watcher._callbacks


def test_a_wait_that_times_out_names_the_request_and_the_time(client) -> None:
    future = client.submit("sleep", np.array([[1.5]], np.float32))
    with pytest.raises(RequestTimeout, match=rf"request {future.id}: no result within 0.2 s") as err:
        future.result(timeout=0.2)
    assert isinstance(err.value, TimeoutError)
    with pytest.raises(TimeoutError, match=rf"request {future.id}: not finished within 0.1 s"):
        future.exception(timeout=0.1)
    assert future.result(timeout=30)["output"].tolist() == [[1.5]]


def test_a_large_result_arrives_without_the_watcher_reconnecting(redis_url, worker, caplog) -> None:
    # Given results of 2 MiB each (the session worker takes bodies up to 4 MiB, base64 encoded)
    x = np.arange(2 * 1024 * 1024 // 4, dtype=np.float32).reshape(1, -1)
    caplog.set_level(logging.WARNING, logger="asyncinfer.client.result_watcher")
    with Client(broker_url=redis_url, serializer="msgpack") as big_client:
        futures = [big_client.submit("identity", {"x": x + i}) for i in range(6)]
        for i, f in enumerate(futures):
            assert f.result(timeout=60)["x"][0, -1] == x[0, -1] + i
    # Then the watcher read each one whole: it never dropped its connection half-way
    assert not [r for r in caplog.records if "lost Redis" in r.getMessage()]
