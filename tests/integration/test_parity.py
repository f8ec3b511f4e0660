"""One pipeline, two transports: every behaviour of the README's delivery and policy tables, run
against a worker on the fast consumer and a worker whose Celery consumer feeds the pipeline
through kombu (``ASYNCINFER_CONSUMER=celery``), with the same assertions — the state and error each request
ends with, how often the model ran it, the worker's metrics and its one failure line."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
import redis
import torch
from celery.exceptions import SoftTimeLimitExceeded, TaskRevokedError

from asyncinfer.client import Client
from asyncinfer.constants import TASK_NAME
from asyncinfer.errors import InvalidRequest, ModelError, TransientModelError
from asyncinfer.models.builtin import MLP
from asyncinfer.ops.redis_server import free_port
from asyncinfer.wire.messages import task_message
from asyncinfer.wire.reply import REPLY_TO
from tests.support.databases import RedisDatabases
from tests.support.metrics import scrape, value
from tests.support.processes import WorkerProcess, start_worker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

#: Retries of a transient failure: two (three runs at most).
MAX_RETRIES = 2
CALLBACKS = "parity.callbacks"


@dataclass
class Target:
    """A worker on one consumer, its client and its broker."""

    consumer: str
    worker: WorkerProcess
    client: Client
    redis: redis.Redis
    metrics_port: int
    prefix: str

    def metric(self, name: str, model: str, **labels: str) -> float:
        return value(scrape(self.metrics_port), name, model=model, device="cpu", **labels)

    def runs(self, index: int) -> int:
        return int(self.redis.llen(f"{self.prefix}:runs:{index}"))

    def failure_lines(self, request_id: str) -> int:
        return self.worker.log().count(f"request {request_id} failed:")


@pytest.fixture(scope="module", params=["fast", "celery"])
def target(request: pytest.FixtureRequest, redis_databases: RedisDatabases,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    consumer = request.param
    with redis_databases.take(f"parity-{consumer}") as db:
        port = free_port()
        prefix = f"parity-{consumer}"
        proc = start_worker(db.url, tmp_path_factory.mktemp(consumer) / "worker.log",
                            "--device", "cpu", "--models", "flaky,sleep,mlp",
                            "--hostname", f"parity-{consumer}@%h", "--metrics-port", str(port),
                            ASYNCINFER_CONSUMER=consumer, ASYNCINFER_MAX_RETRIES=str(MAX_RETRIES),
                            ASYNCINFER_RETRY_BACKOFF_S="0.05", ASYNCINFER_RETRY_BUDGET_MIN="1000",
                            FLAKY_REDIS_URL=db.url, FLAKY_PREFIX=prefix)
        r = redis.Redis.from_url(db.url)
        client = Client(broker_url=db.url)
        try:
            log = proc.log()
            assert ("fast consumer on" in log) == (consumer == "fast")
            assert ("the pipeline serves what Celery's consumer receives" in log) == (
                consumer == "celery")
            yield Target(consumer, proc, client, r, port, prefix)
        finally:
            client.close()
            proc.stop()
            r.close()


def _index() -> int:
    return uuid.uuid4().int % 10**9


def _flaky(index: int, failures: int) -> np.ndarray:
    return np.array([[index, failures]], np.float64)


def _one_failure_line(target: Target, request_id: str) -> None:
    """The failure of ``request_id`` is logged, once (the line may follow the stored result)."""
    wait_for(lambda: target.failure_lines(request_id) >= 1, 10, f"the failure line of {request_id}")
    assert target.failure_lines(request_id) == 1


def _send_flaky(target: Target, index: int, request_id: str, **options: object) -> None:
    """Send one flaky request with Celery's ``send_task`` and ``options`` (countdown, expires)."""
    target.client.app.send_task(TASK_NAME, kwargs={"model": "flaky", "inputs": [
        {"name": "input", "datatype": "FP64", "shape": [1, 2], "data": [index, 0]}]},
        queue="infer.flaky", task_id=request_id, **options)


def _callbacks(r: redis.Redis, count: int) -> list[dict]:
    """The next ``count`` messages on the callbacks queue (nobody consumes it), oldest first."""
    wait_for(lambda: r.llen(CALLBACKS) >= count, 30, f"{count} callback messages")
    raws = [r.rpop(CALLBACKS) for _ in range(count)]
    return [json.loads(raw) for raw in raws if raw is not None]


