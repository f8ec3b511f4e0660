"""The idle wait: it returns when any watched list gets a message, and takes none of them."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from asyncinfer.broker.take import Taker
from asyncinfer.broker.wake import Waker
from asyncinfer.constants import priority_lists
from asyncinfer.wire.keys import BELL_PREFIX, WAITERS_SUFFIX, WATCH_PREFIX
from asyncinfer.wire.messages import task_message
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


# -- every list: one idle consumer of the fleet blocks on it, the others wait for its bell ----------

HERD_LISTS = {
    "priority list": (priority_lists(["infer.herd"]), 1),  # infer.herd\x06\x163
    "second queue": (priority_lists(["infer.herd", "infer.herd2"]), 1),  # infer.herd2
}


def _fleet(url: str, lists: list[str], n: int) -> list[Waker]:
    return [Waker(redis.Redis.from_url(url, socket_timeout=40),
                  redis.Redis.from_url(url, socket_timeout=40, single_connection_client=True),
                  lists, block_s=30).start() for _ in range(n)]


def _blocked_moves(r: redis.Redis) -> int:
    """How many connections of ``r``'s database are blocked in BLMOVE (or BRPOPLPUSH, Redis < 6.2)
    now (closed consumers of other tests may still block on theirs for a moment)."""
    db = str(r.connection_pool.connection_kwargs.get("db", 0))
    return sum(1 for c in r.client_list() if "b" in c["flags"] and str(c.get("db")) == db
               and c.get("cmd") in ("blmove", "brpoplpush"))


def _settled(r: redis.Redis, wakers: list[Waker], lists: list[str]) -> bool:
    """Every consumer blocked in Redis, every list watched, and exactly one connection blocked on
    each list (the watcher's), none on a list twice."""
    return (all(blocked_in_redis(r, int(w._own_id or 0)) for w in wakers)
            and all(r.get(WATCH_PREFIX + key) for key in lists)
            and _blocked_moves(r) == len(lists))


@pytest.mark.parametrize("case", list(HERD_LISTS))
def test_a_push_on_another_list_wakes_one_idle_consumer_and_its_take_exactly_one_more(
        redis_db, case: str) -> None:
    lists, k = HERD_LISTS[case]
    url, r = redis_db.url, redis_db.client
    # Given four idle consumers waiting on every list of their queue(s)
    wakers = _fleet(url, lists, 4)
    waits: list[tuple[threading.Thread, list[bool]]] = []
    try:
        for w in wakers:
            w.clear()
            w.arm()
        waits = [_wait_in_thread(w, 30) for w in wakers]
        # one BLMOVE per list in the whole fleet (it was 1 + 4 × 3 = 13 with a watcher thread per
        # list in every consumer)
        wait_for(lambda: _settled(r, wakers, lists), 10, "one watcher blocked on each list")
        watcher = next(i for i, w in enumerate(wakers)
                       if r.get(WATCH_PREFIX + lists[k]) == w.token.encode())
        # When a producer pushes one request on the second list
        r.lpush(lists[k], task_message("asyncinfer.infer", "one", {"model": "herd"}, lists[k]))
        # Then its watcher wakes, and only it
        waits[watcher][0].join(10)
        assert waits[watcher][1] == [True]
        others = [i for i in range(4) if i != watcher]
        time.sleep(0.3)  # (the others would have woken by now too, if each blocked on the list)
        assert all(waits[i][0].is_alive() and blocked_in_redis(r, int(wakers[i]._own_id or 0))
                   for i in others)
        # When the watcher takes it, it passes that list's watch on: exactly one other wakes
        assert k in wakers[watcher].passable()
        taker = Taker(r)
        taken = taker.take(lists, 8, watcher=wakers[watcher].token,
                           watched=wakers[watcher].passable())
        assert [key for key, *_ in taken] == [lists[k]] and k in taker.passed
        assert r.get(WATCH_PREFIX + lists[k]) is None
        woke = wait_for(lambda: [i for i in others if not waits[i][0].is_alive()], 10,
                        "one other consumer woken by the bell")
        time.sleep(0.3)
        assert len(woke) == 1 and len([i for i in others if not waits[i][0].is_alive()]) == 1
    finally:
        for w in wakers:
            w.close()
        for thread, _ in waits:
            thread.join(10)


class _Consumer:
    """A fast consumer's intake loop, without the rest: take, then wait when a take was not full."""

    def __init__(self, url: str, lists: list[str], room: int, wait_s: float) -> None:
        self.lists, self.room, self.wait_s = lists, room, wait_s
        self.waker = _fleet(url, lists, 1)[0]
        self.taker = Taker(redis.Redis.from_url(url, socket_timeout=40))
        self.takes = 0
        self.got: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.waker.clear()
            taken = self.taker.take(self.lists, self.room, watcher=self.waker.token,
                                    watched=self.waker.passable())
            self.takes += 1
            if self.taker.passed:
                self.waker.watch_passed(self.taker.passed)
            self.got += [raw for _, raw, _, _, _ in taken]
            if len(taken) < self.room:
                self.waker.arm()
                self.waker.wait(self.wait_s)

    def close(self) -> None:
        self.stop.set()
        self.waker.close()
        self.thread.join(10)


def _ids(consumers: list[_Consumer]) -> list[str]:
    return [json.loads(raw)["headers"]["id"] for c in consumers for raw in list(c.got)]


@pytest.mark.parametrize("case", list(HERD_LISTS))
def test_pushes_on_two_lists_at_once_wake_few_consumers_and_every_message_is_taken(
        redis_db, case: str) -> None:
    lists, k = HERD_LISTS[case]
    url, r = redis_db.url, redis_db.client
    # Given six consumers whose idle wait lasts 30 s (no once-a-second take to hide a stranded
    # message)
    consumers = [_Consumer(url, lists, room=4, wait_s=30) for _ in range(6)]
    wakers = [c.waker for c in consumers]
    sent: list[str] = []

    def push(request_id: str, key: str, pipe: Any) -> None:
        sent.append(request_id)
        pipe.lpush(key, task_message("asyncinfer.infer", request_id, {"model": "herd"}, key))

    try:
        # When, ten times, one request comes on the first list and one on the other, at once
        per_round = []
        for n in range(20):
            wait_for(lambda: _settled(r, wakers, lists), 10, "one watcher blocked on each list")
            before = sum(c.takes for c in consumers)
            pipe = r.pipeline(transaction=True)
            push(f"a-{n}", lists[0], pipe)
            push(f"b-{n}", lists[k], pipe)
            pipe.execute()
            # Then both are taken, without waiting for a timeout
            wait_for(lambda: len(_ids(consumers)) == len(sent), 5, "both taken", poll_s=0.01)
            wait_for(lambda: _settled(r, wakers, lists), 10, "the fleet idle again")
            per_round.append(sum(c.takes for c in consumers) - before)
        # by about three takes a round: each list's watcher (one consumer, when it watches both),
        # and one more woken by the bell of each take that passed a watch on; rarely one or two
        # more (a bell rung as its waiter left wakes the next one). With every consumer blocked
        # on every list but the first, one such round made 7 to 12 takes here.
        assert sum(per_round) <= 4 * len(per_round) and max(per_round) <= 6, per_round
        # When bursts come on both lists at once, from two producers
        def burst(key: str, prefix: str) -> None:
            for b in range(10):
                pipe = r.pipeline(transaction=False)
                for m in range(10):
                    push(f"{prefix}-{b}-{m}", key, pipe)
                pipe.execute()
                time.sleep(0.01)
        producers = [threading.Thread(target=burst, args=(lists[0], "burst-a")),
                     threading.Thread(target=burst, args=(lists[k], "burst-b"))]
        for p in producers:
            p.start()
        for p in producers:
            p.join(10)
        # Then every message is taken, once, and none is left on a list
        wait_for(lambda: len(_ids(consumers)) >= len(sent), 10, "every message taken", poll_s=0.05)
        assert sorted(_ids(consumers)) == sorted(sent) and len(sent) == 240
        assert not any(r.llen(key) for key in lists)
    finally:
        for c in consumers:
            c.close()


def test_a_watcher_whose_consumer_is_busy_hands_its_list_to_an_idle_one(redis_db) -> None:
    lists, k = HERD_LISTS["second queue"]
    url, r = redis_db.url, redis_db.client
    # Given a consumer whose threads watch every list but the first (it waits on that one only
    # while idle), then two idle ones: one watching the first list, one waiting for the bells
    busy = _fleet(url, lists, 1)[0]
    wakers = [busy]
    waits: list[tuple[threading.Thread, list[bool]]] = []
    try:
        busy.clear()
        busy.arm()
        wait_for(lambda: all(r.get(WATCH_PREFIX + key) == busy.token.encode() for key in lists[1:])
                 and _blocked_moves(r) == len(lists) - 1, 10, "the first consumer watching")
        for _ in range(2):
            wakers.append(_fleet(url, lists, 1)[0])
            wakers[-1].clear()
            wakers[-1].arm()
            waits.append(_wait_in_thread(wakers[-1], 30))
            wait_for(lambda: blocked_in_redis(r, int(wakers[-1]._own_id or 0)), 10, "waiting")
        first, idle = wakers[1:]
        assert r.get(WATCH_PREFIX + lists[0]) == first.token.encode()
        # When the first is busy (taking, or full) and a request comes on one of its lists
        busy.clear()
        r.lpush(lists[k], task_message("asyncinfer.infer", "one", {"model": "herd"}, lists[k]))
        # Then its watcher passes that list on: the consumer waiting for the bells wakes (and
        # only it), and watches the list next
        waits[1][0].join(10)
        assert waits[1][1] == [True] and busy._wake.is_set()
        assert waits[0][0].is_alive() and r.get(WATCH_PREFIX + lists[k]) is None
        idle.clear()
        assert len(Taker(r).take(lists, 8, watcher=idle.token, watched=idle.passable())) == 1
        idle.arm()
        waits.append(_wait_in_thread(idle, 30))
        wait_for(lambda: r.get(WATCH_PREFIX + lists[k]) == idle.token.encode(), 10,
                 "the idle consumer watching the list")
    finally:
        for w in wakers:
            w.close()
        for thread, _ in waits:
            thread.join(10)


def test_a_take_passes_on_the_watches_given_that_are_its_own_and_rings_one_bell(redis_db) -> None:
    r = redis_db.client
    lists = priority_lists(["infer.pass"])
    mine, theirs = "mine", "theirs"
    for key in lists:
        r.set(WATCH_PREFIX + key, mine)
        r.set(BELL_PREFIX + key + WAITERS_SUFFIX, 2)  # others wait for each bell
    r.set(WATCH_PREFIX + lists[3], theirs)
    for key in lists:
        r.lpush(key, task_message("asyncinfer.infer", key, {"model": "pass"}, key))
    taker = Taker(r)
    # the watches of lists 0, 1 and 3 given (list 2's thread still blocks on it: not given)
    taken = taker.take(lists, 8, watcher=mine, watched=(0, 1, 3))
    assert len(taken) == 4 and taker.passed == (0, 1) and taker.passed_watch
    assert [r.get(WATCH_PREFIX + key) for key in lists] == [None, None, mine.encode(),
                                                             theirs.encode()]
    # one bell rings (the first passed list's), not one per list
    assert [r.llen(BELL_PREFIX + key) for key in lists] == [1, 0, 0, 0]
    # alone (nobody waits), a take keeps its watch; without a token (kombu's channel) it passes none
    r.delete(BELL_PREFIX + lists[0], BELL_PREFIX + lists[0] + WAITERS_SUFFIX)
    r.set(WATCH_PREFIX + lists[0], mine)
    r.lpush(lists[0], task_message("asyncinfer.infer", "alone", {"model": "pass"}, lists[0]))
    assert len(taker.take(lists, 8, watcher=mine, watched=(0,))) == 1 and taker.passed == ()
    r.lpush(lists[1], task_message("asyncinfer.infer", "kombu", {"model": "pass"}, lists[1]))
    assert len(taker.take(lists, 8)) == 1 and taker.passed == ()
    assert r.get(WATCH_PREFIX + lists[0]) == mine.encode()


def test_a_closing_consumer_gives_up_its_watches_and_no_one_elses(redis_db: RedisDatabase) -> None:
    url, r = redis_db.url, redis_db.client
    lists = priority_lists(["infer.release"])
    wakers = _fleet(url, lists, 2)
    threads = []
    try:
        # Given two idle consumers, each list watched by one of them
        threads = [_wait_in_thread(w, 30)[0] for w in wakers]
        wait_for(lambda: all(r.get(WATCH_PREFIX + key) for key in lists), 20, "every list watched")
        owner = r.get(WATCH_PREFIX + lists[0])
        closing = next(w for w in wakers if w.token.encode() == owner)
        staying = next(w for w in wakers if w is not closing)
        mine = {key for key in lists if r.get(WATCH_PREFIX + key) == owner}
        theirs = set(lists) - mine
        assert lists[0] in mine
        # When the consumer watching the first list closes
        closing.close()
        # Then its watches are gone at once (not left to lapse: gone, or already the other's,
        # which may claim a freed list at once), the other's stay
        assert [key for key in mine if r.get(WATCH_PREFIX + key) == owner] == []
        assert all(r.get(WATCH_PREFIX + key) == staying.token.encode() for key in theirs)
    finally:
        for w in wakers:
            w.close()
        for thread in threads:
            thread.join(timeout=40)
