"""The idle wait: it returns when any watched list gets a message, and takes none of them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis

from asyncinfer.constants import priority_lists
from asyncinfer.keys import WATCH_PREFIX
from asyncinfer.wire.envelope import task_message
from asyncinfer.worker.intake.take import Taker
from asyncinfer.worker.intake.wake import Waker
from tests.support.databases import RedisDatabase
from tests.support.waiting import blocked_in_redis, wait_for

pytestmark = pytest.mark.timeout(60)

LISTS = priority_lists(["infer.a", "infer.b"])  # infer.a, infer.b, then their priority lists


@pytest.fixture()
def waker(redis_db: RedisDatabase) -> Iterator[tuple[Waker, redis.Redis]]:
    url = redis_db.url
    w = Waker(redis.Redis.from_url(url, socket_timeout=40),
              redis.Redis.from_url(url, socket_timeout=40, single_connection_client=True),
              LISTS, block_s=30).start()
    yield w, redis_db.client
    w.close()


def _wait_in_thread(w: Waker, timeout_s: float) -> tuple[threading.Thread, list[bool]]:
    woke: list[bool] = []
    thread = threading.Thread(target=lambda: woke.append(w.wait(timeout_s)))
    thread.start()
    return thread, woke


@pytest.mark.parametrize("key", LISTS)
def test_a_message_on_any_list_ends_the_wait_and_stays_on_its_list(waker, key: str) -> None:
    w, r = waker
    w.clear()
    w.arm()
    own_id = int(w.own.client_id())
    # Given the caller blocked for up to 30 s (its own list in Redis, the others by watchers)
    thread, woke = _wait_in_thread(w, 30)
    wait_for(lambda: blocked_in_redis(r, own_id), 10, "the caller blocked in Redis", poll_s=0.01)
    assert thread.is_alive()
    # When a producer pushes one message on one of the lists
    r.lpush(key, b"m1")
    # Then the wait ends long before its timeout, and the message is still on its list
    thread.join(timeout=10)
    assert not thread.is_alive() and woke == [True], key
    assert r.lrange(key, 0, -1) == [b"m1"]


def test_a_wake_up_before_the_wait_is_not_lost(waker) -> None:
    w, r = waker
    w.clear()
    w.arm()
    r.lpush(LISTS[5], b"early")  # a priority list: a watcher fires while nobody waits
    deadline = time.monotonic() + 10
    while not w._wake.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    assert w.wait(30) is True and time.monotonic() - started < 10


def test_an_idle_worker_waits_quietly_through_whole_blocking_cycles(client, worker) -> None:
    # Given the session worker answering, then idle for longer than one watcher's block
    assert client.infer("identity", {"x": np.ones((1, 1), np.float32)}, timeout_s=30)
    seen = len(worker.log())
    time.sleep(Waker.block_s + 1.5)
    # Then no watcher's blocking command ran into its socket timeout (redis-py's default is 5 s)
    assert "watching" not in worker.log()[seen:], worker.log()[seen:][-2000:]
    assert client.infer("identity", {"x": np.ones((1, 1), np.float32)}, timeout_s=30)


def test_a_push_wakes_one_idle_consumer_and_its_take_wakes_exactly_one_more(redis_db) -> None:
    # Given three idle consumers of one queue
    url, r = redis_db.url, redis_db.client
    queue = ["infer.herd"]
    wakers = [Waker(redis.Redis.from_url(url, socket_timeout=40),
                    redis.Redis.from_url(url, socket_timeout=40, single_connection_client=True),
                    queue, block_s=30).start() for _ in range(3)]
    try:
        ids = [int(w.own.client_id()) for w in wakers]
        waits = [_wait_in_thread(w, 30) for w in wakers]
        wait_for(lambda: all(blocked_in_redis(r, i) for i in ids), 10, "all three blocked")
        # one watches the queue; the other two wait for its bell
        watcher = next(i for i, w in enumerate(wakers) if r.get(WATCH_PREFIX + queue[0])
                       == w.token.encode())
        # When a producer pushes one request
        r.lpush(queue[0], task_message("asyncinfer.infer", "one", {"model": "herd"}, queue[0]))
        # Then the watcher wakes, and only it (the others stay blocked in Redis)
        waits[watcher][0].join(10)
        assert waits[watcher][1] == [True]
        others = [i for i in range(3) if i != watcher]
        assert all(blocked_in_redis(r, ids[i]) and waits[i][0].is_alive() for i in others)
        # When the watcher takes it, it passes the watch on: exactly one other wakes
        taken = Taker(r).take(queue, 8, watcher=wakers[watcher].token)
        assert len(taken) == 1 and r.get(WATCH_PREFIX + queue[0]) is None
        woke = wait_for(lambda: [i for i in others if not waits[i][0].is_alive()], 10,
                        "one other consumer woken by the bell")
        time.sleep(0.3)  # (the other would have woken by now too, if the bell rang for all)
        assert len(woke) == 1 and len([i for i in others if not waits[i][0].is_alive()]) == 1
    finally:
        for w in wakers:
            w.close()
        for thread, _ in waits:
            thread.join(10)
