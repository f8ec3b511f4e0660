"""A fleet's faults on real network hosts (tests/support/netns.py), at the shipped defaults.

Redis runs on a host of its own, each worker on another, the producer (this test process) in
the root namespace; every one of them reaches Redis through a proxy on Redis' host that adds
1 ms to each round trip. The faults are a host's: its link taken down at the bridge (nothing
reaches it, no reset) with or without its worker killed (kill -9), not a proxy's cut on
loopback (tests/faults/test_fleet.py, test_host_loss.py). Each test prints sent / answered /
lost / ran twice and the seconds to the last answer (``pytest -s``). Skipped, with the reason,
where the machine does not allow network namespaces (not root, no ``ip netns``).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.ops.redis_server import redis_server_binary
from asyncinfer.wire.keys import LEASES_KEY, UNACKED_KEY
from tests.support.crashy import (
    crashy_batches,
    crashy_env,
    crashy_index,
    crashy_starts,
    report_counts,
)
from tests.support.netns import NetnsUnavailable, Network
from tests.support.processes import WorkerProcess, ready_together, stop_together, worker_env
from tests.support.waiting import wait_for

#: Redis' port on its host, and the delaying proxy's beside it (each host is a namespace of its
#: own: no other process listens there).
REDIS_PORT, FAR_PORT = 6379, 6380
#: What the proxy adds to each round trip to Redis.
DELAY_MS = 1.0
#: How long a future may wait: the lease (10 s) plus a sweep plus the work, with room for a
#: loaded host, and far below the visibility timeout (3,600 s).
ANSWER_WITHIN_S = 60


@dataclass
class Fleet:
    """The hosts, and Redis on one of them: ``far`` through the proxy, ``near`` direct, and
    ``local`` through its unix socket, off the network: what the test and the "crashy" model
    count (each start on the device) is not cut with a host's link."""

    net: Network
    logs: Path
    databases: Iterator[int]

    def far_url(self, db: int) -> str:
        return f"redis://{self.net.address('redis')}:{FAR_PORT}/{db}"

    def near_url(self, db: int) -> str:
        return f"redis://{self.net.address('redis')}:{REDIS_PORT}/{db}"

    def local_url(self, db: int) -> str:
        return f"unix://{self.logs / 'redis.sock'}?db={db}"

    def worker(self, host: str, name: str, db: int, env: dict[str, str]) -> WorkerProcess:
        """A "crashy" worker ``name`` launched on ``host``, talking to Redis through the proxy
        (not waited for: :func:`ready_together` waits)."""
        argv = self.net.command(host, [sys.executable, "-m", "asyncinfer", "worker", "--device",
                                       "cpu", "--models", "crashy", "--hostname", f"{name}@%h"])
        proc = WorkerProcess(argv, worker_env(self.far_url(db), **env),
                             self.logs / f"{name}-{db}.log")
        self.net.track(proc.process)
        return proc


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Hosts ``redis``, ``w1`` and ``w2`` on a bridge; a redis-server on ``redis``, and the
    proxy in front of it."""
    net = Network(["redis", "w1", "w2"])
    try:
        net.start()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    logs = tmp_path_factory.mktemp("netns-fleet")
    try:
        with open(logs / "redis.log", "wb") as log:
            server = net.run("redis", [redis_server_binary(), "--port", str(REDIS_PORT),
                                       "--bind", "0.0.0.0", "--protected-mode", "no", "--save", "",
                                       "--appendonly", "no", "--dir", str(logs),
                                       "--unixsocket", str(logs / "redis.sock"),
                                       "--unixsocketperm", "700"], stdout=log)
        near = redis.Redis(host=net.address("redis"), port=REDIS_PORT, socket_timeout=1.0)
        try:
            wait_for(lambda: server.poll() is None and _pings(near), 10, "redis-server on its host")
        finally:
            near.close()
        net.delay("redis", FAR_PORT, ("127.0.0.1", REDIS_PORT), DELAY_MS, log=logs / "proxy.log")
        yield Fleet(net, logs, count(1))
    finally:
        net.close()


def _pings(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.RedisError:
        return False


@pytest.fixture()
def db(fleet: Fleet) -> Iterator[tuple[int, redis.Redis]]:
    """A database of the fleet's Redis of this test's own, and a client of it (local)."""
    number = next(fleet.databases)
    r = redis.Redis.from_url(fleet.local_url(number))
    r.flushdb()
    try:
        yield number, r
    finally:
        r.close()


def _two_workers(fleet: Fleet, db: int, first_env: dict[str, str],
                 second_env: dict[str, str]) -> tuple[WorkerProcess, WorkerProcess]:
    """"first" on host w1 and "second" on host w2, started side by side, both ready."""
    first = fleet.worker("w1", "first", db, first_env)
    second = fleet.worker("w2", "second", db, second_env)
    ready_together([first, second])
    return first, second


def _worker_of(answer: object) -> str:
    return str(answer.parameters["worker"])  # type: ignore[attr-defined]


class Announcements:
    """Every result announced on Redis (the store script publishes each on its result key's
    channel) and which of ``names`` announced it, recorded on a thread: each answer a request
    got, counted on Redis' side, not only the first its caller saw."""

    END = "celery-task-meta-end-of-announcements"

    def __init__(self, url: str, names: tuple[str, ...]) -> None:
        self.names = names
        self.seen: list[tuple[str, str]] = []  # (request ID, announcer: a name, or "?")
        self.error: BaseException | None = None
        self._client = redis.Redis.from_url(url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.psubscribe("celery-task-meta-*")
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="announcements")
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._ended.is_set():
                message = self._pubsub.get_message(timeout=0.1)
                if message is None:
                    continue
                channel, data = message["channel"].decode(), message["data"]
                if channel == self.END:
                    self._ended.set()
                    break
                who = [n for n in self.names if f"{n}@".encode() in data]
                self.seen.append((channel.removeprefix("celery-task-meta-"),
                                  who[0] if len(who) == 1 else "?"))
        except redis.RedisError as exc:
            self.error = exc

    def finish(self, timeout_s: float = 10.0) -> list[tuple[str, str]]:
        """Everything announced until now (a marker published after it has come through)."""
        self._client.publish(self.END, "")
        self._thread.join(timeout_s)
        assert self.error is None and self._ended.is_set(), self.error
        return self.seen

    def close(self) -> None:
        self._ended.set()
        self._thread.join(5)
        self._pubsub.close()
        self._client.close()


