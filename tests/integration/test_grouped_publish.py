"""A producer far from Redis (a real Redis behind the bench's delay proxy) sends its requests in
groups and keeps every promise of a submit: each request on its queue in the order it was
submitted, or an error that says why. The same promises hold for both forms of the grouped
publisher (client/grouped.py): the blocking ``Client``'s thread (``submit`` then
``future.sent()``) and the event loop's (client/loop_publisher.py: a coroutine awaits its
request, which goes in the loop's next group; what the gateway and ``asubmit`` use)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from asyncinfer.client import Client, aio
from asyncinfer.config.settings import Settings
from asyncinfer.errors import AsyncInferError, BrokerUnavailable, InvalidRequest, QueueFull
from asyncinfer.ops.benchmark.latency_proxy import LatencyProxy
from asyncinfer.wire.keys import CLAIM_PREFIX, TRACES_KEY
from tests.support.databases import RedisDatabase

pytestmark = pytest.mark.timeout(120)

X = np.zeros((1, 4), np.float32)
#: Round trip through the proxy (ms): long enough that requests pile up behind each one.
RTT_MS = 20.0

#: What one request came to: its ID, and None (on its queue) or the error that refused it.
Outcome = tuple[str, BaseException | None]
#: Called while a burst is out, after the first request is sent ("first_sent") or at once
#: ("handed", every request handed to the publisher).
Hook = tuple[str, Callable[[], None]]


class Thread:
    """The blocking form: ``client.submit`` for each, then ``future.sent()`` for each."""

    def burst(self, client: Client, requests: list[dict[str, Any]], hook: Hook | None = None,
              close: bool = False) -> list[Outcome]:
        futures = [client.submit(r.pop("model", "m"), X, **r) for r in requests]
        if hook is not None:
            if hook[0] == "first_sent":
                futures[0].sent(timeout_s=30)
            hook[1]()
        if close:
            client.close()  # at once: most are still waiting for their group
        outcomes: list[Outcome] = []
        for future in futures:
            try:
                assert future.sent(timeout_s=60) is future
                outcomes.append((future.id, None))
            except AsyncInferError as exc:
                assert isinstance(future.exception(timeout=1), type(exc))  # the future's outcome
                outcomes.append((future.id, exc))
        return outcomes


class Loop:
    """The asyncio form: one coroutine per request, each awaiting its own publish
    (:func:`aio.send_on_loop`, what ``asubmit`` and the gateway do with a small request)."""

    def burst(self, client: Client, requests: list[dict[str, Any]], hook: Hook | None = None,
              close: bool = False) -> list[Outcome]:
        async def main() -> list[Any]:
            outgoing = [client.submission(r.pop("model", "m"), X, **r) for r in requests]
            tasks = [asyncio.create_task(aio.send_on_loop(client.sender, o)) for o in outgoing]
            if hook is not None:
                if hook[0] == "first_sent":
                    await asyncio.wait([tasks[0]])
                await asyncio.to_thread(hook[1])
            if close:
                await asyncio.sleep(0)  # every coroutine has handed its request over
                await client.loop_publishers.aclose()
                assert all(t.done() for t in tasks)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            await client.loop_publishers.aclose()
            return [(o.request_id, r if isinstance(r, BaseException) else None)
                    for o, r in zip(outgoing, results, strict=True)]

        outcomes = asyncio.run(main())
        if close:
            client.close()
        return outcomes


@pytest.fixture(params=[Thread(), Loop()], ids=["thread", "loop"])
def form(request: pytest.FixtureRequest) -> Thread | Loop:
    return request.param


@pytest.fixture()
def far(redis_db: RedisDatabase) -> Iterator[LatencyProxy]:
    """The test's database, a ``RTT_MS`` round trip away."""
    with LatencyProxy(redis_db.url, RTT_MS) as proxy:
        yield proxy


def _client(url: str, **options: object) -> Client:
    return Client(settings=Settings(broker_url=url, model_retention_s=0, **options))


def _queued_ids(db: RedisDatabase, queue: str) -> list[str]:
    """The request IDs on ``queue``, first to be taken first (consumers pop from the tail)."""
    return [_id_of(m) for m in reversed(db.client.lrange(queue, 0, -1))]


def _id_of(message: bytes) -> str:
    """The request ID in a queued message (kombu's envelope: its ``headers.id``)."""
    return str(json.loads(message)["headers"]["id"])


def _script_calls(db: RedisDatabase) -> int:
    """Calls of the publish script so far (EVAL the first time, EVALSHA after)."""
    stats = db.client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "evalsha"))


def _sent(outcomes: list[Outcome]) -> list[str]:
    return [request_id for request_id, error in outcomes if error is None]