# -- ends --------------------------------------------------------------------------------------


def test_success_is_stored_and_counted(target: Target) -> None:
    before = target.metric("asyncinfer_inference_request_success_total", "mlp")
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
    out = target.client.infer("mlp", x, timeout_s=60)["output"]
    with torch.no_grad():
        expected = MLP().net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    wait_for(lambda: target.metric("asyncinfer_inference_request_success_total", "mlp") == before + 1,
             10, "the success counted")


def test_bad_input_fails_once_names_the_request_and_is_not_retried(target: Target) -> None:
    before = target.metric("asyncinfer_inference_request_failure_total", "flaky",
                           reason="InvalidRequest")
    # flaky takes [n, 2]: sent past the client's check (it refuses it at submit)
    bad = target.client.sender.send_watched(target.client.submission(
        "flaky", np.zeros((1, 3), np.float64), check=False))
    with pytest.raises(InvalidRequest, match=rf"request {bad.id}: .*input"):
        bad.result(timeout=60)
    _one_failure_line(target, bad.id)
    wait_for(lambda: target.metric("asyncinfer_inference_request_failure_total", "flaky",
                                   reason="InvalidRequest") == before + 1, 10, "the failure counted")
    # and it goes on serving
    assert target.client.infer("flaky", _flaky(_index(), 0), timeout_s=60)["output"].shape == (1, 2)


def test_transient_failure_is_retried_then_succeeds(target: Target) -> None:
    before = target.metric("asyncinfer_inference_retries_total", "flaky")
    index = _index()
    out = target.client.infer("flaky", _flaky(index, 1), timeout_s=60)["output"]
    assert out.tolist() == [[float(index), 1.0]]
    assert target.runs(index) == 2
    wait_for(lambda: target.metric("asyncinfer_inference_retries_total", "flaky") == before + 1, 10,
             "the retry counted")


def test_retries_end_after_max_retries_with_the_transient_error(target: Target) -> None:
    index = _index()
    future = target.client.submit("flaky", _flaky(index, 10))
    with pytest.raises(TransientModelError, match=rf"request {future.id}: model 'flaky' raised "
                                                  r"TransientError"):
        future.result(timeout=60)
    assert target.runs(index) == MAX_RETRIES + 1
    _one_failure_line(target, future.id)


def test_a_model_error_is_not_retried(target: Target) -> None:
    index = _index()
    future = target.client.submit("flaky", _flaky(index, -1))
    with pytest.raises(ModelError, match=rf"request {future.id}: model 'flaky' raised RuntimeError"):
        future.result(timeout=60)
    assert target.runs(index) == 1
    _one_failure_line(target, future.id)


def test_soft_time_limit_fails_with_celerys_exception_after_its_retries(target: Target) -> None:
    future = target.client.submit("sleep", np.array([[0.5]], np.float32), soft_time_limit_s=0.1)
    with pytest.raises(SoftTimeLimitExceeded, match=rf"request {future.id}: soft time limit"):
        future.result(timeout=60)
    _one_failure_line(target, future.id)


# -- admission ---------------------------------------------------------------------------------


def test_revoked_while_it_waits_is_revoked_and_never_runs(target: Target) -> None:
    # Held by the worker until its eta; revoked meanwhile (Celery stores REVOKED at once): when
    # the eta comes, the worker's admission finds it revoked and never runs it.
    before = target.metric("asyncinfer_inference_request_revoked_total", "flaky")
    index, request_id = _index(), str(uuid.uuid4())
    _send_flaky(target, index, request_id, countdown=2.0)
    wait_for(lambda: target.redis.hlen("unacked") >= 1, 10, "the worker holding the request")
    replies = target.client.app.control.revoke(request_id, reply=True, timeout=5)
    assert replies, "the worker confirmed the revocation"
    with pytest.raises(TaskRevokedError):
        target.client.result(request_id, timeout_s=30)
    wait_for(lambda: target.metric("asyncinfer_inference_request_revoked_total", "flaky")
             == before + 1, 30, "the revocation counted at the eta")
    assert target.runs(index) == 0
    wait_for(lambda: not target.redis.hlen("unacked"), 10, "the revoked request acknowledged")