@pytest.mark.timeout(120)
def test_a_host_lost_under_a_batch_the_survivor_answers_every_request(fleet, db) -> None:
    number, r = db
    kernel_s, rows = 2.0, 8
    prefix, env = crashy_env(fleet.local_url(number), "netns-host-lost", kernel_s)
    first, second = _two_workers(fleet, number, env, env)
    client = Client(broker_url=fleet.far_url(number))
    try:
        # Given a full batch (8) on the device of the worker on host w1, and a worker idle on
        # host w2 (both frozen while the requests are sent, so that the first takes them at once)
        for worker in (first, second):
            os.kill(worker.pid, signal.SIGSTOP)
        futures = [client.submit("crashy", crashy_index(i)) for i in range(rows)]
        for f in futures:
            f.sent()
        os.kill(first.pid, signal.SIGCONT)
        wait_for(lambda: crashy_batches(r, prefix), 30, "a batch on the first worker's device")
        os.kill(second.pid, signal.SIGCONT)
        assert sorted(crashy_batches(r, prefix)[0]) == list(range(rows))
        # When host w1 is lost: its link goes down and its worker dies (kill -9) at once, so no
        # FIN or reset reaches Redis or the proxy
        struck = time.monotonic()
        fleet.net.partition("w1")
        first.process.kill()
        first.process.wait()
        # Then the worker on w2 answers every one, each with its own value
        answers = [f.result(timeout=ANSWER_WITHIN_S) for f in futures]
        last_s = time.monotonic() - struck
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(rows)]
        assert {_worker_of(a) for a in answers} == {"second@w2"}
        # And it ran the lost batch again once, whole (the suspects together)
        assert [sorted(b) for b in crashy_batches(r, prefix)[1:]] == [list(range(rows))]
        starts = crashy_starts(r, prefix)
        assert starts == {i: 2 for i in range(rows)}
        assert r.hlen(UNACKED_KEY) == 0 and r.zcard(LEASES_KEY) == 0
        lease_s = Settings().lease_s
        report_counts(f"host w1 lost (link down, kill -9) under a batch of {rows} on a "
                      f"{kernel_s:g} s kernel", rows, len(answers), starts, last_s)
        assert last_s < lease_s + 2 * kernel_s + 10  # the lease, a sweep, one rerun; loaded host
    finally:
        client.close()
        stop_together([first, second])
        fleet.net.heal("w1")