def test_requests_far_from_redis_go_in_groups_in_submit_order(
        redis_db: RedisDatabase, far: LatencyProxy, form: Thread | Loop) -> None:
    # Given a client 20 ms from Redis
    client = _client(far.url)
    try:
        before = _script_calls(redis_db)
        # When 300 requests are submitted at once, each waited for until it is sent
        outcomes = form.burst(client, [{} for _ in range(300)])
        # Then every one is on the queue once, in the order submitted
        assert [error for _, error in outcomes] == [None] * 300
        assert _queued_ids(redis_db, "infer.m") == [request_id for request_id, _ in outcomes]
        # in a few groups (one script call each), not one round trip per request
        assert 1 <= _script_calls(redis_db) - before <= 30
        # each traced for the lost check, as a request sent alone is
        assert redis_db.client.hget(TRACES_KEY, outcomes[-1][0]) == b"infer.m"
    finally:
        client.close()


def test_close_sends_what_is_still_pending(redis_db: RedisDatabase, far: LatencyProxy,
                                           form: Thread | Loop) -> None:
    client = _client(far.url)
    outcomes = form.burst(client, [{} for _ in range(200)], close=True)
    assert [error for _, error in outcomes] == [None] * 200
    assert _queued_ids(redis_db, "infer.m") == [request_id for request_id, _ in outcomes]


def test_an_id_sent_twice_in_one_group_is_sent_once_and_another_model_is_refused(
        redis_db: RedisDatabase, far: LatencyProxy, form: Thread | Loop) -> None:
    client = _client(far.url)
    try:
        # Given the same caller-chosen ID three times in one burst, the third for another model
        first, second, other, plain = form.burst(client, [
            {"request_id": "dup-1"}, {"request_id": "dup-1"},
            {"request_id": "dup-1", "model": "other"}, {}])
        # Then the first two are sent (as one request), the third refused naming the rule
        assert first == ("dup-1", None) and second == ("dup-1", None) and plain[1] is None
        assert isinstance(other[1], InvalidRequest)
        assert str(other[1]).startswith("request dup-1: this request ID was already sent with a "
                                        "different model (first sent to queue infer.m, now to "
                                        "infer.other)")
        assert _queued_ids(redis_db, "infer.m") == ["dup-1", plain[0]]
        assert redis_db.client.llen("infer.other") == 0
        assert redis_db.client.get(CLAIM_PREFIX + "dup-1").split(b"\x1f")[0] == b"infer.m"
    finally:
        client.close()


def test_a_full_queue_refuses_each_request_over_its_bound_and_keeps_the_first(
        redis_db: RedisDatabase, far: LatencyProxy, form: Thread | Loop) -> None:
    # Given a bound of 5 on model m, and no wait for room
    client = _client(far.url, model_options='{"m": {"max_queue_size": 5}}')
    try:
        # When 8 requests are submitted in one burst
        outcomes = form.burst(client, [{} for _ in range(8)])
        # Then the first five are queued, in order, and the last three refused, each naming
        # itself and the bound
        assert [error for _, error in outcomes[:5]] == [None] * 5
        for request_id, error in outcomes[5:]:
            assert isinstance(error, QueueFull)
            assert str(error).startswith(f"request {request_id}: queue infer.m holds 5 requests")
            assert "max_queue_size 5" in str(error)
        assert _queued_ids(redis_db, "infer.m") == _sent(outcomes)
    finally:
        client.close()


def test_requests_waiting_for_room_keep_their_order(redis_db: RedisDatabase, far: LatencyProxy,
                                                    form: Thread | Loop) -> None:
    # Given a bound of 2 and a wait for room of 60 s
    client = _client(far.url, model_options='{"m": {"max_queue_size": 2}}')
    taken: list[str] = []
    stop = threading.Event()

    def consume() -> None:  # a slow consumer: one request at a time, from the tail
        while not stop.is_set() and len(taken) < 8:
            item = redis_db.client.brpop(["infer.m"], timeout=1)
            if item is not None:
                taken.append(_id_of(item[1]))
                stop.wait(0.03)

    consumer = threading.Thread(target=consume)
    try:
        # When 8 requests are submitted at once, more than the queue holds, and a consumer
        # starts once the first is sent
        outcomes = form.burst(client, [{"timeout_s": 60} for _ in range(8)],
                              hook=("first_sent", consumer.start))
        # Then each is sent once there is room, and they are taken in the order submitted
        assert [error for _, error in outcomes] == [None] * 8
        consumer.join(30)
        assert taken == [request_id for request_id, _ in outcomes]
    finally:
        stop.set()
        client.close()


