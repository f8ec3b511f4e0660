"""Every Lua script of the package loads into a real Redis (SCRIPT LOAD compiles it), under the
SHA1 of its text (what EVALSHA names)."""

from __future__ import annotations

import hashlib

import pytest
import redis

from asyncinfer.broker.scripts import names, script


@pytest.mark.parametrize("name", names())
def test_each_script_loads(redis_client: redis.Redis, name: str) -> None:
    text = script(name)
    assert redis_client.script_load(text) == hashlib.sha1(text.encode()).hexdigest()