def test_expired_before_it_runs_is_revoked_as_expired(target: Target) -> None:
    before = target.metric("asyncinfer_inference_request_revoked_total", "flaky")
    index, request_id = _index(), str(uuid.uuid4())
    _send_flaky(target, index, request_id, expires=datetime.now(timezone.utc) - timedelta(seconds=5))
    with pytest.raises(TaskRevokedError, match="expired"):
        target.client.result(request_id, timeout_s=60)
    assert target.runs(index) == 0
    wait_for(lambda: target.metric("asyncinfer_inference_request_revoked_total", "flaky")
             == before + 1, 10, "the expiry counted")


def test_a_countdown_delays_the_run_until_its_eta(target: Target) -> None:
    index, request_id = _index(), str(uuid.uuid4())
    sent_at = time.time()
    _send_flaky(target, index, request_id, countdown=2.0)
    out = target.client.result(request_id, timeout_s=60)["output"]
    assert out.tolist() == [[float(index), 0.0]]
    first_run_at = float(target.redis.lindex(f"{target.prefix}:runs:{index}", 0) or 0)
    assert first_run_at >= sent_at + 1.9


def test_another_task_on_an_infer_queue_is_refused_unrun(target: Target) -> None:
    result = target.client.app.send_task("celery.accumulate", args=(1, 2), queue="infer.flaky")
    with pytest.raises(InvalidRequest, match=rf"request {result.id}: task 'celery.accumulate' is "
                                             r"refused: only asyncinfer.infer is served on queue "
                                             r"infer.flaky"):
        result.get(timeout=60, propagate=True)


def test_a_redelivered_request_whose_result_is_stored_is_not_run_again(target: Target) -> None:
    index, request_id = _index(), str(uuid.uuid4())
    stored = {"model_name": "flaky", "id": request_id, "outputs": [], "parameters": {}}
    target.client.app.backend.store_result(request_id, stored, "SUCCESS")
    body = {"model": "flaky", "inputs": [{"name": "input", "datatype": "FP64", "shape": [1, 2],
                                          "data": [index, 0]}]}
    message = json.loads(task_message(TASK_NAME, request_id, body, "infer.flaky"))
    message["headers"]["redelivered"] = True
    target.redis.lpush("infer.flaky", json.dumps(message))
    wait_for(lambda: target.redis.llen("infer.flaky") == 0 and not target.redis.hlen("unacked"),
             30, "the redelivered copy taken and acknowledged")
    # a request sent after it is answered first-come: by then the copy was handled
    assert target.client.infer("flaky", _flaky(_index(), 0), timeout_s=60)["output"].shape == (1, 2)
    assert target.runs(index) == 0
    assert target.client.result(request_id, timeout_s=5).raw == stored
    assert "was redelivered but its result (SUCCESS) is already stored" in target.worker.log()


def test_a_malformed_message_fails_alone_and_the_worker_goes_on(target: Target) -> None:
    # Given a line that is not JSON, and a cut-off envelope whose text still names its request,
    # pushed raw on the queue between two good requests
    named = str(uuid.uuid4())
    body = {"model": "flaky", "inputs": [{"name": "input", "datatype": "FP64", "shape": [1, 2],
                                          "data": [_index(), 0]}]}
    cut = task_message(TASK_NAME, named, body, "infer.flaky")[:-40]
    first, second = target.client.future(str(uuid.uuid4())), target.client.future(str(uuid.uuid4()))
    failed = target.client.future(named)
    pipe = target.redis.pipeline()
    pipe.lpush("infer.flaky", task_message(TASK_NAME, first.id, body, "infer.flaky"))
    pipe.lpush("infer.flaky", "{not json")
    pipe.lpush("infer.flaky", cut)
    pipe.lpush("infer.flaky", task_message(TASK_NAME, second.id, body, "infer.flaky"))
    pipe.execute()
    # Then the named one fails for its ID, saying it was malformed; the other is logged and dropped
    with pytest.raises(InvalidRequest, match=rf"request {named}: the message on infer.flaky is "
                                             r"malformed and was dropped"):
        failed.result(timeout=60)
    _one_failure_line(target, named)
    wait_for(lambda: "dropped a malformed message on infer.flaky (JSONDecodeError"
             in target.worker.log(), 10, "the line of the message that names no request")
    # And the good ones on both sides are answered by the same process, nothing left behind
    assert first.result(timeout=60)["output"].shape == (1, 2)
    assert second.result(timeout=60)["output"].shape == (1, 2)
    wait_for(lambda: not target.redis.hlen("unacked"), 10, "every message acknowledged")
    assert target.redis.llen("infer.flaky") == 0
    assert target.worker.process.poll() is None
    assert "Unrecoverable error" not in target.worker.log()


