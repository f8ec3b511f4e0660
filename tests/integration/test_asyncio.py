"""The client from asyncio: ainfer, asubmit, amap, as_completed against the session worker."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest
import torch
from celery.states import READY_STATES

from asyncinfer.errors import ModelError
from asyncinfer.models.builtin import MLP
from tests.support.marks import ForwardMarks
from tests.support.waiting import on_broker, wait_for_async

pytestmark = pytest.mark.timeout(120)


def test_ainfer_returns_the_values_of_identity_and_mlp(client) -> None:
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)

    async def main() -> tuple[object, object]:
        return (await client.ainfer("identity", {"x": x}, timeout_s=60),
                await client.ainfer("mlp", x, timeout_s=60))

    same, mlp = asyncio.run(main())
    assert same["x"].dtype == np.float32 and same["x"].tobytes() == x.tobytes()
    with torch.no_grad():
        expected = MLP().forward({"input": torch.from_numpy(x)})["output"].numpy()
    np.testing.assert_allclose(mlp["output"], expected, rtol=1e-5, atol=1e-6)


def test_fifty_concurrent_ainfer_each_get_their_own_rows(client) -> None:
    async def main() -> list[object]:
        return await asyncio.gather(*(
            client.ainfer("identity", np.array([[i, -i]], np.int32), timeout_s=60)
            for i in range(50)))

    responses = asyncio.run(main())
    assert [r["input"].tolist() for r in responses] == [[[i, -i]] for i in range(50)]


def test_async_for_over_amap_yields_in_input_order(client) -> None:
    async def main() -> list[list[list[float]]]:
        inputs = [np.array([[0.05 * (7 - i)]], np.float32) for i in range(8)]  # later = faster
        return [r["output"].tolist() async for r in client.amap("sleep", inputs, timeout_s=60)]

    assert asyncio.run(main()) == [[[np.float32(0.05 * (7 - i)).item()]] for i in range(8)]


def test_as_completed_yields_every_response(client) -> None:
    async def main() -> list[int]:
        futures = [await client.asubmit("identity", np.array([[i]], np.int64)) for i in range(5)]
        futures.append(client.submit("identity", np.array([[5]], np.int64)))  # a plain future too
        return [int(r["input"][0, 0]) async for r in client.as_completed(futures, timeout_s=60)]

    assert sorted(asyncio.run(main())) == list(range(6))


def test_the_event_loop_keeps_running_while_requests_are_pending(client) -> None:
    # Given a ticker task on the loop
    async def main() -> tuple[int, list[object]]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        # When 20 requests that each sleep 0.2 s on the worker are awaited
        responses = await asyncio.gather(*(
            client.ainfer("sleep", np.array([[0.2]], np.float32), timeout_s=60) for _ in range(20)))
        seen = ticks
        stop.set()
        await ticking
        return seen, responses

    ticks, responses = asyncio.run(main())
    # Then every response is right, and the ticker ran all along (≥ 0.2 s of 10 ms ticks)
    assert [r["output"].tolist() for r in responses] == [[[np.float32(0.2).item()]]] * 20
    assert ticks > 5


def test_a_failing_request_raises_the_same_exception_through_await(client) -> None:
    # Given the type the synchronous API raises for a poisoned request
    with pytest.raises(ModelError) as sync_error:
        client.infer("poison", np.array([[-1.0]], np.float32), timeout_s=60)

    async def main() -> None:
        await client.ainfer("poison", np.array([[-2.0]], np.float32), request_id=request_id,
                            timeout_s=60)

    request_id = "apoison-" + uuid.uuid4().hex
    # Then await raises the same type, naming the request
    with pytest.raises(type(sync_error.value), match=f"request {request_id}: model 'poison' raised"):
        asyncio.run(main())


def test_ainfer_timeout_raises_timeout_error_naming_the_request(client) -> None:
    request_id = "atimeout-" + uuid.uuid4().hex

    async def main() -> None:
        await client.ainfer("sleep", np.array([[0.5]], np.float32), request_id=request_id,
                            timeout_s=0.01)

    with pytest.raises(TimeoutError, match=request_id):
        asyncio.run(main())
    assert client.result(request_id, timeout_s=60)["output"].tolist() == [[0.5]]  # still ran


def _wait_state(client, request_id: str, wanted: str, timeout_s: float = 30.0) -> str:
    state = "PENDING"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = client.app.AsyncResult(request_id).state
        if state == wanted or state in READY_STATES:
            break
        time.sleep(0.05)
    return state


def test_cancelling_an_awaited_request_revokes_it(client, redis_client) -> None:
    # Given the sleep model busy with a long request
    marks = ForwardMarks(redis_client, "sleep")
    blocker = client.submit("sleep", np.array([[1.5]], np.float32))
    assert _wait_state(client, blocker.id, "STARTED") in ("STARTED", "SUCCESS")
    marks.wait_on_device(1.5)  # the blocker's batch is on the device, so the next ones cannot join it
    ids = {kind: f"acancel-{kind}-{uuid.uuid4().hex}" for kind in ("asubmit", "ainfer", "timeout")}
    queued = np.array([[0.0]], np.float32)

    async def main() -> tuple[bool, list[object]]:
        # When tasks awaiting requests queued behind it are cancelled: one awaiting the future of
        # asubmit, one awaiting ainfer, one awaiting ainfer with a timeout
        future = await client.asubmit("sleep", queued, request_id=ids["asubmit"])

        async def wait_for_it() -> object:
            return await future

        tasks = [asyncio.create_task(wait_for_it()),
                 asyncio.create_task(client.ainfer("sleep", queued, request_id=ids["ainfer"])),
                 asyncio.create_task(client.ainfer("sleep", queued, request_id=ids["timeout"],
                                                   timeout_s=60))]
        await wait_for_async(lambda: on_broker(redis_client, ids.values(), "infer.sleep"), 30,
                             "the three requests on the broker")  # published and waiting
        for task in tasks:
            task.cancel()
        return future.cancelled(), await asyncio.gather(*tasks, return_exceptions=True)

    future_cancelled, outcomes = asyncio.run(main())
    assert future_cancelled
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
    blocker.result(timeout=60)
    # Then Celery records every one of them as revoked
    for request_id in ids.values():
        assert _wait_state(client, request_id, "REVOKED") == "REVOKED", request_id


def test_the_client_page_asyncio_example_runs(worker, redis_url) -> None:
    import re
    import subprocess
    import sys

    from tests.support.processes import ROOT, worker_env

    text = (ROOT / "docs" / "client.md").read_text()
    code = re.search(r"<!-- asyncio-example[^>]*-->\s*```python\n(.*?)```", text, re.S).group(1)
    out = subprocess.run([sys.executable, "-c", code], env=worker_env(redis_url), cwd=ROOT,
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["(1, 4) [[[0]], [[1]], [[2]]]"] + ["(1, 4)"] * 3


def test_a_small_request_is_published_by_the_loop_itself_and_a_large_one_off_it(client) -> None:
    # Given a client whose unknown-model check already knows identity (one request sent before)
    client.infer("identity", np.zeros((1, 1), np.float32), timeout_s=60)
    small = np.arange(8, dtype=np.float32).reshape(1, 8)
    large = np.ones((1, 100_000), np.float32)  # 400 kB: encoded off the loop

    async def main() -> tuple[object, bool, object, bool]:
        loop = asyncio.get_running_loop()
        big = await client.ainfer("identity", large, timeout_s=60)
        after_large = loop in client.loop_publishers._by_loop
        one = await client.ainfer("identity", small, timeout_s=60)
        after_small = loop in client.loop_publishers._by_loop
        await client.loop_publishers.aclose()
        return big, after_large, one, after_small

    big, after_large, one, after_small = asyncio.run(main())
    # Then the large one went through the executor, the small one through the loop's own
    # connection, and both came back whole
    assert not after_large and after_small
    assert big["input"].tobytes() == large.tobytes() and one["input"].tolist() == small.tolist()


def test_a_coroutine_waiting_for_room_in_a_full_queue_does_not_block_the_loop(redis_db) -> None:
    from asyncinfer.client import Client
    from asyncinfer.config.settings import Settings
    from asyncinfer.errors import QueueFull

    # Given a bounded queue (mlp: max_queue_size 1) that nobody consumes, already full
    settings = Settings(broker_url=redis_db.url, model_retention_s=0,
                        model_options='{"mlp": {"max_queue_size": 1}}')
    c = Client(settings=settings)
    x = np.zeros((1, 16), np.float32)
    try:
        c.submit("mlp", x).sent(timeout_s=30)  # on the queue before the coroutine's

        async def main() -> tuple[float, int, BaseException | None, bool]:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.02)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            started, error = time.monotonic(), None
            try:
                await c.asubmit("mlp", x, timeout_s=0.6)
            except QueueFull as exc:
                error = exc
            waited_s = time.monotonic() - started
            ticker.cancel()
            on_loop = asyncio.get_running_loop() in c.loop_publishers._by_loop
            await c.loop_publishers.aclose()
            return waited_s, ticks, error, on_loop

        waited_s, ticks, error, on_loop = asyncio.run(main())
        # Then it waited its 0.6 s for room on the loop's own connection, the loop ran on
        # meanwhile, and it was refused with QueueFull naming the queue and its bound
        assert isinstance(error, QueueFull) and "infer.mlp" in str(error) and "max_queue_size 1" in str(error)
        assert on_loop and waited_s >= 0.55 and ticks >= 10, (on_loop, waited_s, ticks)
        assert int(c.broker.llen("infer.mlp")) == 1
    finally:
        c.close()
