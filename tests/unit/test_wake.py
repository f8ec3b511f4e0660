"""The idle wait in process: a watcher whose cut of the caller's block fails lives on. On a real
Redis: tests/integration/test_wake.py."""

from __future__ import annotations

import pytest
import redis

from asyncinfer.broker.wake import Waker
from asyncinfer.constants import priority_lists
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)

LISTS = priority_lists(["infer.a", "infer.b"])  # infer.a, infer.b, then their priority lists


class _Flaky:
    """A Redis client whose watched list has a message and whose CLIENT UNBLOCK fails."""

    def __init__(self) -> None:
        self.blocks = 0
        self.connection_pool = self

    def blmove(self, *_: object, **__: object) -> bytes:
        self.blocks += 1
        return b"m"

    def client_unblock(self, _client_id: int) -> bool:
        raise redis.ConnectionError("Connection closed by server.")

    def client_id(self) -> int:
        return 7

    def disconnect(self) -> None:
        pass

    def register_script(self, _script: str) -> object:
        return lambda **_: 1  # the watch is this consumer's


def test_a_watcher_survives_a_failed_unblock() -> None:
    # A watcher fires while Redis drops its connection: cutting the caller's block short fails,
    # and the wake-up stands; the thread (whose death ends a worker process) lives on
    client, own = _Flaky(), _Flaky()
    w = Waker(client, own, LISTS, block_s=1)  # type: ignore[arg-type]
    w._blocking = True  # the caller is in its blocking command
    w.start()
    try:
        w.arm()
        wait_for(lambda: client.blocks >= 1 and w._wake.is_set(), 5, "the watcher fired", poll_s=0.01)
        assert all(thread.is_alive() for thread in w._threads)
    finally:
        w.close()