# -- links -------------------------------------------------------------------------------------


def test_link_and_link_error_are_sent_as_messages(target: Target) -> None:
    app = target.client.app
    on_success = app.signature("parity.on_success", queue=CALLBACKS)
    on_failure = app.signature("parity.on_failure", queue=CALLBACKS)
    good = target.client.submit("flaky", _flaky(_index(), 0), link=on_success)
    good.result(timeout=60)
    [sent] = _callbacks(target.redis, 1)
    assert sent["headers"]["task"] == "parity.on_success"
    assert sent["headers"]["parent_id"] == good.id
    bad = target.client.submit("flaky", _flaky(_index(), -1), link_error=on_failure)
    with pytest.raises(ModelError):
        bad.result(timeout=60)
    [errback] = _callbacks(target.redis, 1)
    assert errback["headers"]["task"] == "parity.on_failure"
    assert errback["headers"]["parent_id"] == bad.id


def test_the_worker_log_has_no_traceback_of_celerys_tracer(target: Target) -> None:
    # every failure above has its one line; Celery's tracer's own ERROR lines are not there
    assert "raised unexpected" not in target.worker.log()


def test_a_callback_asking_for_pickle_is_sent_as_json(target: Target) -> None:
    # a producer's link and link_error name pickle as their serializer: the worker that calls
    # them publishes json all the same (it never sends pickle)
    app = target.client.app
    on_success = app.signature("parity.on_success", queue=CALLBACKS, serializer="pickle")
    on_failure = app.signature("parity.on_failure", queue=CALLBACKS, serializer="pickle")
    good = target.client.submit("flaky", _flaky(_index(), 0), link=on_success)
    good.result(timeout=60)
    bad = target.client.submit("flaky", _flaky(_index(), -1), link_error=on_failure)
    with pytest.raises(ModelError):
        bad.result(timeout=60)
    sent = _callbacks(target.redis, 2)
    assert sorted(m["headers"]["task"] for m in sent) == ["parity.on_failure", "parity.on_success"]
    assert [m["content-type"] for m in sent] == ["application/json", "application/json"]


def test_final_states_reach_the_sender_through_its_reply_channel_alone(target: Target) -> None:
    # Given a client whose watcher never looks a request up: announcements on its reply channel
    # are all it can hear (wire/reply.py)
    client = Client(broker_url=str(target.client.app.conf.broker_url))
    client.watcher.sweep_first_s = 3600.0
    try:
        # When it sends a good request, a bad one, and (through Celery's send_task, naming its
        # reply channel in a header) one that expired before it could run
        x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
        good = client.submit("mlp", x)
        bad = client.sender.send_watched(client.submission(  # past the client's input check
            "mlp", np.zeros((1, 3), np.float32), check=False))
        expired_id, heard = str(uuid.uuid4()), []
        client.watcher.watch(expired_id, heard.append, announced=True)
        target.client.app.send_task(
            TASK_NAME, kwargs={"model": "flaky", "inputs": [
                {"name": "input", "datatype": "FP64", "shape": [1, 2], "data": [_index(), 0]}]},
            queue="infer.flaky", task_id=expired_id, headers={REPLY_TO: client.watcher.channel},
            expires=datetime.now(timezone.utc) - timedelta(seconds=5))
        # Then each ends as it should, heard on the reply channel alone
        with torch.no_grad():
            expected = MLP().net(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(good.result(timeout=30)["output"], expected, rtol=1e-5, atol=1e-6)
        with pytest.raises(InvalidRequest, match=bad.id):
            bad.result(timeout=30)
        wait_for(lambda: bool(heard), 30, "the expired request's REVOKED")
        assert heard[0]["status"] == "REVOKED" and heard[0]["task_id"] == expired_id
        # and it subscribed to no request's own channel, and never fell back to doing so
        assert not client.watcher._keyed and client.watcher._fallback_until == 0.0
    finally:
        client.close()
