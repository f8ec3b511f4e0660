"""The app's kombu channel takes with the atomic take script on a real Redis (broker/atomic_take.py):
no BRPOP, every list of every queue served, each message recorded in kombu's bookkeeping before
its consumer sees it, nothing left recorded that nobody will acknowledge, and in kombu's event loop
an acknowledgement from another thread wakes the loop of a full prefetch window to take again."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

from asyncinfer.celery_app import create_app
from asyncinfer.config.settings import Settings
from asyncinfer.ops.redis_server import RedisServer
from asyncinfer.worker.bootstrap import take_atomically

EXCHANGE = Exchange("take", type="direct")
QUEUES = [Queue(name, EXCHANGE, routing_key=name, queue_arguments={"x-max-priority": 10})
          for name in ("take.a", "take.b")]


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of its own: its command counts are this test's."""
    s = RedisServer(tmp_path / "redis", appendonly=False).start()
    try:
        yield s
    finally:
        s.stop()


def _worker_app(url: str) -> Any:
    """The app as a worker configures it at start (worker/bootstrap.py)."""
    app = create_app(Settings(broker_url=url))
    take_atomically(app)
    return app


def _drain(conn: Any, received: list[Any], count: int) -> None:
    for _ in range(200):
        if len(received) >= count:
            return
        try:
            conn.drain_events(timeout=0.5)
        except TimeoutError:
            pass
    raise TimeoutError(f"{len(received)} of {count} messages received")


def _calls(r: redis.Redis, command: str) -> int:
    return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_every_list_is_taken_atomically_and_recorded_before_the_consumer_sees_it(server) -> None:
    app = _worker_app(server.url)
    r = redis.Redis.from_url(server.url)
    received: list[tuple[str, int, bool]] = []

    def on_message(body: Any, message: Any) -> None:
        # recorded in kombu's bookkeeping before it is handed over
        received.append((message.delivery_info["routing_key"], body["n"],
                         bool(r.hexists("unacked", message.delivery_tag))))
        message.ack()

    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            assert channel.atomic_take
            producer = Producer(channel, EXCHANGE)
            for q in QUEUES:
                q(channel).declare()
            # a second queue, and a priority list of the first
            producer.publish({"n": 1}, routing_key="take.a")
            producer.publish({"n": 2}, routing_key="take.b")
            producer.publish({"n": 3}, routing_key="take.a", priority=9)
            with Consumer(channel, QUEUES, callbacks=[on_message], accept=["json"]):
                _drain(conn, received, 3)
        assert sorted(n for _, n, _ in received) == [1, 2, 3]
        assert all(recorded for _, _, recorded in received), received
        assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0
        assert _calls(r, "brpop") == 0 and _calls(r, "evalsha") > 0
    finally:
        r.close()


def test_a_consumer_that_does_not_acknowledge_leaves_nothing_recorded(server) -> None:
    app = _worker_app(server.url)
    r = redis.Redis.from_url(server.url)
    received: list[Any] = []
    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            QUEUES[0](channel).declare()
            Producer(channel, EXCHANGE).publish({"n": 1}, routing_key="take.a")
            with Consumer(channel, QUEUES[:1], callbacks=[lambda b, m: received.append(b)],
                          accept=["json"], no_ack=True):
                _drain(conn, received, 1)
        assert received == [{"n": 1}]
        assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0
    finally:
        r.close()


def test_a_message_the_script_records_but_the_rules_refuse_leaves_the_bookkeeping(server) -> None:
    app = _worker_app(server.url)
    r = redis.Redis.from_url(server.url)
    received: list[Any] = []
    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            QUEUES[0](channel).declare()
            producer = Producer(channel, EXCHANGE)
            producer.publish({"n": 1}, routing_key="take.a")
            # a well-formed envelope (the script records it) with a header of the wrong type
            raw = json.loads(r.lindex("take.a", 0))
            raw["headers"] = {"retries": "many"}
            raw["properties"]["delivery_tag"] = "bad-tag"
            r.lpush("take.a", json.dumps(raw))
            producer.publish({"n": 2}, routing_key="take.a")
            with Consumer(channel, QUEUES[:1], accept=["json"],
                          callbacks=[lambda b, m: (received.append(b), m.ack())]):
                _drain(conn, received, 2)
        assert sorted(b["n"] for b in received) == [1, 2]
        assert r.hlen("unacked") == 0 and r.zcard("unacked_index") == 0
        assert r.llen("take.a") == 0
    finally:
        r.close()