def test_redis_going_away_mid_group_ends_every_request_in_it(redis_db: RedisDatabase,
                                                              form: Thread | Loop) -> None:
    # Given a client 400 ms from Redis that has sent a first burst
    with LatencyProxy(redis_db.url, 400.0) as far:
        client = _client(far.url)
        try:
            first = form.burst(client, [{} for _ in range(20)])
            assert [error for _, error in first] == [None] * 20
            # When the proxy dies while a second burst is on its way
            second = form.burst(client, [{} for _ in range(200)], hook=("handed", far.stop))
            # and a third is sent with nothing listening
            third = form.burst(client, [{} for _ in range(5)])
        finally:
            client.close()
    # Then every request of the second and third hears either that it was sent (only those
    # whose group was answered before the proxy died: a first part of the second, on a loaded
    # host) or BrokerUnavailable naming it, the last of the second and all of the third among
    # them; none hangs
    answered = [request_id for request_id, error in second if error is None]
    assert answered == [request_id for request_id, _ in second][:len(answered)]
    assert len(answered) < len(second)
    for request_id, error in second[len(answered):] + third:
        assert isinstance(error, BrokerUnavailable), (request_id, error)
        assert f"request {request_id}: broker unreachable" in str(error)
    # and the first is on the queue, in order; of the second, every one answered as sent and at
    # most what reached Redis, once, in order
    queued = _queued_ids(redis_db, "infer.m")
    assert queued[:20] == [request_id for request_id, _ in first]
    assert queued[20:] == [request_id for request_id, _ in second][:len(queued) - 20]
    assert len(queued) - 20 >= len(answered)


def test_a_group_whose_reply_is_lost_is_not_sent_again(redis_db: RedisDatabase,
                                                       form: Thread | Loop) -> None:
    # Given a client 400 ms from Redis, so a group's reply is 200 ms on its way back
    with LatencyProxy(redis_db.url, 400.0) as far:
        client = _client(far.url)

        def cut_after_redis_ran_them() -> None:
            deadline = time.monotonic() + 30
            while redis_db.client.llen("infer.m") < 50 and time.monotonic() < deadline:
                time.sleep(0.005)
            far.stop()  # the link breaks with the replies on their way back...
            far.start()  # ...and a new one opens at once on the same port

        try:
            # When a burst of 50 (generated IDs, nothing to recognise a resend by) is handed over
            # and the link breaks after Redis ran them, before their replies arrive
            outcomes = form.burst(client, [{} for _ in range(50)],
                                  hook=("handed", cut_after_redis_ran_them))
            # Then each request of the group cut hears the broker's error (it may have reached
            # its queue; a group that came back before is sent)...
            failed = [(request_id, error) for request_id, error in outcomes if error is not None]
            assert failed, "no group was out when the link broke"
            for request_id, error in failed:
                assert isinstance(error, BrokerUnavailable), (request_id, error)
                assert f"request {request_id}: broker unreachable" in str(error)
            # ...and is on the queue exactly once: the group was not sent again on the new link
            assert _queued_ids(redis_db, "infer.m") == [request_id for request_id, _ in outcomes]
            # while the client keeps sending on the new one
            assert form.burst(client, [{}])[0][1] is None
            assert redis_db.client.llen("infer.m") == 51
        finally:
            client.close()


def test_a_coroutine_cancelled_before_its_group_goes_withdraws_its_request(
        redis_db: RedisDatabase, far: LatencyProxy) -> None:
    # Given a loop whose first group is out (a round trip of RTT_MS)
    client = _client(far.url)

    async def main() -> list[str]:
        first = client.submission("m", X)
        sending = asyncio.create_task(aio.send_on_loop(client.sender, first))
        await asyncio.sleep(RTT_MS / 4000)  # the first group is on its way
        assert not sending.done()
        # When a coroutine hands its request over, then is cancelled (its caller gave up)
        # before the next group goes
        gone = client.submission("m", X)
        waiting = asyncio.create_task(aio.send_on_loop(client.sender, gone))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await sending
        after = client.submission("m", X)
        await aio.send_on_loop(client.sender, after)
        await client.loop_publishers.aclose()
        return [first.request_id, gone.request_id, after.request_id]

    try:
        first_id, gone_id, after_id = asyncio.run(main())
        # Then the cancelled request never reached its queue; those around it did, in order
        assert _queued_ids(redis_db, "infer.m") == [first_id, after_id]
        assert gone_id not in _queued_ids(redis_db, "infer.m")
    finally:
        client.close()


def test_a_future_cancelled_before_its_group_goes_withdraws_its_request(
        redis_db: RedisDatabase, far: LatencyProxy) -> None:
    # Given a client whose first group is out (a round trip of RTT_MS)
    client = _client(far.url)
    try:
        first = client.submit("m", X)
        time.sleep(RTT_MS / 4000)
        # When a request is submitted and its future cancelled before the next group goes
        gone = client.submit("m", X)
        assert gone.cancel()
        after = client.submit("m", X)
        # Then it is never sent: sent() says it was cancelled, and the queue holds the others
        with pytest.raises(concurrent.futures.CancelledError):
            gone.sent(timeout_s=5)
        assert after.sent(timeout_s=30) is after and first.sent(timeout_s=30) is first
        assert _queued_ids(redis_db, "infer.m") == [first.id, after.id]
    finally:
        client.close()
