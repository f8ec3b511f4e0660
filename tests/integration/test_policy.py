"""Policy end to end, with real worker processes on the session Redis (each test its own database):
time limits, retries within a fleet-wide budget, backpressure, idempotency, key expiry."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path

import numpy as np
import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import (
    InvalidRequest,
    ModelError,
    QueueFull,
    RetryBudgetExhausted,
    TransientModelError,
)
from asyncinfer.ops.redis_server import free_port
from asyncinfer.ops.status import cluster_status
from asyncinfer.supervision.processes import pid_alive
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.metrics import scrape, value
from tests.support.processes import WorkerProcess, start_up, start_worker, stop_up, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)


def _flaky(index: int, failures: int) -> np.ndarray:
    return np.array([[index, failures]], np.float64)


def _runs(r: redis.Redis, prefix: str, index: int) -> list[float]:
    return [float(t) for t in r.lrange(f"{prefix}:runs:{index}", 0, -1)]


# -- time limits and backpressure: a worker taking two requests at a time ------------------------


@pytest.fixture(scope="module")
def narrow_worker(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[str, WorkerProcess]]:
    with redis_databases.take("narrow_worker") as db:
        proc = start_worker(db.url, tmp_path_factory.mktemp("narrow") / "worker.log", "--device",
                            "cpu", "--models", "sleep", "--concurrency", "1",
                            "--hostname", "narrow@%h",
                            ASYNCINFER_MAX_RETRIES="0", ASYNCINFER_PREFETCH_MULTIPLIER="2")
        try:
            yield db.url, proc
        finally:
            proc.stop()


def test_soft_time_limit_fails_the_request_and_the_worker_goes_on(
        narrow_worker: tuple[str, WorkerProcess]) -> None:
    url, _ = narrow_worker
    with Client(broker_url=url) as client:
        slow = client.submit("sleep", np.array([[1.5]], np.float32), soft_time_limit_s=0.3)
        with pytest.raises(SoftTimeLimitExceeded, match=rf"request {slow.id}: soft time limit "
                                                        r"\(0.3 s\) exceeded on model 'sleep'"):
            slow.result(timeout=60)
        # The same limit set the way Celery users set it: apply_async's soft_time_limit.
        payload = {"model": "sleep", "inputs": [{"name": "input", "shape": [1, 1],
                                                 "datatype": "FP32", "data": [1.5]}]}
        celery_sent = client.app.send_task("asyncinfer.infer", kwargs=payload, queue="infer.sleep",
                                           soft_time_limit=0.3)
        with pytest.raises(SoftTimeLimitExceeded, match=celery_sent.id):
            celery_sent.get(timeout=60)
        ok = client.infer("sleep", np.array([[0.0]], np.float32), timeout_s=60)
        assert ok["output"].tolist() == [[0.0]]


def test_burst_of_ten_times_the_bound_completes_or_is_refused(
        narrow_worker: tuple[str, WorkerProcess]) -> None:
    url, _ = narrow_worker
    bound = 5
    settings = Settings(broker_url=url, model_options=json.dumps({"sleep": {"max_queue_size": bound}}))
    with Client(settings=settings) as client:
        accepted, refused = [], []
        for i in range(10 * bound):
            try:
                accepted.append((i, client.submit("sleep", np.array([[0.02 + i / 1e6]], np.float32),
                                                  timeout_s=0).sent()))
            except QueueFull as exc:
                assert f"queue infer.sleep holds {bound} requests" in str(exc)
                refused.append(i)
        assert refused and accepted
        assert len(accepted) + len(refused) == 10 * bound
        for i, future in accepted:
            assert future.result(timeout=120)["output"].tolist() == [[pytest.approx(0.02 + i / 1e6)]]
        # With a wait, a burst is taken in full as the worker makes room.
        waited = [client.submit("sleep", np.array([[0.01]], np.float32), timeout_s=60)
                  for _ in range(3 * bound)]
        assert all(f.result(timeout=120)["output"].tolist() == [[pytest.approx(0.01)]] for f in waited)


# -- retries: a worker whose flaky model fails on request ---------------------------------------


RETRY_METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def retry_worker(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[str, redis.Redis]]:
    with redis_databases.take("retry_worker") as db:
        proc = start_worker(db.url, tmp_path_factory.mktemp("retry") / "worker.log", "--device",
                            "cpu", "--models", "flaky", "--hostname", "retry@%h",
                            "--metrics-port", str(RETRY_METRICS_PORT),
                            ASYNCINFER_MAX_RETRIES="3", ASYNCINFER_RETRY_BACKOFF_S="0.05",
                            ASYNCINFER_RETRY_BACKOFF_MAX_S="0.2", ASYNCINFER_RETRY_BUDGET_MIN="1000",
                            ASYNCINFER_RESULT_EXPIRES_S="600",
                            FLAKY_REDIS_URL=db.url, FLAKY_PREFIX="retry")
        try:
            yield db.url, db.client
        finally:
            proc.stop()


def test_transient_failures_are_retried_until_success(retry_worker: tuple[str, redis.Redis]) -> None:
    url, r = retry_worker
    with Client(broker_url=url) as client:
        response = client.infer("flaky", _flaky(1, 2), timeout_s=60)
        assert response["output"].tolist() == [[1.0, 2.0]]
        assert len(_runs(r, "retry", 1)) == 3
        # Always failing: the first run and max_retries (3) more, then the failure itself.
        always = client.submit("flaky", _flaky(2, 99))
        with pytest.raises(TransientModelError, match=rf"request {always.id}: model 'flaky' raised"):
            always.result(timeout=60)
        assert len(_runs(r, "retry", 2)) == 4
    samples = scrape(RETRY_METRICS_PORT)
    assert value(samples, "asyncinfer_inference_retries_total", model="flaky", device="cpu") == 2 + 3
    assert value(samples, "asyncinfer_inference_request_success_total", model="flaky", device="cpu") == 1


def test_model_errors_and_bad_input_are_never_retried(retry_worker: tuple[str, redis.Redis]) -> None:
    url, r = retry_worker
    with Client(broker_url=url) as client:
        broken = client.submit("flaky", _flaky(3, -1))
        with pytest.raises(ModelError, match="always fails") as info:
            broken.result(timeout=60)
        assert not isinstance(info.value, TransientModelError)
        assert len(_runs(r, "retry", 3)) == 1
        bad = client.sender.send_watched(client.submission(  # past the client's input check
            "flaky", np.array([[4.0, 0.0, 0.0]]), check=False))
        with pytest.raises(InvalidRequest, match=bad.id):
            bad.result(timeout=60)
        assert _runs(r, "retry", 4) == []


def test_resubmitting_a_request_id_does_not_run_it_again(retry_worker: tuple[str, redis.Redis]) -> None:
    url, r = retry_worker
    request_id = f"idem-{uuid.uuid4()}"
    with Client(broker_url=url) as client:
        first = client.submit("flaky", _flaky(5, 0), request_id=request_id)
        second = client.submit("flaky", _flaky(5, 0), request_id=request_id)
        assert first.result(timeout=60).raw == second.result(timeout=60).raw
    with Client(broker_url=url) as other:  # another process, later: the stored result
        third = other.submit("flaky", _flaky(5, 0), request_id=request_id)
        assert third.result(timeout=60).raw == first.result().raw
    assert len(_runs(r, "retry", 5)) == 1


def test_every_key_written_expires(retry_worker: tuple[str, redis.Redis]) -> None:
    url, r = retry_worker
    with Client(broker_url=url) as client:
        client.infer("flaky", _flaky(6, 1), timeout_s=60, request_id=f"ttl-{uuid.uuid4()}")
    r.delete(*r.keys("retry:runs:*"))  # the test model's own records
    # Queues are emptied by consumption, never by a TTL (that would drop accepted requests);
    # kombu keeps its bindings (`_kombu.*`) and unacknowledged-message bookkeeping itself.
    lasting = {"unacked", "unacked_index", "infer.flaky", "asyncinfer.control"}
    without_ttl = []
    for key in r.scan_iter(count=1000):
        name = key.decode()
        if name in lasting or name.startswith("_kombu."):
            continue
        if r.ttl(key) < 0:
            without_ttl.append(name)
    assert without_ttl == []
    meta = [k for k in r.scan_iter(match="celery-task-meta-*")]
    assert meta and all(0 < r.ttl(k) <= 600 for k in meta)
    claims = list(r.scan_iter(match="asyncinfer:request:*"))  # the client's result_expires_s
    assert claims and all(0 < r.ttl(k) <= 86400 for k in claims)


# -- a retry storm: every request fails, the budget keeps the load bounded -----------------------


def test_retry_storm_stays_within_the_budget(redis_db: RedisDatabase, tmp_path: Path) -> None:
    url = redis_db.url
    requests, ratio, floor = 100, 0.1, 5
    backoff_s, backoff_max_s = 0.3, 0.6
    proc = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "flaky",
                        "--hostname", "storm@%h",
                        ASYNCINFER_MAX_RETRIES="5", ASYNCINFER_RETRY_BACKOFF_S=str(backoff_s),
                        ASYNCINFER_RETRY_BACKOFF_MAX_S=str(backoff_max_s),
                        ASYNCINFER_RETRY_BUDGET_RATIO=str(ratio),
                        ASYNCINFER_RETRY_BUDGET_MIN=str(floor),
                        ASYNCINFER_RETRY_BUDGET_WINDOW_S="300",
                        FLAKY_REDIS_URL=url, FLAKY_PREFIX="storm")
    r = redis.Redis.from_url(url)
    try:
        with Client(broker_url=url) as client:
            futures = [client.submit("flaky", _flaky(i, 99)) for i in range(requests)]
            wait(futures, timeout=150)
            errors = [f.exception(timeout=0) for f in futures]
        runs = {i: _runs(r, "storm", i) for i in range(requests)}
        total = sum(len(v) for v in runs.values())
        print(f"retry storm: {total} executions for {requests} requests")
        # Without the budget: 6 runs each (600). With it: at most ratio × requests + floor retries.
        assert requests < total <= requests * (1 + ratio) + floor
        assert all(isinstance(e, (RetryBudgetExhausted, TransientModelError)) for e in errors)
        spent = [e for e in errors if isinstance(e, RetryBudgetExhausted)]
        assert spent and all("retry budget is spent" in str(e) for e in spent)
        # Retries waited a backoff drawn with jitter: never past the cap (plus a margin for the
        # machine), and not all the same wait.
        gaps = [(n, b - a) for v in runs.values() for n, (a, b) in enumerate(zip(v, v[1:], strict=False))]
        assert gaps
        assert all(gap <= min(backoff_max_s, backoff_s * 2 ** n) + 3.0 for n, gap in gaps)
        assert max(g for _, g in gaps) - min(g for _, g in gaps) > 0.02
    finally:
        proc.stop()
        r.close()


# -- a hard time limit: the wedged worker is replaced, its other requests run elsewhere ---------


@pytest.mark.parametrize(("consumer", "visibility_s"), [("fast", "30"), ("celery", "6")])
def test_hard_time_limit_replaces_the_wedged_worker(redis_db: RedisDatabase, tmp_path: Path,
                                                    consumer: str, visibility_s: str) -> None:
    # The fast consumer sends the requests it held back at once; on Celery's consumer they stay
    # unacknowledged and kombu redelivers them after the visibility timeout.
    url = redis_db.url
    env = worker_env(url, ASYNCINFER_TIME_LIMIT_S="2", ASYNCINFER_VISIBILITY_TIMEOUT_S=visibility_s,
                     ASYNCINFER_MAX_RETRIES="0", ASYNCINFER_CONSUMER=consumer)
    log = open(tmp_path / "up.log", "wb")
    up = start_up(env, log, "--models", "sleep", "--concurrency", "4")
    started: list[int] = []
    client = Client(broker_url=url)
    try:
        first = wait_for(lambda: cluster_status(client.app, 0.5).workers, 90, "a worker")
        started += [w.pid for w in first]
        wedge = client.submit("sleep", np.array([[60.0]], np.float32))  # never comes back in time
        wait_for(lambda: _state(client, wedge.id) == "STARTED", 30, "the wedging request started")
        behind = [client.submit("sleep", np.array([[0.01 * (i + 1)]], np.float32)) for i in range(5)]
        with pytest.raises(TimeLimitExceeded, match=rf"request {wedge.id}: time limit \(2 s\) "
                                                    r"exceeded on model 'sleep' \(its batch is still"):
            wedge.result(timeout=60)
        # The requests held behind it went back to the queue and ran on the new worker process.
        for i, future in enumerate(behind):
            assert future.result(timeout=90)["output"].tolist() == [[pytest.approx(0.01 * (i + 1))]]
        second = wait_for(lambda: [w for w in cluster_status(client.app, 0.5).workers
                                if w.pid != first[0].pid], 60, "the replacement worker")
        started += [w.pid for w in second]
        assert not pid_alive(first[0].pid)
        assert "exited with 75" in (tmp_path / "up.log").read_text(errors="replace")
    finally:
        client.close()
        stop_up(up, started)
        log.close()


def _state(client: Client, request_id: str) -> str:
    raw = client.app.backend.client.get(f"celery-task-meta-{request_id}")
    return json.loads(raw)["status"] if raw else "PENDING"



# -- the same policy on Celery's stock consumer (ASYNCINFER_CONSUMER=celery) ------------------------


def test_stock_celery_consumer_retries_within_budget_and_honours_time_limits(
        redis_db: RedisDatabase, tmp_path: Path) -> None:
    url = redis_db.url
    proc = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "flaky,sleep",
                        "--hostname", "stock@%h", ASYNCINFER_CONSUMER="celery",
                        ASYNCINFER_MAX_PAYLOAD_BYTES="4096",
                        ASYNCINFER_MAX_RETRIES="1", ASYNCINFER_RETRY_BUDGET_MIN="1",
                        ASYNCINFER_RETRY_BUDGET_RATIO="0", FLAKY_REDIS_URL=url, FLAKY_PREFIX="stock")
    r = redis.Redis.from_url(url)
    try:
        assert "fast consumer" not in proc.log()
        with Client(broker_url=url) as client:
            # A body over the worker's ASYNCINFER_MAX_PAYLOAD_BYTES is refused before decoding.
            big = client.submit("flaky", np.zeros((1, 2), np.float64),
                                parameters={"padding": "x" * 8000})
            with pytest.raises(InvalidRequest, match=rf"request {big.id}: message body of \d+ bytes "
                                                     r"is over the limit of 4096 bytes"):
                big.result(timeout=60)
            # One transient failure, one retry (Celery's autoretry_for), then success.
            assert client.infer("flaky", _flaky(1, 1), timeout_s=60)["output"].tolist() == [[1.0, 1.0]]
            assert len(_runs(r, "stock", 1)) == 2
            # The budget (ratio 0, floor 1) is spent: the next transient failure fails at once.
            spent = client.submit("flaky", _flaky(2, 5))
            with pytest.raises(RetryBudgetExhausted, match=rf"request {spent.id}: not retried after "
                                                           r"TransientModelError"):
                spent.result(timeout=60)
            assert len(_runs(r, "stock", 2)) == 1
            # Soft time limit on the threads pool, which Celery itself does not enforce there.
            slow = client.submit("sleep", np.array([[1.0]], np.float32), soft_time_limit_s=0.2)
            with pytest.raises((SoftTimeLimitExceeded, RetryBudgetExhausted), match=slow.id):
                slow.result(timeout=60)
    finally:
        proc.stop()
        r.close()
