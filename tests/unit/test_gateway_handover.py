"""The hand-over of settled requests from the result watcher's thread to the gateway's loop
(gateway/handover.py): every waiter ends as its future did, and a burst settled while the loop
is busy costs one wake-up."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from asyncinfer.gateway.handover import Handover

pytestmark = pytest.mark.timeout(10)


def _settle_in_thread(futures: list[concurrent.futures.Future[int]]) -> None:
    """Settle ``futures`` from another thread and wait for it (the loop is blocked meanwhile)."""

    def settle() -> None:
        for i, future in enumerate(futures):
            if i % 10 == 3:
                future.set_exception(ValueError(f"request {i} failed"))
            elif i % 10 == 7:
                future.cancel()
            else:
                future.set_result(i * i)

    thread = threading.Thread(target=settle)
    thread.start()
    thread.join()


def test_a_burst_settled_in_another_thread_ends_every_waiter_in_one_wakeup() -> None:
    async def main() -> tuple[list[object], int]:
        handover = Handover(asyncio.get_running_loop())
        futures: list[concurrent.futures.Future[int]] = [concurrent.futures.Future() for _ in range(100)]
        waiters = [handover.wait(f) for f in futures]
        _settle_in_thread(futures)  # blocks the loop: all 100 are queued before it runs again
        outcomes = await asyncio.gather(*waiters, return_exceptions=True)
        return outcomes, handover.wakeups

    outcomes, wakeups = asyncio.run(main())
    assert wakeups == 1
    for i, outcome in enumerate(outcomes):
        if i % 10 == 3:
            assert isinstance(outcome, ValueError) and str(outcome) == f"request {i} failed"
        elif i % 10 == 7:
            assert isinstance(outcome, asyncio.CancelledError)
        else:
            assert outcome == i * i


def test_futures_settled_apart_wake_the_loop_each_time_and_a_done_one_needs_no_wakeup() -> None:
    async def main() -> tuple[list[int], int]:
        handover = Handover(asyncio.get_running_loop())
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(5)
        results = [await handover.wait(done)]
        for i in range(3):
            future: concurrent.futures.Future[int] = concurrent.futures.Future()
            waiter = handover.wait(future)
            _settle_in_thread([future])  # index 0: a result, 0 * 0
            results.append(await waiter + i)
        return results, handover.wakeups

    assert asyncio.run(main()) == ([5, 0, 1, 2], 3)


def test_a_waiter_whose_caller_went_away_leaves_the_request_alone() -> None:
    async def main() -> tuple[bool, bool, int]:
        handover = Handover(asyncio.get_running_loop())
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        waiter = handover.wait(future)
        waiter.cancel()
        await asyncio.sleep(0)
        _settle_in_thread([future])
        await asyncio.sleep(0.01)  # the hand-over runs and finds the waiter done
        return future.cancelled(), waiter.cancelled(), future.result()

    assert asyncio.run(main()) == (False, True, 0)
