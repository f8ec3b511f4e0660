"""The hiredis command packer writes what redis-py's own packer writes, and refuses what it
refuses (broker/command_packer.py)."""

from __future__ import annotations

import pytest
import redis
from redis.connection import Connection

from asyncinfer.broker.command_packer import HiredisPacker, connection_kwargs
from asyncinfer.broker.connections import redis_client


def _redis_py(*args: object) -> bytes:
    return b"".join(Connection()._command_packer.pack(*args))


@pytest.mark.parametrize("args", [
    ("SET", "k", "v"),
    ("EVALSHA", "a" * 40, 2, "key:1", b"key:2", 0, 3600, 1.5, -7, 1e20, 0.1, "é \u2603"),
    ("CLIENT SETNAME", "gateway"),  # a command name of two words
    (b"SCRIPT LOAD", b"return 1"),
    ("LPUSH", "q", b"\x00\r\n" * 5000),  # past redis-py's buffer cutoff
    ("SET", "k", bytearray(b"xy")),  # a type hiredis leaves to redis-py
])
def test_it_writes_what_redis_py_writes(args: tuple[object, ...]) -> None:
    assert b"".join(HiredisPacker().pack(*args)) == _redis_py(*args)


@pytest.mark.parametrize("bad", [True, None, [1], {"a": 1}])
def test_it_refuses_what_redis_py_refuses_with_its_error(bad: object) -> None:
    with pytest.raises(redis.DataError, match="Invalid input of type"):
        HiredisPacker().pack("SET", "k", bad)


def test_every_client_the_project_opens_packs_with_it_unless_told_otherwise() -> None:
    client = redis_client("redis://127.0.0.1:1/0")
    assert isinstance(client.connection_pool.connection_kwargs["command_packer"], HiredisPacker)
    own = object()
    assert connection_kwargs({"command_packer": own})["command_packer"] is own