@pytest.mark.parametrize("queue, waits_s, sweeps", [
    ("asyncinfer.control", 1.0, False), ("take.a", 0.1, True)])
def test_a_channel_where_no_task_is_served_waits_a_second_and_leaves_the_sweep_to_the_worker(
        server, queue: str, waits_s: float, sweeps: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a worker's channel on the control queue (Celery's consumer beside the fast consumer)
    # or on a queue of tasks
    app = _worker_app(server.url)
    r = redis.Redis.from_url(server.url)
    waits: list[float] = []
    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            q = Queue(queue, EXCHANGE, routing_key=queue)
            q(channel).declare()
            sent = redis.connection.Connection.send_command

            def send_command(self: Any, *args: Any, **kwargs: Any) -> Any:
                if args and args[0] == "BLMOVE":
                    waits.append(float(args[-1]))
                return sent(self, *args, **kwargs)

            monkeypatch.setattr(redis.connection.Connection, "send_command", send_command)
            # When it idles (nothing on its lists)
            with Consumer(channel, [q], callbacks=[], accept=["json"]):
                for _ in range(3):
                    try:
                        conn.drain_events(timeout=0.5)
                    except TimeoutError:
                        pass
            # Then it waits BRPOP's second on the control queue, 0.1 s on a queue of tasks, and
            # only the latter's leases sweep (a device worker's fast consumer sweeps for it)
            assert waits and set(waits) == {waits_s}
            assert bool(channel._leases.sweep_every_s) is sweeps
    finally:
        r.close()


def test_an_acknowledgement_from_another_thread_wakes_the_loop_of_a_full_window(server) -> None:
    # Given a channel in kombu's event loop (Celery's hub) whose prefetch window of 1 is full
    app = _worker_app(server.url)
    r = redis.Redis.from_url(server.url)
    received: list[Any] = []
    hub = Hub()
    woken: list[bool] = []
    stop = threading.Event()
    try:
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            channel.basic_qos(0, 1, False)
            QUEUES[0](channel).declare()
            producer = Producer(channel, EXCHANGE)
            for n in (1, 2):
                producer.publish({"n": n}, routing_key="take.a")
            with Consumer(channel, QUEUES[:1], accept=["json"],
                          callbacks=[lambda b, m: received.append(m)]):
                conn.transport.register_with_event_loop(conn.connection, hub)
                poll = hub.poller.poll

                def polled(timeout: Any) -> Any:  # which polls ended by the hub's waker
                    events = poll(timeout)
                    waker = hub._waker.fileno() if hub._waker is not None else -1
                    woken.append(any(fd == waker for fd, _ in events or ()))
                    return events

                hub.poller.poll = polled
                loop = hub.create_loop()

                def run() -> None:
                    for _ in loop:
                        if stop.is_set():
                            return

                runner = threading.Thread(target=run, daemon=True)
                runner.start()
                _wait_for(lambda: len(received) == 1)
                woken_before = sum(woken)
                # When the consumer acknowledges it from another thread (the pipeline's writer)
                received[0].ack()
                # Then the acknowledgement woke the loop, which took the second message
                _wait_for(lambda: len(received) == 2)
                assert [m.decode()["n"] for m in received] == [1, 2]
                assert sum(woken) > woken_before, woken
                received[1].ack()
                stop.set()
                hub.call_soon(lambda: None)  # wakes it to see stop
                runner.join(timeout=30)
        assert r.hlen("unacked") == 0
    finally:
        stop.set()
        hub.close()
        r.close()


def _wait_for(condition: Any, timeout_s: float = 60) -> None:
    ends = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > ends:
            raise TimeoutError("not met in time")
        time.sleep(0.01)
