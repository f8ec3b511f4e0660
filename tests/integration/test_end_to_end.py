"""End to end through a real worker process and a real Redis server: the wire contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from asyncinfer.errors import UnknownModel
from asyncinfer.models.builtin import MLP
from asyncinfer.wire.keys import CLAIM_PREFIX, TRACES_KEY
from tests.support.marks import ForwardMarks
from tests.support.processes import ROOT, worker_env

pytestmark = pytest.mark.timeout(120)

# One value per datatype, with edge values; each must come back exactly.
SAMPLES = {
    "BOOL": np.array([[True, False, False, True]]),
    "UINT8": np.array([[0, 255]], np.uint8),
    "UINT16": np.array([[0, 65535]], np.uint16),
    "UINT32": np.array([[0, 2**32 - 1]], np.uint32),
    "UINT64": np.array([[0, 2**64 - 1]], np.uint64),
    "INT8": np.array([[-128, 127]], np.int8),
    "INT16": np.array([[-32768, 32767]], np.int16),
    "INT32": np.array([[-(2**31), 2**31 - 1]], np.int32),
    "INT64": np.array([[-(2**63), 2**63 - 1]], np.int64),
    "FP16": np.array([[0.1, -65504.0, np.inf]], np.float16),
    "FP32": np.array([[0.1, -3.4e38, 1e-45, np.nan, -0.0, np.inf]], np.float32),
    "FP64": np.array([[0.1, 1e308, -5e-324]], np.float64),
}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_identity_round_trips_every_datatype(client, serializer: str) -> None:
    # Given one input of every numeric datatype plus BYTES and BF16, in one request
    inputs = {name.lower(): value for name, value in SAMPLES.items()}
    bf16 = torch.tensor([[1.5, -2.0, 3.0e38]], dtype=torch.bfloat16)
    inputs["bf16"] = bf16
    words = np.array([["plain", "ünïcode", ""]], dtype=object)
    inputs["bytes"] = words
    # When it goes through identity
    response = client.infer("identity", inputs, serializer=serializer, timeout_s=60)
    # Then every output equals its input exactly, with the same datatype
    for name, value in SAMPLES.items():
        assert response.outputs[name.lower()]["datatype"] == name
        assert _same(response[name.lower()], value), name
    assert torch.equal(response.as_torch("bf16"), bf16)
    assert response.outputs["bf16"]["datatype"] == "BF16"
    assert response["bytes"].tolist() == [["plain", "ünïcode", ""]]  # str stays str
    # And the data comes back in the encoding the request used
    data = response.raw["outputs"][0]["data"]
    assert isinstance(data, bytes) if serializer == "msgpack" else isinstance(data, list)
    assert response.parameters["device"] == "cpu"
    assert response.parameters["worker"].startswith("test-cpu@")
    assert response.parameters["batch_size"] >= 1


def test_binary_bytes_elements_round_trip(client) -> None:
    raw = [b"\x00\xff\xfe", b"ok"]
    response = client.infer("identity", {"blob": np.array(raw, dtype=object)},
                            serializer="msgpack", timeout_s=60)
    assert response["blob"].tolist() == raw


def test_mlp_matches_a_direct_call(client) -> None:
    x = np.random.default_rng(1).random((5, 16), np.float32)
    expected = MLP().net(torch.from_numpy(x)).detach().numpy()
    response = client.infer("mlp", x, timeout_s=60)
    assert response.model_name == "mlp"
    assert response["output"].shape == (5, 4)
    np.testing.assert_allclose(response["output"], expected, rtol=1e-5, atol=1e-6)
    params = response.parameters
    assert set(params) >= {"worker", "device", "batch_size", "queue_ms", "compute_ms"}
    assert params["batch_size"] >= 5 and params["compute_ms"] >= 0 and params["queue_ms"] >= 0


def test_user_model_from_import_path(client) -> None:
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    response = client.infer("affine", {"x": x}, timeout_s=60)
    np.testing.assert_array_equal(response["y"], x * 3 + 1)


def test_map_returns_results_in_input_order(client) -> None:
    # Requests of different sizes, so that completion order differs from input order
    values = [np.full((1 + i % 3, 1), float(i), np.float32) for i in range(40)]
    results = list(client.map("identity", values, timeout_s=60))
    assert [r["input"][0, 0] for r in results] == [float(i) for i in range(40)]
    assert [r["input"].shape[0] for r in results] == [1 + i % 3 for i in range(40)]


def test_a_request_s_trace_is_gone_once_its_result_is_stored(
        client, redis_url) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    # Given requests with generated IDs (the lost check on: each traced with its push)
    futures = [client.submit("identity", np.array([[float(i)]], np.float32)) for i in range(30)]
    # Then each one is answered, and its result, not its trace, says from then on it existed
    assert [float(f.result(timeout=60)["input"][0, 0]) for f in futures] == [float(i) for i in range(30)]
    assert r.hmget(TRACES_KEY, [f.id for f in futures]) == [None] * 30
    assert not any(r.exists(CLAIM_PREFIX + f.id) for f in futures)
    r.close()


def test_map_answers_the_first_rows_while_later_ones_are_unsent_and_shows_progress(
        client, capsys) -> None:
    # Given 2,000 rows read lazily (a generator: map cannot see them all first), a window of 64
    read: list[int] = []

    def rows():
        for i in range(2000):
            read.append(i)
            yield np.array([[float(i)]], np.float32)

    answers = client.map("identity", rows(), timeout_s=60, window=64, progress=True)
    # When the first answer comes back
    first = next(answers)
    # Then it is row 0's, and no more than the window has been read (and sent) so far
    assert first["input"].tolist() == [[0.0]]
    assert len(read) <= 64
    # And the rest come back in order, the window never wider than 64 rows read ahead
    for i, answer in enumerate(answers, start=1):
        assert answer["input"].tolist() == [[float(i)]]
        assert len(read) - i <= 64
    assert len(read) == 2000
    # And the progress bar counted every row on stderr
    assert "2000row" in capsys.readouterr().err.replace(" ", "")


def test_map_refuses_a_window_under_one(client) -> None:
    with pytest.raises(ValueError, match="map: window must be at least 1, got 0"):
        next(client.map("identity", [np.zeros((1, 1), np.float32)], window=0))


def test_concurrent_requests_each_get_their_own_rows(client) -> None:
    # Given many requests in flight at once, each carrying rows that identify it
    futures = [client.submit("identity", np.full((1 + i % 4, 2), i, np.int32)) for i in range(200)]
    responses = [f.result(timeout=60) for f in futures]
    # Then each response holds exactly its own rows, and batching did happen
    for i, response in enumerate(responses):
        np.testing.assert_array_equal(response["input"], np.full((1 + i % 4, 2), i, np.int32))
        assert response.id == futures[i].id
    assert max(r.parameters["batch_size"] for r in responses) > 4


def test_result_lookup_by_id_from_a_second_process(client, redis_url) -> None:
    future = client.submit("identity", np.array([[7, 8, 9]], np.int16),
                           request_id="lookup-" + uuid.uuid4().hex)
    future.result(timeout=60)
    code = ("import sys, json; from asyncinfer import Client; c = Client(); "
            "r = c.result(sys.argv[1], timeout_s=30); print(json.dumps(r['input'].tolist())); c.close()")
    out = subprocess.run([sys.executable, "-c", code, future.id], env=worker_env(redis_url), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[7, 8, 9]]
    # and Celery's own AsyncResult sees the same response under the request ID
    stored = future.async_result.get(timeout=10)
    assert stored["id"] == future.id and stored["outputs"][0]["data"] == [7, 8, 9]


def test_done_callbacks_fire_once(client) -> None:
    calls: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    futures = [client.submit("mlp", np.ones((1, 16), np.float32)) for _ in range(20)]

    def record(f) -> None:
        with lock:
            calls.append(f.id)
            if len(calls) == len(futures):
                done.set()

    for f in futures:
        f.add_done_callback(record)
    assert done.wait(60)
    for f in futures:
        f.result(timeout=5)
    assert sorted(calls) == sorted(f.id for f in futures)


def test_unknown_model_on_a_hosted_queue_is_refused(client) -> None:
    # A producer may put any model name in a message on a queue this worker consumes
    from asyncinfer.constants import TASK_NAME

    result = client.app.send_task(TASK_NAME, kwargs={"model": "no-such-model", "inputs": []},
                                  queue="infer.identity")
    with pytest.raises(UnknownModel, match=f"request {result.id}: model 'no-such-model' is not registered"):
        result.get(timeout=60)


def test_one_poisoned_request_does_not_fail_its_batch(client, worker, redis_client) -> None:
    # Given a slow request occupying the device, then good and poisoned requests queued behind it
    marks = ForwardMarks(redis_client, "poison")
    blocker = client.submit("poison", np.array([[100.5]], np.float32))
    _wait_started(blocker)
    marks.wait_on_device(100.5)  # the blocker is on the device; the next requests queue up behind it
    good = [client.submit("poison", np.array([[float(i)]], np.float32)) for i in range(6)]
    bad = client.submit("poison", np.array([[-1.0]], np.float32))
    good += [client.submit("poison", np.array([[float(i)]], np.float32)) for i in range(6, 10)]
    blocker.result(timeout=60)
    # Then only the poisoned request fails, naming itself; the others get their own rows back
    with pytest.raises(Exception, match=f"request {bad.id}: model 'poison' raised RuntimeError"):
        bad.result(timeout=60)
    for i, f in enumerate(good):
        assert f.result(timeout=60)["output"].tolist() == [[2.0 * i]]
    # And they really had shared a batch, which was then re-run request by request
    sizes = [int(n) for n in re.findall(r"model poison: batch of (\d+) requests raised", worker.log())]
    assert sizes and max(sizes) >= 2


def _wait_started(future, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while future.async_result.state == "PENDING" and time.monotonic() < deadline:
        time.sleep(0.02)


def test_cancel_revokes_a_queued_request(client, redis_client) -> None:
    # Given the sleep model busy with a long request, and a request queued behind it
    marks = ForwardMarks(redis_client, "sleep")
    blocker = client.submit("sleep", np.array([[1.5]], np.float32))
    _wait_started(blocker)
    marks.wait_on_device(1.5)  # the blocker's batch is on the device, so the next one cannot join it
    queued = client.submit("sleep", np.array([[0.0]], np.float32))
    # When the queued one is cancelled
    assert queued.cancel() is True
    assert queued.cancelled()
    blocker.result(timeout=60)
    # Then Celery records it as revoked and it never produces a result
    state = None
    for _ in range(50):
        state = queued.async_result.state
        if state == "REVOKED":
            break
        threading.Event().wait(0.1)
    assert state == "REVOKED"


def test_result_timeout_raises(client) -> None:
    future = client.submit("sleep", np.array([[1.0]], np.float32))
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    assert future.result(timeout=60)["output"].tolist() == [[1.0]]


def test_results_go_to_a_separate_result_backend(redis_url, redis_db, tmp_path) -> None:
    # Given a worker and a client whose result backend is another Redis database than the broker
    from asyncinfer.client import Client
    from asyncinfer.config.settings import Settings
    from tests.support.processes import start_worker

    backend_url = redis_db.url
    proc = start_worker(redis_url, tmp_path / "w.log", "--device", "cpu", "--models", "split",
                        "--hostname", "split-backend@%h", ASYNCINFER_RESULT_BACKEND=backend_url,
                        ASYNCINFER_MODEL_FACTORIES="split=asyncinfer.models.builtin:Identity",
                        ASYNCINFER_CONSUMER="fast")
    client = Client(settings=Settings.from_env(broker_url=redis_url, result_backend=backend_url))
    try:
        # When a request runs
        future = client.submit("split", np.array([[5, 6]], np.int16),
                               request_id="split-" + uuid.uuid4().hex)
        assert future.result(timeout=60)["input"].tolist() == [[5, 6]]
        # Then its result is stored in the backend's database, not the broker's, and it was acked
        import redis

        key = f"celery-task-meta-{future.id}"
        broker, backend = redis.Redis.from_url(redis_url), redis.Redis.from_url(backend_url)
        assert backend.exists(key) == 1 and broker.exists(key) == 0
        def still_unacked() -> bool:
            return any(future.id.encode() in v for v in broker.hvals("unacked"))

        deadline = time.monotonic() + 10
        while still_unacked() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not still_unacked()
    finally:
        client.close()
        proc.stop()


def test_a_request_past_its_expires_never_runs_and_says_it_expired(client) -> None:
    from celery.exceptions import TaskRevokedError

    # Given a request already expired when it reaches the worker
    stale = client.submit("identity", np.array([[1]], np.int8), expires=-1.0)
    with pytest.raises(TaskRevokedError, match="expired"):
        stale.result(timeout=60)
    assert stale.async_result.state == "REVOKED"
    # And a request that expires while it waits behind a busy device
    blocker = client.submit("sleep", np.array([[1.25]], np.float32))
    _wait_started(blocker)
    waiting = client.submit("sleep", np.array([[0.0]], np.float32), expires=0.4)
    with pytest.raises(TaskRevokedError, match="expired before it reached the device"):
        waiting.result(timeout=60)
    assert blocker.result(timeout=60)["output"].tolist() == [[1.25]]
    assert waiting.async_result.state == "REVOKED"


def test_an_unreachable_broker_is_reported_at_once() -> None:
    from asyncinfer.client import Client
    from asyncinfer.errors import BrokerUnavailable
    from asyncinfer.ops.redis_server import free_port

    # Given a broker URL where nothing listens
    with Client(broker_url=f"redis://127.0.0.1:{free_port()}/0") as nowhere:
        # When a request is submitted, Then its send fails (the future ends, nothing left
        # hanging) with an error naming the request and the cause
        future = nowhere.submit("identity", np.ones((1, 2), np.float32))
        with pytest.raises(BrokerUnavailable, match=r"request .*: broker unreachable: .*refused"):
            future.sent(timeout_s=30)
        with pytest.raises(BrokerUnavailable, match=rf"request {future.id}: broker unreachable"):
            future.result(timeout=1)


def test_requests_sent_with_a_celery_priority_are_served(client, redis_client) -> None:
    from asyncinfer.constants import PRIORITY_SEP, priority_lists

    payload = {"model": "identity", "inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32",
                                                "data": [7.0]}]}
    # kombu files a message of priority 1..9 under a list of its own: the worker must watch those
    nobody = f"infer.nobody-{uuid.uuid4().hex[:8]}"
    client.app.send_task("asyncinfer.infer", kwargs=payload, queue=nobody, priority=5)
    assert [k for k in priority_lists([nobody]) if redis_client.llen(k)] == [f"{nobody}{PRIORITY_SEP}3"]
    redis_client.delete(*priority_lists([nobody]))
    results = [client.app.send_task("asyncinfer.infer", kwargs=payload, queue="infer.identity",
                                    priority=p) for p in (0, 2, 5, 9)]
    assert [r.get(timeout=60)["outputs"][0]["data"] for r in results] == [[7.0]] * 4
