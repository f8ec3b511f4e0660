"""Dead letters (``asyncinfer:dead:<model>``): the entry format and its bounds in-process (fakeredis),
then real workers on databases of the session Redis that are this module's own — the fast
consumer and Celery's stock path — with requeue and purge through the real ``asyncinfer dead``
command."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fakeredis
import numpy as np
import pytest
import redis
from celery import states

from asyncinfer.client import Client
from asyncinfer.config.bound import bind
from asyncinfer.config.model_options import ModelOptions
from asyncinfer.config.settings import Settings
from asyncinfer.constants import PRIORITY_SEP
from asyncinfer.errors import InvalidRequest, ModelError, TransientModelError
from asyncinfer.keys import RESULT_KEY_PREFIX, dead_letter_key
from asyncinfer.wire.envelope import Delivery, parse_envelope, task_message
from asyncinfer.worker.dead_letters import (
    DeadLetter,
    DeadLetters,
    add_to,
    entry_for,
    options_of,
    push,
    requeue_message,
    set_worker_name,
)
from asyncinfer.worker.intake.result_writer import Outcome
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.processes import ROOT, WorkerProcess, start_worker, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

OPTIONS = json.dumps({"poison": {"dead_letter": True},
                      "sleep": {"dead_letter": True, "dead_letter_max_entries": 3,
                                "dead_letter_ttl_s": 120},
                      "flaky": {"dead_letter": True}})


# -- in-process: the entry, its bounds, which outcomes make one ----------------------------------

def _delivery(model: str = "poison", retries: int = 0, key: str = "") -> Delivery:
    request_id = str(uuid.uuid4())
    raw = task_message("asyncinfer.infer", request_id, {"model": model, "inputs": []}, f"infer.{model}")
    envelope = json.loads(raw)
    envelope["headers"]["retries"] = retries
    envelope["headers"]["eta"] = "2020-01-01T00:00:00+00:00"
    envelope["headers"]["redelivered"] = True
    d = Delivery(raw=json.dumps(envelope).encode(), queue=f"infer.{model}", received_at=time.time(),
                 key=key)
    parse_envelope(d)
    return d


class _App:
    """Enough of an app for the dead-letter functions: its settings, bound as asyncinfer binds them."""


def _app(options: str = OPTIONS) -> Any:
    app = _App()
    bind(app, Settings(model_options=options))
    set_worker_name("unit@host")
    return app


@pytest.mark.unit
def test_an_entry_holds_the_envelope_reason_attempts_worker_and_time() -> None:
    d = _delivery(retries=2, key=f"infer.poison{PRIORITY_SEP}3")
    before = datetime.now(timezone.utc)
    entry = entry_for(d.request_id, d.list_key, ModelError(f"request {d.request_id}: boom"), raw=d.raw,
                      retries=2, worker="w@h")
    assert (entry.request_id, entry.model, entry.queue) == (d.request_id, "poison", d.list_key)
    assert (entry.reason_type, entry.reason) == ("ModelError", f"request {d.request_id}: boom")
    assert (entry.attempts, entry.worker, entry.raw) == (3, "w@h", "")
    assert entry.envelope == json.loads(d.raw)
    assert before <= datetime.fromisoformat(entry.failed_at) <= datetime.now(timezone.utc)
    assert DeadLetter.from_json(entry.to_json()) == entry and entry.requeueable == ""


@pytest.mark.unit
def test_requeue_message_resets_retries_eta_redelivery_and_the_tag() -> None:
    d = _delivery(retries=3)
    entry = entry_for(d.request_id, d.queue, RuntimeError("x"), raw=d.raw, retries=3, worker="w")
    again = json.loads(requeue_message(entry))
    original = json.loads(d.raw)
    assert again["headers"]["retries"] == 0 and again["headers"]["eta"] is None
    assert "redelivered" not in again["headers"]
    assert again["properties"]["delivery_tag"] != original["properties"]["delivery_tag"]
    assert again["body"] == original["body"] and again["headers"]["id"] == d.request_id
    assert entry.envelope == original  # the entry itself is left as it was


@pytest.mark.unit
def test_malformed_and_refused_messages_are_kept_but_cannot_be_requeued() -> None:
    malformed = entry_for("r1", "infer.poison", InvalidRequest("request r1: malformed"),
                          raw=b'{"id": "r1", not json' + b"x" * 10000, retries=0, worker="w")
    assert malformed.envelope is None and malformed.raw.startswith('{"id": "r1"')
    assert len(malformed.raw) == 4096
    with pytest.raises(ValueError, match="request r1: cannot be requeued: its message was not a kombu"):
        requeue_message(malformed)
    pickled = json.loads(task_message("asyncinfer.infer", "r2", {}, "infer.poison"))
    pickled["content-type"] = "application/x-python-serialize"
    refused = entry_for("r2", "infer.poison", InvalidRequest("pickle"), raw=json.dumps(pickled),
                        retries=0, worker="w")
    assert refused.envelope is not None and refused.envelope["body"] is None  # never kept
    with pytest.raises(ValueError, match="content type 'application/x-python-serialize' is refused"):
        requeue_message(refused)


@pytest.mark.unit
def test_push_keeps_the_newest_entries_up_to_the_bound_and_sets_the_ttl() -> None:
    r = fakeredis.FakeRedis()
    options = ModelOptions(dead_letter=True, dead_letter_max_entries=3, dead_letter_ttl_s=50)
    ids = []
    for _ in range(5):
        d = _delivery()
        ids.append(d.request_id)
        push(r, entry_for(d.request_id, d.queue, RuntimeError("x"), raw=d.raw, retries=0, worker="w"),
             options)
    stored = [DeadLetter.from_json(s).request_id for s in r.lrange(dead_letter_key("poison"), 0, -1)]
    assert stored == ids[:1:-1]  # newest first, the two oldest trimmed away
    assert 0 < r.ttl(dead_letter_key("poison")) <= 50
    push(r, entry_for("r", "infer.poison", RuntimeError("x"), raw="{}", retries=0, worker="w"),
         ModelOptions(dead_letter=True, dead_letter_ttl_s=0))
    assert r.ttl(dead_letter_key("poison")) == -1 and r.llen(dead_letter_key("poison")) == 4


@pytest.mark.parametrize(("state", "retry", "store", "model", "kept"), [
    (states.FAILURE, None, True, "poison", True),
    (states.FAILURE, None, True, "affine", False),  # not opted in
    (states.FAILURE, None, False, "poison", False),  # a duplicate, acknowledged only
    (states.RETRY, "{}", True, "poison", False),  # not final
    (states.SUCCESS, None, True, "poison", False),
    (states.REVOKED, None, True, "poison", False),
])
@pytest.mark.unit
def test_add_to_keeps_only_final_failures_of_models_that_opted_in(
        state: str, retry: str | None, store: bool, model: str, kept: bool) -> None:
    r = fakeredis.FakeRedis()
    d = _delivery(model, retries=1)
    pipe = r.pipeline(transaction=True)
    add_to(pipe, _app(), Outcome(d, state, ModelError("m"), retry=retry, store=store))
    pipe.execute()
    stored = r.lrange(dead_letter_key(model), 0, -1)
    assert len(stored) == (1 if kept else 0)
    if kept:
        entry = DeadLetter.from_json(stored[0])
        assert (entry.request_id, entry.attempts, entry.worker) == (d.request_id, 2, "unit@host")


@pytest.mark.unit
def test_add_to_never_raises() -> None:
    class Broken:
        def lpush(self, *_: Any) -> None:
            raise RuntimeError("broken pipe object")

    add_to(Broken(), _app(), Outcome(_delivery(), states.FAILURE, ModelError("m")))  # logged only


@pytest.mark.unit
def test_options_validate_and_star_opts_every_model_in() -> None:
    assert options_of(_app('{"*": {"dead_letter": true}}'), "anything").dead_letter is True
    assert options_of(_app("{}"), "poison") == ModelOptions()
    defaults = ModelOptions()
    assert (defaults.dead_letter, defaults.dead_letter_ttl_s, defaults.dead_letter_max_entries) == \
        (False, 7 * 24 * 3600, 10000)
    for bad, message in (({"dead_letter": "yes"}, "dead_letter must be true or false"),
                         ({"dead_letter_max_entries": 0}, "dead_letter_max_entries must be an integer >= 1"),
                         ({"dead_letter_ttl_s": -1}, "dead_letter_ttl_s must be a finite number >= 0")):
        with pytest.raises(ValueError, match=message):
            ModelOptions().merged(bad)


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
        bad = client.submit("poison", np.array([[1.0, 2.0]], np.float32))  # wrong shape
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
