"""Gates: wait for the condition itself (a key, a log line, a blocked client), with a timeout,
instead of sleeping and hoping it has happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import redis

from asyncinfer.wire.keys import UNACKED_KEY

__all__ = ["wait_for", "wait_for_async", "on_broker", "blocked_in_redis"]

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """Poll ``predicate`` every ``poll_s`` until it returns something true; return that.

    Raises:
        TimeoutError: naming ``what`` when ``timeout_s`` passes first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what} not seen in {timeout_s} s")


async def wait_for_async(predicate: Callable[[], T], timeout_s: float, what: str,
                         poll_s: float = 0.02) -> T:
    """:func:`wait_for` on an event loop: the loop runs its other tasks between two looks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(poll_s)
    raise TimeoutError(f"{what} not seen in {timeout_s} s")


def on_broker(r: redis.Redis, request_ids: Iterable[str], queue: str) -> bool:
    """Whether every request is published: on ``queue`` or taken and held unacknowledged (one
    MULTI, so a message moving from one to the other is seen in one of them)."""
    pipe = r.pipeline(transaction=True)
    pipe.lrange(queue, 0, -1)
    pipe.hvals(UNACKED_KEY)
    queued, unacked = pipe.execute()
    held = b"".join(queued) + b"".join(unacked)
    return all(request_id.encode() in held for request_id in request_ids)


def blocked_in_redis(r: redis.Redis, client_id: int) -> bool:
    """Whether the connection ``client_id`` is blocked in a blocking command (CLIENT LIST flag b)."""
    return any(int(c["id"]) == client_id and "b" in c["flags"] for c in r.client_list())
