"""Failures that say what to do, against a real Redis and real processes: one line each, the
right exit status, quickly."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import threading
import time
import uuid

import pytest
from celery.exceptions import (
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
    WorkerLostError,
)

from asyncinfer.client.whereabouts import whereabouts
from asyncinfer.config.settings import Settings
from asyncinfer.ops.redis_server import free_port
from asyncinfer.supervision.supervisor import CANNOT_START, Child, Supervisor
from tests.support.processes import ROOT, start_worker, worker_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(180)


def asyncinfer(env: dict[str, str], *args: str, stdin: str | None = None,
               timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "asyncinfer", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env)


def error_lines(out: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.strip()]


# -- result: where a request without a result is ------------------------------------------------

def test_result_of_an_unknown_id_says_it_is_unknown_at_once(redis_db, tmp_path) -> None:
    # Given an ID nothing exists for; When its result is waited for, up to the default minute
    began = time.monotonic()
    out = asyncinfer(worker_env(redis_db.url), "result", "does-not-exist", timeout_s=40)
    # Then it is said at once (the command's start, two looks a second apart), one line
    assert time.monotonic() - began < 30
    assert out.returncode == 1
    assert error_lines(out) == [
        "asyncinfer result: RequestUnknown: request does-not-exist: no request with this ID is "
        "known: nothing exists for it in Redis (no result, trace, claim, queue entry, unacked "
        "entry, lease or stream; looked twice, 1 s apart); check the ID"]


def test_result_of_a_queued_request_names_its_queue_and_place(redis_db) -> None:
    env = worker_env(redis_db.url)
    ids = [f"queued-{i}-{uuid.uuid4().hex}" for i in range(3)]
    for request_id in ids:  # nobody serves this model: they stay queued, the first at the tail
        sent = asyncinfer(env, "submit", "nobody-serves", "--input", "-", "--request-id", request_id,
                          stdin=json.dumps([[1.0, 2.0]]))
        assert sent.returncode == 0, sent.stderr
    out = asyncinfer(env, "result", ids[1], "--timeout-s", "0.5")
    assert out.returncode == 1
    assert error_lines(out) == [
        f"asyncinfer result: RequestTimeout: request {ids[1]}: no result within 0.5 s; it is "
        f"queued on infer.nobody-serves (1 requests ahead of it)"]


def test_result_of_a_request_past_its_time_limit_is_one_line(redis_db, tmp_path) -> None:
    # Given: a worker whose time limit (1 s) a request of 30 s passes
    worker = start_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu", "--models",
                          "sleep", ASYNCINFER_TIME_LIMIT_S="1", ASYNCINFER_MAX_RETRIES="0")
    try:
        env = worker_env(redis_db.url)
        sent = asyncinfer(env, "submit", "sleep", "--input", "-", stdin=json.dumps([[30.0]]))
        assert sent.returncode == 0, sent.stderr
        request_id = sent.stdout.strip()
        # When
        out = asyncinfer(env, "result", request_id, "--timeout-s", "60")
    finally:
        worker.stop()
    # Then: the request and its failure on one line, no traceback
    assert out.returncode == 1
    assert error_lines(out) == [
        f"asyncinfer result: TimeLimitExceeded: request {request_id}: time limit (1 s) exceeded "
        f"on model 'sleep' (its batch is still on the device)"]


class UserModelError(Exception):
    """An exception type of a worker's own code, which the command's process cannot import."""


UserModelError.__module__ = "somebody_elses.models"


@pytest.mark.parametrize(("stored", "said"), [
    (TimeLimitExceeded(2.0), "TimeLimitExceeded: request {id}: time limit (2 s) exceeded"),
    (SoftTimeLimitExceeded(), "SoftTimeLimitExceeded: request {id}: soft time limit exceeded"),
    (WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 3."),
     "WorkerLostError: request {id}: its worker process died while it ran (Worker exited "
     "prematurely: signal 9 (SIGKILL) Job: 3.)"),
    (UserModelError("tokenizer missing"), "UserModelError: request {id}: tokenizer missing"),
], ids=["time-limit", "soft-time-limit", "worker-lost", "unknown-type"])
def test_result_of_each_stored_failure_is_one_line(redis_db, stored, said) -> None:
    # Given: the failure stored as Celery's worker stores it (its pool's hard time limit too)
    from asyncinfer.celery_app import create_app

    request_id = f"failed-{uuid.uuid4().hex}"
    create_app(Settings(broker_url=redis_db.url)).backend.mark_as_failure(request_id, stored)
    # When
    out = asyncinfer(worker_env(redis_db.url), "result", request_id, "--timeout-s", "10")
    # Then
    assert out.returncode == 1
    assert error_lines(out) == [f"asyncinfer result: {said.format(id=request_id)}"]


def test_result_of_an_expired_request_is_one_line(redis_db) -> None:
    from asyncinfer.celery_app import create_app

    request_id = f"expired-{uuid.uuid4().hex}"
    create_app(Settings(broker_url=redis_db.url)).backend.mark_as_revoked(request_id, "expired")
    out = asyncinfer(worker_env(redis_db.url), "result", request_id, "--timeout-s", "10")
    assert out.returncode == 1
    assert error_lines(out) == [
        f"asyncinfer result: TaskRevokedError: request {request_id}: expired before a worker ran "
        f"it (its expires, or the deadline of its timeout)"]


def test_whereabouts_of_taken_running_and_unclaimed_queued_requests(redis_db) -> None:
    from asyncinfer.celery_app import create_app
    from asyncinfer.wire.keys import UNACKED_KEY
    from asyncinfer.wire.messages import task_message

    app = create_app(Settings(broker_url=redis_db.url))
    backend, r = app.backend, redis_db.client
    try:
        # Given a message in kombu's unacked bookkeeping (a worker took it) ...
        taken = task_message("asyncinfer.infer", "taken-1", {"model": "m"}, "infer.m")
        r.hset(UNACKED_KEY, "tag-7", json.dumps([json.loads(taken), "", "infer.m"]))
        assert whereabouts("taken-1", backend.client, backend, r) == (
            "it is taken by a worker (unacknowledged, delivery tag tag-7) and not started yet")
        # ... one a worker started (its STARTED state names the worker) ...
        backend.store_result("running-1", {"pid": 1, "hostname": "cpu@box"}, "STARTED")
        assert whereabouts("running-1", backend.client, backend, r) == (
            "it is running on worker cpu@box (STARTED)")
        # ... and one queued with a generated ID (no claim): every infer.* queue is searched.
        r.lpush("infer.other", task_message("asyncinfer.infer", "free-1", {"model": "o"},
                                            "infer.other"))
        r.lpush("infer.other", task_message("asyncinfer.infer", "free-2", {"model": "o"},
                                            "infer.other"))
        assert whereabouts("free-1", backend.client, backend, r) == (
            "it is queued on infer.other (0 requests ahead of it)")
        assert whereabouts("free-2", backend.client, backend, None) == (
            "it has no stored state yet (queued, or unknown to the result backend)")
    finally:
        app.close()


# -- broker down: one line, quickly ---------------------------------------------------------------

@pytest.mark.parametrize("command", [["status"], ["result", "some-id", "--timeout-s", "30"],
                                     ["infer", "identity", "--input", "{inputs}"]])
def test_broker_down_is_one_line_at_once(command, tmp_path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    (tmp_path / "inputs.json").write_text("[[1.0]]")
    command = [part.format(inputs=tmp_path / "inputs.json") for part in command]
    began = time.monotonic()
    out = asyncinfer(worker_env(url), *command)
    took_s = time.monotonic() - began
    lines = error_lines(out)
    assert out.returncode == 1
    # one line, no log line before it (the result watcher's first failed connections are quiet)
    assert len(lines) == 1, out.stderr
    assert re.match(rf"asyncinfer {command[0]}: BrokerUnavailable: (request [0-9a-f-]+: )?"
                    rf"broker unreachable: ", lines[0]), lines[0]
    assert "127.0.0.1" in lines[0]
    assert took_s < 15, took_s  # the interpreter's start included; kombu's retries took 7-62 s


def test_config_shows_where_each_value_came_from(tmp_path, redis_url) -> None:
    env = worker_env(redis_url, ASYNCINFER_STATE_DIR=str(tmp_path), ASYNCINFER_CONCURRENCY="8")
    rows = {line.split()[0]: line for line in asyncinfer(env, "config").stdout.splitlines()}
    assert rows["broker_url"].endswith("[environment (ASYNCINFER_BROKER_URL)]")
    assert rows["result_backend"].endswith("[the broker URL]")
    assert rows["concurrency"].split()[1] == "8"
    assert rows["concurrency"].endswith("[environment (ASYNCINFER_CONCURRENCY)]")
    assert rows["device"].endswith("[default]")
    flagged = asyncinfer(env, "--broker-url", "redis://127.0.0.1:7/3", "config").stdout
    assert "redis://127.0.0.1:7/3" in flagged and flagged.splitlines()[0].endswith("[flag]")
    del env["ASYNCINFER_BROKER_URL"]
    rows = {line.split()[0]: line for line in asyncinfer(env, "config").stdout.splitlines()}
    assert rows["broker_url"].endswith(
        "[default (ASYNCINFER_BROKER_URL unset, no 'asyncinfer up' running on this host)]")


def test_a_broker_url_that_is_no_url_is_one_line(tmp_path) -> None:
    out = asyncinfer(worker_env("notaurl"), "status")
    assert out.returncode == 1
    assert error_lines(out) == [
        "asyncinfer status: ValueError: ASYNCINFER_BROKER_URL (or --broker-url) is not a URL: "
        "'notaurl'; a URL looks like redis://[:password@]host:6379/0, rediss://…, "
        "unix:///path/redis.sock, sentinel://host:26379;sentinel://host2:26379/0, "
        "rediscluster://host:7000/?nodes=host2:7000 or amqp://user:password@host:5672//"]


# -- workers that cannot start -------------------------------------------------------------------

@pytest.mark.parametrize(("args", "start"), [
    (["--device", "tpu:0"], "device tpu:0: 'tpu' devices are not supported"),
    (["--device", "cpu", "--models", "mlp,nosuchmodel"],
     "model(s) nosuchmodel not registered (registered: "),
    (["--device", "cpu", "--models", "broken"],
     "loading broken failed: OSError: weights file is truncated"),
])
def test_a_worker_that_cannot_start_exits_78_with_one_line(redis_db, args, start) -> None:
    out = asyncinfer(worker_env(redis_db.url), "worker", *args)
    assert out.returncode == CANNOT_START
    assert error_lines(out)[-1].startswith(f"asyncinfer worker: cannot start: {start}")
    assert "Traceback" not in out.stderr and "celery@" not in out.stdout + out.stderr
    if "nosuchmodel" in args[-1]:
        assert "identity" in error_lines(out)[-1] and "mlp" in error_lines(out)[-1]


def test_up_stops_after_identical_start_failures(redis_db, tmp_path) -> None:
    env = worker_env(redis_db.url, ASYNCINFER_STATE_DIR=str(tmp_path))
    out = asyncinfer(env, "up", "--devices", "tpu:0", timeout_s=120)
    assert out.returncode == 1
    last = error_lines(out)[-1]
    assert last == ("asyncinfer up: worker tpu:0 failed to start 3 times in a row; stopped: "
                    "asyncinfer worker: cannot start: device tpu:0: 'tpu' devices are not "
                    "supported (devices: auto, cpu, cuda:N, npu:N)")
    assert sum(line.startswith("asyncinfer worker: cannot start:")
               for line in error_lines(out)) == 3


def test_supervisor_restarts_other_failures_and_counts_only_identical_ones(tmp_path) -> None:
    script = tmp_path / "child.py"
    counter = tmp_path / "runs"
    # exits 1 the first time (restarted like any crash), then 78 with one line, then another
    script.write_text(
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0\n"
        "p.write_text(str(n + 1))\n"
        "if n == 0: sys.exit(1)\n"
        "print('cannot start: A' if n in (1, 3, 4, 5) else 'cannot start: B', file=sys.stderr)\n"
        f"sys.exit({CANNOT_START})\n")
    supervisor = Supervisor([Child(name="c", argv=[sys.executable, str(script)])],
                            max_backoff_s=0.05, max_start_failures=3)
    done = threading.Thread(target=supervisor.run, kwargs={"poll_s": 0.02}, daemon=True)
    done.start()
    done.join(timeout=60)
    assert not done.is_alive()
    # runs: 0 exit 1; 1 A; 2 B (resets the count); 3, 4, 5 A -> the third identical one stops it
    assert supervisor.failure == ("c", "cannot start: A")
    assert counter.read_text() == "6"


# -- the CLI takes a list input's datatype from the model catalogue ------------------------------

def test_infer_of_an_integer_list_uses_the_declared_datatype(worker, redis_url) -> None:
    # mlp declares input FP32 [n, 16]: the integers go as FP32, and a bare list is its one input
    out = asyncinfer(worker_env(redis_url), "infer", "mlp", "--input", "-",
                     stdin=json.dumps([list(range(16))]))
    assert out.returncode == 0, out.stderr
    response = json.loads(out.stdout)
    assert response["outputs"][0]["shape"] == [1, 4]
    # a datatype the user chose is kept, and a refusal then says what to pass
    out = asyncinfer(worker_env(redis_url), "infer", "mlp", "--input", "-", "--datatype", "INT64",
                     stdin=json.dumps([list(range(16))]))
    assert out.returncode == 1
    assert error_lines(out)[-1].endswith("datatype INT64 is not accepted (accepted: FP32)")


# -- the result watcher: a quiet pub/sub connection is not a lost one ------------------------------

def test_result_watcher_does_not_warn_when_a_read_times_out_on_a_live_server(
        redis_db, caplog) -> None:
    import redis

    from asyncinfer.celery_app import create_app
    from asyncinfer.client.result_watcher import ResultWatcher

    app = create_app(Settings(broker_url=redis_db.url))
    timeouts = []
    make_pubsub = app.backend.client.pubsub

    def pubsub_whose_first_read_times_out(**kwargs):
        pubsub = make_pubsub(**kwargs)
        read = pubsub.get_message

        def get_message(*args, **kw):
            if not timeouts:  # Given the watcher's first read times out (a slow, live server) ...
                timeouts.append(1)
                raise redis.TimeoutError("Timeout reading from socket")
            return read(*args, **kw)

        pubsub.get_message = get_message
        return pubsub

    app.backend.client.pubsub = pubsub_whose_first_read_times_out
    got: list[dict] = []
    arrived = threading.Event()
    try:
        with caplog.at_level(logging.DEBUG, logger="asyncinfer.client.result_watcher"):
            watcher = ResultWatcher(app.backend)
            thread = watcher._thread.ident  # only this watcher's lines count (other tests' run too)
            watcher.watch("quiet-1", lambda meta: (got.append(meta), arrived.set()))
            wait_for(lambda: "a pub/sub read timed out" in caplog.text, 10, "the timeout handled")
            # ... when the result is stored, it is delivered all the same ...
            app.backend.store_result("quiet-1", {"ok": 1}, "SUCCESS")
            assert arrived.wait(10)
            watcher.close()
    finally:
        app.close()
    assert timeouts == [1] and got[0]["result"] == {"ok": 1}
    # ... and the timeout was not reported as a lost connection
    own = [r for r in caplog.records if r.thread == thread]
    assert not [r for r in own if r.levelno >= logging.WARNING], caplog.text
    assert "a pub/sub read timed out" in caplog.text


def test_a_worker_whose_broker_is_down_at_start_exits_nonzero() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    out = asyncinfer(worker_env(url), "worker", "--device", "cpu", "--models", "identity")
    assert "Unrecoverable error" in out.stderr
    assert out.returncode == 1  # Celery's EX_FAILURE, which app.worker_main used to drop (0)
