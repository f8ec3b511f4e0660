"""Dead letters (``asyncinfer:dead:<model>``) with real workers on databases of the session Redis
that are this module's own — the fast consumer and Celery's consumer (kombu) — with requeue and purge
through the real ``asyncinfer dead`` command. The entry format and its bounds, in process:
tests/unit/test_dead_letters.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from celery import states

from asyncinfer.client import Client
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.errors import InvalidRequest, ModelError, TransientModelError
from asyncinfer.ops.dead import DeadLetters
from asyncinfer.wire.keys import RESULT_KEY_PREFIX, dead_letter_key
from asyncinfer.worker.dead_letters import (
    DeadLetter,
    entry_for,
    push,
)
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.processes import ROOT, WorkerProcess, start_worker, worker_env
from tests.support.waiting import wait_for
from tests.unit.test_dead_letters import _delivery

pytestmark = pytest.mark.timeout(180)

OPTIONS = json.dumps({"poison": {"dead_letter": True},
                      "sleep": {"dead_letter": True, "dead_letter_max_entries": 3,
                                "dead_letter_ttl_s": 120},
                      "flaky": {"dead_letter": True}})


# -- a real Redis --------------------------------------------------------------------------------

def test_requeue_and_purge_on_a_real_redis(redis_db: RedisDatabase) -> None:
    r = redis_db.client
    options = ModelOptions(dead_letter=True)
    ds = [_delivery("poison") for _ in range(3)]
    for d in ds:
        r.set(RESULT_KEY_PREFIX + d.request_id, "FAILURE")
        push(r, entry_for(d.request_id, d.queue, RuntimeError("x"), raw=d.raw, retries=2, worker="w"),
             options)
    push(r, entry_for("bad", "infer.poison", RuntimeError("x"), raw="{no", retries=0, worker="w"), options)
    dead = DeadLetters(r, "poison")
    assert [e.request_id for _, e in dead.entries()] == ["bad"] + [d.request_id for d in ds[::-1]]
    # Given two named (one unknown), when requeued, then one message is back and its FAILURE gone.
    done = dead.requeue([ds[0].request_id, "nope"])
    assert (done.requeued, done.not_found, done.refused) == ([ds[0].request_id], ["nope"], {})
    [message] = r.lrange("infer.poison", 0, -1)
    assert json.loads(message)["headers"]["id"] == ds[0].request_id
    assert json.loads(message)["headers"]["retries"] == 0
    assert r.get(RESULT_KEY_PREFIX + ds[0].request_id) is None
    assert r.get(RESULT_KEY_PREFIX + ds[1].request_id) == b"FAILURE"
    # --all: the rest go back oldest first; the malformed one stays, refused.
    done = dead.requeue(None)
    assert done.requeued == [ds[1].request_id, ds[2].request_id] and list(done.refused) == ["bad"]
    assert [json.loads(m)["headers"]["id"] for m in r.lrange("infer.poison", 0, -1)] == \
        [ds[2].request_id, ds[1].request_id, ds[0].request_id]
    assert dead.purge() == 1 and dead.purge() == 0 and not r.exists(dead_letter_key("poison"))
    # A request kept twice (failed, redelivered, failed again) goes back once.
    r.delete("infer.poison")
    twice = ds[0]
    for attempts in (0, 1):
        push(r, entry_for(twice.request_id, twice.queue, RuntimeError("x"), raw=twice.raw,
                          retries=attempts, worker="w"), options)
    assert dead.requeue([twice.request_id]).requeued == [twice.request_id]
    assert r.llen("infer.poison") == 1 and not r.exists(dead_letter_key("poison"))


# -- real workers --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fast(redis_databases: RedisDatabases, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[str, WorkerProcess]]:
    with redis_databases.take("test_dead_letters fast worker") as db:
        url = db.url
        proc = start_worker(url, tmp_path_factory.mktemp("dead") / "worker.log", "--device", "cpu",
                            "--models", "poison,sleep,flaky,affine3", "--hostname", "dead@%h",
                            ASYNCINFER_MODEL_OPTIONS=OPTIONS, ASYNCINFER_MAX_RETRIES="1",
                            ASYNCINFER_RETRY_BACKOFF_S="0.05", ASYNCINFER_RETRY_BACKOFF_MAX_S="0.1",
                            ASYNCINFER_RETRY_BUDGET_MIN="1000", FLAKY_REDIS_URL=url,
                            FLAKY_PREFIX="dead")
        try:
            yield url, proc
        finally:
            proc.stop()


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncinfer", "dead", *args], capture_output=True,
                          text=True, env=worker_env(url), cwd=ROOT, timeout=60)


def _entries(url: str, model: str) -> list[DeadLetter]:
    r = redis.Redis.from_url(url)
    try:
        return [e for _, e in DeadLetters(r, model).entries()]
    finally:
        r.close()


def _flaky(index: int, failures: int) -> np.ndarray:
    return np.array([[index, failures]], np.float64)


def _state(url: str, request_id: str) -> str:
    r = redis.Redis.from_url(url)
    try:
        raw = r.get(RESULT_KEY_PREFIX + request_id)
        return str(json.loads(raw)["status"]) if raw else "PENDING"
    finally:
        r.close()


def test_a_poisoned_request_lands_there_with_its_reason_and_attempts(fast: tuple[str, WorkerProcess]) -> None:
    url, proc = fast
    with Client(broker_url=url) as client:
        DeadLetters(client._broker, "poison").purge()
        poisoned = client.submit("poison", np.array([[-1.0]], np.float32))
        with pytest.raises(ModelError, match=poisoned.id):
            poisoned.result(timeout=60)
        # a wrong shape, sent past the client's check (it refuses it at submit): the worker's
        bad = client.sender.send_watched(client.submission(
            "poison", np.array([[1.0, 2.0]], np.float32), check=False))
        with pytest.raises(InvalidRequest, match=bad.id):
            bad.result(timeout=60)
        ok = client.infer("poison", np.array([[2.0]], np.float32), timeout_s=60)
        assert ok["output"].tolist() == [[4.0]]
    newest, oldest = _entries(url, "poison")
    assert (oldest.request_id, oldest.reason_type, oldest.attempts) == (poisoned.id, "ModelError", 1)
    assert "negative input poisons this model" in oldest.reason and oldest.worker.startswith("dead@")
    assert oldest.envelope is not None and oldest.envelope["headers"]["id"] == poisoned.id
    assert (newest.request_id, newest.reason_type, newest.attempts) == (bad.id, "InvalidRequest", 1)
    # The command: one line per entry, and one entry as JSON.
    listed = _cli(url, "list", "poison")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert [line.split()[0] for line in lines] == [bad.id, poisoned.id]
    assert "attempts=1  ModelError: " in lines[1] and "negative input" in lines[1]
    shown = _cli(url, "show", "poison", poisoned.id)
    assert shown.returncode == 0 and json.loads(shown.stdout)["reason_type"] == "ModelError"
    missing = _cli(url, "show", "poison", "no-such-id")
    assert missing.returncode == 1 and "request no-such-id is not among the dead letters" in missing.stderr
    purged = _cli(url, "purge", "poison")
    assert (purged.returncode, purged.stdout.strip()) == (0, "purged 2")
    assert _entries(url, "poison") == []


def test_a_model_without_the_option_leaves_nothing(fast: tuple[str, WorkerProcess]) -> None:
    url, _ = fast
    with Client(broker_url=url) as client:
        failed = client.submit("affine3", np.array([[5000.0]], np.float32))
        with pytest.raises(ModelError, match=failed.id):
            failed.result(timeout=60)
        # Given a later failure of a model that opted in (same worker, after it), its entry exists
        # — so the absence above is not a write still on its way.
        later = client.submit("poison", np.array([[-2.0]], np.float32))
        with pytest.raises(ModelError):
            later.result(timeout=60)
        assert later.id in [e.request_id for e in _entries(url, "poison")]
        assert not client._broker.exists(dead_letter_key("affine3"))
        assert client._broker.keys("asyncinfer:dead:*") == [dead_letter_key("poison").encode()]
        DeadLetters(client._broker, "poison").purge()


def test_the_bound_and_the_ttl_hold(fast: tuple[str, WorkerProcess]) -> None:
    url, _ = fast
    with Client(broker_url=url) as client:
        DeadLetters(client._broker, "sleep").purge()
        ids = []
        for _ in range(5):
            future = client.submit("sleep", np.array([[-1.0]], np.float32))  # sleep() refuses < 0
            with pytest.raises(ModelError):
                future.result(timeout=60)
            ids.append(future.id)
        key = dead_letter_key("sleep")
        assert [e.request_id for e in _entries(url, "sleep")] == ids[:1:-1]  # max 3, newest first
        assert 100 < client._broker.ttl(key) <= 120
        DeadLetters(client._broker, "sleep").purge()


def test_requeue_through_the_command_runs_it_again_to_success(fast: tuple[str, WorkerProcess]) -> None:
    url, _ = fast
    r = redis.Redis.from_url(url)
    with Client(broker_url=url) as client:
        DeadLetters(client._broker, "flaky").purge()
        # Given a request that fails twice (max_retries 1: out of retries), then would succeed.
        future = client.submit("flaky", _flaky(7, 2))
        with pytest.raises(TransientModelError, match=future.id):
            future.result(timeout=60)
        [entry] = _entries(url, "flaky")
        assert (entry.request_id, entry.attempts, entry.reason_type) == (future.id, 2, "TransientModelError")
        assert len(r.lrange("dead:runs:7", 0, -1)) == 2
        # When requeued through the command, then it runs a third time, to SUCCESS.
        done = _cli(url, "requeue", "flaky", future.id)
        assert (done.returncode, done.stdout.strip()) == (0, "requeued 1"), done.stderr
        assert _entries(url, "flaky") == []
        wait_for(lambda: _state(url, future.id) == states.SUCCESS, 60, "the requeued request's SUCCESS")
        assert client.result(future.id, timeout_s=10)["output"].tolist() == [[7.0, 2.0]]
        assert len(r.lrange("dead:runs:7", 0, -1)) == 3
        usage = _cli(url, "requeue", "flaky")
        assert usage.returncode == 2 and "--all" in usage.stderr
    r.close()


def test_the_stock_celery_path_keeps_and_requeues_too(redis_db: RedisDatabase, tmp_path: Path) -> None:
    url = redis_db.url
    proc = start_worker(url, tmp_path / "worker.log", "--device", "cpu", "--models", "poison,flaky",
                        "--hostname", "stockdead@%h", ASYNCINFER_CONSUMER="celery",
                        ASYNCINFER_MODEL_OPTIONS=OPTIONS, ASYNCINFER_MAX_RETRIES="0",
                        FLAKY_REDIS_URL=url, FLAKY_PREFIX="stockdead")
    try:
        assert "fast consumer" not in proc.log()
        with Client(broker_url=url) as client:
            poisoned = client.submit("poison", np.array([[-1.0]], np.float32))
            with pytest.raises(ModelError, match=poisoned.id):
                poisoned.result(timeout=60)
            flaky = client.submit("flaky", _flaky(1, 1))
            with pytest.raises(TransientModelError, match=flaky.id):
                flaky.result(timeout=60)
            # the entry follows the stored FAILURE (task_failure): wait for it, not sleep
            [entry] = wait_for(lambda: _entries(url, "poison"), 30, "the stock path's dead letter")
            assert (entry.request_id, entry.reason_type, entry.attempts) == (poisoned.id, "ModelError", 1)
            assert entry.worker.startswith("stockdead@") and entry.queue == "infer.poison"
            [again] = wait_for(lambda: _entries(url, "flaky"), 30, "the flaky dead letter")
            assert again.request_id == flaky.id and again.requeueable == ""
            done = _cli(url, "requeue", "flaky", "--all")
            assert (done.returncode, done.stdout.strip()) == (0, "requeued 1"), done.stderr
            assert client.result(flaky.id, timeout_s=60)["output"].tolist() == [[1.0, 1.0]]
    finally:
        proc.stop()
