"""The device marks on a real Redis: sent without waiting for a reply, in order, on a connection
Redis never answers on; a process killed right after marking still leaves its marks on Redis;
a connection Redis closed is opened again and every mark still on the device sent again."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import redis

from asyncinfer.broker.device_marks import DeviceMarks
from asyncinfer.engine.batcher import WorkItem
from asyncinfer.wire.keys import LEASE_DEVICE_KEY
from tests.support.databases import RedisDatabase
from tests.support.waiting import wait_for


def _item() -> WorkItem:
    return WorkItem(request=None, rows=1, signature=(), on_device=True)


@pytest.fixture()
def r(redis_db: RedisDatabase) -> redis.Redis:
    return redis_db.client


@pytest.fixture()
def marks(r: redis.Redis):  # noqa: ANN201
    m = DeviceMarks(r)
    yield m
    m.close()


def test_batches_on_two_devices_stay_marked_until_each_comes_off(r, marks) -> None:
    # Given two batches on the device at once (two instances)
    a, b = _item(), _item()
    marks.on_device([("t-a", "r-a", a)])
    marks.on_device([("t-b", "r-b", b)])
    marks.sync()
    assert r.hgetall(LEASE_DEVICE_KEY) == {b"t-a": b"r-a", b"t-b": b"r-b"}
    # When the first comes off and a third goes on
    a.on_device = False
    marks.on_device([("t-c", "r-c", _item())])
    marks.sync()
    # Then the one still on the device keeps its mark; the finished one has none
    assert r.hgetall(LEASE_DEVICE_KEY) == {b"t-b": b"r-b", b"t-c": b"r-c"}
    # And all of it went on one connection, opened once, that has nothing to read: Redis never
    # answered a mark
    assert marks.sends == 3 and marks.connects == 1 and not marks._closed_by_redis()


def test_marks_sent_right_before_a_kill_9_reach_redis(redis_db: RedisDatabase, r) -> None:
    # Given a process that marks a batch and is killed the moment the call returns (as a kernel
    # that kills the process at its launch does)
    script = textwrap.dedent(f"""
        import os, signal, redis
        from asyncinfer.engine.batcher import WorkItem
        from asyncinfer.broker.device_marks import DeviceMarks
        marks = DeviceMarks(redis.Redis.from_url({redis_db.url!r}))
        item = WorkItem(request=None, rows=1, signature=(), on_device=True)
        marks.on_device([("t-warm", "r-warm", item)])  # the connection is open before the batch
        item.on_device = False
        marks.on_device([(f"t-{{i}}", f"r-{{i}}", WorkItem(request=None, rows=1, signature=(),
                                                       on_device=True)) for i in range(32)])
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert done.returncode == -9
    # Then Redis has the batch's marks, and the earlier batch's were removed before them
    expected = {f"t-{i}".encode(): f"r-{i}".encode() for i in range(32)}
    wait_for(lambda: r.hgetall(LEASE_DEVICE_KEY) == expected, 10, "the killed process' marks")


def test_a_connection_redis_closed_is_opened_again_and_every_mark_on_the_device_sent_again(
        r, marks) -> None:
    # Given a batch marked, and Redis closing the connection (a restart, its idle timeout); the
    # marks were lost with it
    first = _item()
    marks.on_device([("t-1", "r-1", first)])
    marks.sync()
    host, port = marks._connection._sock.getsockname()[:2]  # that connection only: the session
    assert r.client_kill_filter(_type=None, addr=f"{host}:{port}") == 1  # Redis serves others
    r.delete(LEASE_DEVICE_KEY)
    wait_for(marks._closed_by_redis, 10, "the close seen on the marks' connection")
    # When the next batch goes on the device beside it
    marks.on_device([("t-2", "r-2", _item())])
    marks.sync()
    # Then the connection was opened again and both batches are marked
    assert marks.connects == 2
    assert r.hgetall(LEASE_DEVICE_KEY) == {b"t-1": b"r-1", b"t-2": b"r-2"}


def test_without_redis_a_batch_runs_unmarked() -> None:
    # Given marks whose Redis cannot be reached
    gone = DeviceMarks(redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=1))
    # When a batch goes on the device: the failure is logged, nothing raised, nothing sent
    gone.on_device([("t-1", "r-1", _item())])
    assert gone.sends == 0 and gone.connects == 0
    gone.close()


def test_a_batch_that_runs_alone_waits_for_redis_to_have_its_marks(r, marks) -> None:
    # When a batch that runs alone (a request in it saw a death) goes on the device
    marks.on_device([("t-alone", "r-alone", _item())], wait=True)
    # Then its marks are on Redis when the call returns, and replies are off again after
    assert r.hgetall(LEASE_DEVICE_KEY) == {b"t-alone": b"r-alone"}
    marks.on_device([("t-next", "r-next", _item())])
    assert not marks._closed_by_redis() and marks.connects == 1