@pytest.mark.timeout(150)
def test_a_partitioned_host_its_requests_answered_by_the_other_and_not_again_once_healed(
        fleet, db) -> None:
    number, r = db
    # longer than the lease, the heal and a loaded host's delays together (15 s was not, once, in
    # a full run: the batch came off w1's device before the heal, and w1 started the 4 behind it)
    kernel_s = 25.0
    prefix, slow = crashy_env(fleet.local_url(number), "netns-partition", kernel_s)
    first, second = _two_workers(fleet, number, slow, {**slow, "CRASHY_SLEEP_S": "0.2"})
    client = Client(broker_url=fleet.far_url(number))
    announcements = Announcements(fleet.local_url(number), ("first", "second"))
    try:
        # Given 12 requests held by the worker on host w1: a batch of 8 on its device (15 s),
        # 4 waiting behind it
        os.kill(second.pid, signal.SIGSTOP)
        futures = [client.submit("crashy", crashy_index(i)) for i in range(12)]
        wait_for(lambda: r.hlen(UNACKED_KEY) == 12 and r.llen("infer.crashy") == 0, 30,
                 "the first worker to hold all 12")
        wait_for(lambda: crashy_batches(r, prefix), 30, "a batch on the first worker's device")
        os.kill(second.pid, signal.SIGCONT)
        on_device = set(crashy_batches(r, prefix)[0])
        # When host w1's link goes down
        struck = time.monotonic()
        fleet.net.partition("w1")
        # Then the worker on w2 answers every one, after the lease (default), none lost
        answers = [f.result(timeout=ANSWER_WITHIN_S) for f in futures]
        last_s = time.monotonic() - struck
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(12)]
        assert {_worker_of(a) for a in answers} == {"second@w2"}
        assert last_s >= Settings().lease_s - Settings().lease_s / 3  # not before the lease ran out
        starts = crashy_starts(r, prefix)
        report_counts("host w1 partitioned holding 12 (8 on its device)", 12, len(answers),
                      starts, last_s)
        # When the link heals, the worker on w1 finds its leases gone to w2, and is then stopped
        # (SIGTERM: it finishes what is on its device and writes what it has)
        healed = time.monotonic()
        fleet.net.heal("w1")
        wait_for(lambda: "leased to another worker" in first.log(), 30, "the lost leases seen")
        seen_s = time.monotonic() - healed
        stop_together([first])
        # Then nothing ran a third time, and what w1 had not started it gave up (it ran on w2
        # alone: once)
        starts = crashy_starts(r, prefix)
        assert starts == {i: 2 if i in on_device else 1 for i in range(12)}, starts
        given_up = sum(int(n) for n in re.findall(r"gave up (\d+)", first.log()))
        assert given_up == 12 - len(on_device), first.log()[-3000:]
        # And every request's stored answer is its own value; w1 answered again at most those
        # that were on its device when it was cut off (at least once: docs/delivery.md)
        for i, f in enumerate(futures):
            assert client.result(f.id, timeout_s=10)["output"].tolist() == [[float(i)]]
        seen = announcements.finish()
        by_first = Counter(request for request, who in seen if who == "first")
        by_second = Counter(request for request, who in seen if who == "second")
        ids = {f.id: i for i, f in enumerate(futures)}
        again = sorted(ids[request] for request in by_first if request in ids)
        assert {request for request, who in seen if who == "?"} == set(), seen
        assert all(by_second[f.id] == 1 for f in futures), by_second
        assert set(again) <= on_device, again
        print(f"healed: w1 saw its leases gone {seen_s:.1f} s after the heal, gave up "
              f"{given_up} not started; answered again (after w2 had) {len(again)} of the "
              f"{len(on_device)} on its device: {again}")
    finally:
        announcements.close()
        client.close()
        fleet.net.heal("w1")
        stop_together([first, second])


@pytest.mark.timeout(120)
def test_two_hundred_requests_through_a_fleet_one_ms_from_redis(fleet, db) -> None:
    number, r = db
    prefix, env = crashy_env(fleet.local_url(number), "netns-far", 0.0)
    first, second = _two_workers(fleet, number, env, env)
    client = Client(broker_url=fleet.far_url(number))
    far, near = (redis.Redis.from_url(url) for url in (fleet.far_url(number),
                                                       fleet.near_url(number)))
    try:
        # Given Redis 1 ms away from each worker and from the producer
        rtt_ms = _round_trip_ms(far), _round_trip_ms(near)
        # When 200 requests go through the fleet of two
        sent_at = time.monotonic()
        futures = [client.submit("crashy", crashy_index(i)) for i in range(200)]
        answers = [f.result(timeout=ANSWER_WITHIN_S) for f in futures]
        last_s = time.monotonic() - sent_at
        # Then every one is answered with its own value, each run once
        assert [a["output"].tolist() for a in answers] == [[[float(i)]] for i in range(200)]
        assert crashy_starts(r, prefix) == {i: 1 for i in range(200)}
        by_worker = Counter(_worker_of(a) for a in answers)
        assert set(by_worker) <= {"first@w1", "second@w2"}
        twice = sum(1 for n in crashy_starts(r, prefix).values() if n > 1)
        print(f"\n200 requests, Redis 1 ms away (PING through the proxy {rtt_ms[0]:.2f} ms, direct "
              f"{rtt_ms[1]:.2f} ms): sent 200, answered {len(answers)}, lost "
              f"{200 - len(answers)}, ran twice {twice}, last answer {last_s:.2f} s after the "
              f"first send; by worker {dict(by_worker)}")
    finally:
        far.close()
        near.close()
        client.close()
        stop_together([first, second])


def _round_trip_ms(r: redis.Redis, n: int = 50) -> float:
    """The median of ``n`` PINGs, in ms."""
    r.ping()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        r.ping()
        times.append((time.perf_counter() - t) * 1000)
    return sorted(times)[n // 2]
